// Soft-mode Focus attention (training), spec section 2: dense causal attention in which a pair
// (i, j) beyond the local window and not a sink gets the additive logit bias
//   bias_ij = log(sum_g p_ig p_jg + eps)      if i - j >= window and j >= sinks
//   bias_ij = 0                               otherwise (window, sinks)
// so the router probabilities p [N, G] (shared by all heads) receive gradient through it.
// With p == nullptr there is no bias: plain dense causal attention, forward and backward.
//
// Flash-style on the CPU: 64 x 64 tiles with an online softmax; the bias of a tile is made on the
// fly as log of a [64 x G] x [G x 64] product, once per tile for all heads. Memory is O(N * tile);
// no N x N matrix exists. The backward recomputes scores from o and lse (FlashAttention-2) and is
// deterministic for a fixed thread count.
//
// Layouts (contiguous, one sequence, queries and keys at positions 0 .. n-1):
//   q, o, dq   [N, H, Dh]      k, v, dk, dv   [N, HKV, Dh]  (H % HKV == 0: MHA, GQA, MQA)
//   p, dp      [N, G]          lse            [H, N] natural-log sum-exp of the biased scores
#pragma once
#include <cstdint>

namespace focus {

struct SoftAttnShape {
  int64_t n = 0;         // tokens
  int64_t heads = 0;     // H
  int64_t kv_heads = 0;  // HKV
  int64_t head_dim = 0;  // Dh
  int64_t groups = 0;    // G (columns of p); ignored when p == nullptr
  int64_t window = 0;    // Focus local window w: pairs with i - j < w get no bias
  int64_t sinks = 0;     // S: keys j < S get no bias
  float scale = 0.f;     // multiplies q . k
  float eps = 1e-6f;     // inside the log of the bias
  // Hard visibility limit for sliding-window layers: 0 = full causal; > 0 = key j is visible to
  // query i iff i - sliding_window < j <= i (as cpu::AttnShape::window).
  int64_t sliding_window = 0;
};

// (q, k, v, p) -> o [N, H, Dh], lse [H, N] (lse may be null).
void soft_attention_forward(const float* q, const float* k, const float* v, const float* p, float* o, float* lse,
                            const SoftAttnShape& s);

// Given dout [N, H, Dh] and the forward's o and lse, accumulates (+=) dq, dk, dv and, when p is
// not null, dp [N, G] (dp may be null to skip it). Buffers the caller wants fresh must be zeroed.
void soft_attention_backward(const float* q, const float* k, const float* v, const float* p, const float* o,
                             const float* lse, const float* dout, float* dq, float* dk, float* dv, float* dp,
                             const SoftAttnShape& s);

}  // namespace focus
