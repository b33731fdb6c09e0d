// The transformer block, written once for every architecture (ModelConfig says what differs) and
// for both uses: inference (forward.cpp: keys and values into the KV cache, buffers reused from
// layer to layer) and training (train/backward.cpp: every activation the backward pass needs kept
// per layer, or recomputed from the layer's input). Each op's backward sits next to its forward.
//
//   h1    = x + post_attn_norm(attention(norm(x)) Wo^T + bo)
//   x_out = h1 + post_ffn_norm(mlp(norm(h1)))
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "model/attention.h"
#include "model/model.h"

namespace focus {

// The projections of a block that an adapter can sit on.
enum Projection : int { kProjQ = 0, kProjK = 1, kProjV = 2, kProjO = 3 };
inline constexpr int kProjections = 4;

// A trainable addition to some projections of a frozen model (LoRA: train/lora.h), applied in
// training without merging it into the weights: y += delta(x).
class ProjectionAdapter {
 public:
  virtual ~ProjectionAdapter() = default;
  virtual bool adapts(int64_t layer, int proj) const = 0;
  // y [T, out] += delta(x [T, in]); keep receives what backward needs.
  virtual void forward(int64_t layer, int proj, const float* x, int64_t T, float* y, std::vector<float>& keep) const = 0;
  // Given dy [T, out], adds the adapter's share of dL/dx into dx and accumulates the gradients of
  // its own parameters (when it trains them).
  virtual void backward(int64_t layer, int proj, const float* x, const std::vector<float>& keep, const float* dy,
                        int64_t T, float* dx) const = 0;
};

// One layer's activations. Inference reuses one set for every layer; training keeps one per
// layer (or one, recomputed) for the backward pass.
struct BlockActs {
  std::vector<float> xn1;           // attention norm output [T, D]
  std::vector<float> q_pre, k_pre;  // q, k before the QK norms (training only)
  std::vector<float> q, k, v;       // as attention saw them (k, v: training, and the new rows
                                    // before a 16-bit cache stores them; a float cache gets
                                    // them written in place)
  std::vector<float> k_all, v_all;  // a 16-bit cache widened, for policies that read floats
  std::vector<float> att;           // attention output [T, q_dim]
  std::vector<float> q_raw, kv_a;   // MLA: the query projection [T, q_proj_dim] and the latent +
                                    // key RoPE part [T, kv_rank + rope] as projected
  std::vector<float> c_pre;         // MLA: the latent before its norm [T, kv_rank]
  std::vector<float> c_norm;        // MLA: the latent after its norm [T, kv_rank] (scratch)
  std::vector<float> q_a_pre, q_a;  // MLA with a q rank: the query latent before / after its norm
  std::vector<float> att_v;         // MLA: the heads' values out of the latent [T, o_proj_dim]
  AttentionTape tape;               // the policy's own (training)
  std::vector<float> a_pre;         // attention projection before the post-attention norm
  std::vector<float> h1;            // residual after the attention block [T, D]
  std::vector<float> xn2;           // MLP norm output
  std::vector<float> gate, up;      // MLP pre-activations [T, ffn] (GELU: up only)
  std::vector<float> act;           // MLP activation output (training; inference works in place)
  std::vector<float> m_pre;         // MLP projection before the post-MLP norm
  std::array<std::vector<float>, kProjections> adapter_keep;
};

// Where one block call reads and writes. Inference: k_cache/v_cache point at row 0 of the
// layer's cache, of kv_type elements; the new rows go to row pos0 on. Training: pos0 = 0 and
// both are left null (the block keeps k and v in BlockActs).
struct BlockIO {
  int64_t layer = 0, pos0 = 0, T = 0;
  const float* x_in = nullptr;  // [T, D] the residual stream
  float* x_out = nullptr;       // [T, D], may be x_in
  cpu::KvType kv_type = cpu::KvType::F32;
  void* k_cache = nullptr;
  void* v_cache = nullptr;
};

// x [T, D] = embedding of ids (times the model's embed scale) plus learned positions pos0 ...
void embed_tokens(const Model& m, const int32_t* ids, int64_t T, int64_t pos0, float* x);

// The model's norm (RMS or layer norm) over rows of width dim, and its backward: dx (+)= dL/dx.
void model_norm(const ModelConfig& c, const float* x, const float* w, const float* b, float* out, int64_t rows);
void model_norm_backward(const ModelConfig& c, const float* x, const float* w, const float* dy, float* dx,
                         int64_t rows, bool accumulate);

// Inference: one block over the new rows, attention by `policy` over the cache (state: the
// layer's slot in the KV cache).
void block_forward(const Model& m, const AttentionPolicy& policy, const BlockIO& io, BlockActs& A,
                   std::unique_ptr<AttentionState>& state, AttentionStats* stats);

// Training: one block over a window (io.pos0 == 0), keeping in A what block_backward needs.
void block_train_forward(const Model& m, const AttentionPolicy& policy, const BlockIO& io, BlockActs& A,
                         const ProjectionAdapter* adapter);

// Where the gradients of one layer's own parameters accumulate (+=), laid out like LayerWeights
// (matrices [out, in] row-major); a null pointer leaves that parameter untrained. Training from
// scratch sets them all; the trainers of routers and adapters on a frozen model set none.
struct LayerGrads {
  float* attn_norm = nullptr;  float* attn_norm_b = nullptr;
  float* wq = nullptr;  float* bq = nullptr;
  float* wk = nullptr;  float* bk = nullptr;
  float* wv = nullptr;  float* bv = nullptr;
  float* wo = nullptr;  float* bo = nullptr;
  float* q_norm = nullptr;  float* k_norm = nullptr;
  float* post_attn_norm = nullptr;
  float* ffn_norm = nullptr;  float* ffn_norm_b = nullptr;
  float* w_gate = nullptr;
  float* w_up = nullptr;  float* b_up = nullptr;
  float* w_down = nullptr;  float* b_down = nullptr;
  float* post_ffn_norm = nullptr;
  float* kv_a_norm = nullptr;  float* w_kv_b = nullptr;  // MLA
  float* wq_a = nullptr;  float* q_a_norm = nullptr;     // MLA with a q rank
};

// Scratch of the backward pass, reused across layers.
struct BlockGradScratch {
  std::vector<float> d1, dact, dgate, dup, dxn, datt, dq, dk, dv;
  std::vector<float> datt_v, dq_raw, dkv_a, dc_norm, dc, dq_a_norm, dq_a;  // MLA
};

// Given dx = dL/dx_out [T, D], the block's input x_in and its activations, replaces dx with
// dL/dx_in and accumulates the gradients of the policy's and the adapter's parameters, and of the
// layer's own weights into g (when given).
void block_backward(const Model& m, const AttentionPolicy& policy, int64_t layer, int64_t T, const float* x_in,
                    BlockActs& A, const ProjectionAdapter* adapter, float* dx, BlockGradScratch& S,
                    const LayerGrads* g = nullptr);

}  // namespace focus
