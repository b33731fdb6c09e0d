// Model weights in float32 (quantised files are dequantised once at load).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "model/config.h"

namespace focus {

// One layer's parameters; null pointers mean "absent" (no bias, no extra norm ...).
// Matrices are (out, in) row-major like a Linear layer.
struct LayerWeights {
  const float* attn_norm = nullptr;  const float* attn_norm_b = nullptr;   // [dim]
  const float* wq = nullptr;  const float* bq = nullptr;                   // [q_dim, dim]
  const float* wk = nullptr;  const float* bk = nullptr;                   // [kv_dim, dim]
  const float* wv = nullptr;  const float* bv = nullptr;                   // [kv_dim, dim]
  const float* wo = nullptr;  const float* bo = nullptr;                   // [dim, q_dim]
  const float* q_norm = nullptr;  const float* k_norm = nullptr;           // [head_dim]
  const float* post_attn_norm = nullptr;                                    // [dim]
  const float* ffn_norm = nullptr;  const float* ffn_norm_b = nullptr;     // [dim]
  const float* w_gate = nullptr;                                            // [ffn, dim]
  const float* w_up = nullptr;  const float* b_up = nullptr;               // [ffn, dim]
  const float* w_down = nullptr;  const float* b_down = nullptr;           // [dim, ffn]
  const float* post_ffn_norm = nullptr;                                     // [dim]
};

struct ModelWeights {
  const float* tok_emb = nullptr;   // [vocab, dim]
  const float* pos_emb = nullptr;   // [max_ctx, dim] (learned positions)
  const float* out_norm = nullptr;  const float* out_norm_b = nullptr;
  const float* lm_head = nullptr;   // [vocab, dim] (== tok_emb when tied)
  std::vector<LayerWeights> layers;

  // Owned storage behind the pointers above.
  std::vector<std::vector<float>> storage;
  const float* keep(std::vector<float> v) {
    storage.push_back(std::move(v));
    return storage.back().data();
  }
  int64_t n_params = 0;              // distinct parameters (tied output counted once)
  std::vector<std::string> tensor_types;  // e.g. "Q4_1 x 210" for info
};

}  // namespace focus
