// Model weights. The matrices of the linear layers (and the embedding table) are Weights: in the
// model file's own format (quantised blocks, F16, BF16 or F32, memory-mapped where the file allows)
// or converted at load, as LoadOptions::weights says. Norm scales and biases are float32.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cpu/weight.h"
#include "model/config.h"

namespace focus {

// One layer's parameters; null pointers mean "absent" (no bias, no extra norm ...).
// Matrices are (out, in) row-major like a Linear layer.
struct LayerWeights {
  const float* attn_norm = nullptr;  const float* attn_norm_b = nullptr;   // [dim]
  Weight wq;  const float* bq = nullptr;                   // [q_dim, dim] (MLA: [q_proj_dim, dim], or
                                                           // q_b_proj [q_proj_dim, q_rank] with a q rank)
  Weight wk;  const float* bk = nullptr;                   // [kv_dim, dim] (MLA: the latent and the
                                                           // key's RoPE part, [kv_rank + rope, dim])
  Weight wv;  const float* bv = nullptr;                   // [kv_dim, dim] (MLA: absent)
  Weight wo;  const float* bo = nullptr;                   // [dim, q_dim] (MLA: [dim, o_proj_dim])
  // MLA: the latent's norm [kv_rank] and the up-projection of keys and values [heads * (nope + v),
  // kv_rank], float32 (per head: nope rows of keys, then v rows of values).
  const float* kv_a_norm = nullptr;
  Weight w_kv_b;
  // MLA with low-rank queries: q_a_proj [q_rank, dim] and the norm of its output [q_rank].
  Weight wq_a;
  const float* q_a_norm = nullptr;
  const float* q_norm = nullptr;  const float* k_norm = nullptr;           // [head_dim]
  const float* post_attn_norm = nullptr;                                    // [dim]
  const float* ffn_norm = nullptr;  const float* ffn_norm_b = nullptr;     // [dim]
  Weight w_gate;                                            // [ffn, dim]
  Weight w_up;  const float* b_up = nullptr;               // [ffn, dim]
  Weight w_down;  const float* b_down = nullptr;           // [dim, ffn]
  const float* post_ffn_norm = nullptr;                                     // [dim]
};

struct ModelWeights {
  Weight tok_emb;   // [vocab, dim]
  const float* pos_emb = nullptr;   // [max_ctx, dim] (learned positions)
  const float* out_norm = nullptr;  const float* out_norm_b = nullptr;
  Weight lm_head;   // [vocab, dim] (== tok_emb when tied)
  std::vector<LayerWeights> layers;

  // Owned storage behind the pointers above, and whatever keeps a memory-mapped file alive.
  std::vector<std::vector<float>> storage;
  std::vector<std::vector<uint16_t>> storage16;
  std::vector<std::shared_ptr<const void>> owners;
  const float* keep(std::vector<float> v) {
    storage.push_back(std::move(v));
    return storage.back().data();
  }
  const uint16_t* keep16(std::vector<uint16_t> v) {
    storage16.push_back(std::move(v));
    return storage16.back().data();
  }
  int64_t n_params = 0;              // distinct parameters (tied output counted once)
  std::vector<std::string> tensor_types;  // e.g. "Q4_1 x 210" for info (as in the file)
  std::string weights_mode;                // "native", "f32" or "bf16": how the matrices are held
  // Bytes of the matrices as held in memory (views of a mapped file included).
  int64_t matrix_bytes() const;
};

}  // namespace focus
