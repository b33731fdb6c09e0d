// Soft-mode Focus attention (training), spec section 2: dense causal attention in which a pair
// (i, j) beyond the local window and not a sink gets the additive logit bias
//   bias_ij = log(sum_g p_ig p_jg + eps)      if i - j >= local_window and j >= sinks
//   bias_ij = 0                               otherwise (local window, sinks)
// so the router probabilities p [N, G] (shared by all heads) receive gradient through it.
// With p == nullptr there is no bias: plain dense causal attention, forward and backward.
//
// Flash-style on the CPU: 64 x 64 tiles with an online softmax; the bias of a tile is made on the
// fly as log of a [64 x G] x [G x 64] product, once per tile for all heads. Memory is O(N * tile);
// no N x N matrix exists. The backward recomputes scores from o and lse (FlashAttention-2) and is
// deterministic for a fixed thread count.
//
// Shape: n = s.n_q tokens, self-attention (s.n_kv == n, s.q_pos0 == 0); heads, kv_heads,
// head_dim, scale, local_window, sinks, groups (columns of p; ignored when p == nullptr), eps and
// sliding_window (a hard visibility limit for sliding-window layers, 0 = full causal). Rows are
// contiguous: each stride must be 0 (meaning contiguous) or the row width.
// Layouts (contiguous, one sequence, queries and keys at positions 0 .. n-1):
//   q, o, dq   [N, H, Dh]      k, v, dk, dv   [N, HKV, Dh]  (H % HKV == 0: MHA, GQA, MQA)
//   p, dp      [N, G]          lse            [H, N] natural-log sum-exp of the biased scores
#pragma once
#include <cstdint>

#include "kernels/cpu/attn_shape.h"

namespace focus::cpu {


// Asymmetric form (the routing of focus/focus_attention.h trained through its hard pattern): the
// queries' and the keys' memberships differ, and each of RH routers serves kv_heads / RH kv heads
// (kv head h reads router h / (kv_heads / RH)):
//   bias_ij (heads of router r) = log(sum_g p[r, i, g] pk[r, j, g] + eps)
// with p, pk [RH, N, G] (RH divides kv_heads). With pk == nullptr, pk = p (and RH must be 1).
// With 0/1 memberships and a tiny eps this is the hard pattern itself (a masked pair keeps a
// weight of eps), and dL/dA_ij = dL/dbias_ij / (A_ij + eps) is, for a masked pair, the first-order
// change of the loss if the pair were read: the straight-through gradient of the mask.
//
// The hybrid pattern (training through it): query head h of row i also reads the keys of the
// positional blocks set in block_bits [H, N, block_words] (bit b: keys b*block_size ..
// (b+1)*block_size-1). A far pair (i, j) so read has, for head h of router r,
//   A_ij = exp(eq[r, i] + ek[r, j])   in place of   sum_g p[r, i, g] pk[r, j, g]
// (the far-pair terms; eq, ek null: 0). Its gradient goes to deq, dek [RH, N] (accumulated, when
// not null), none to the memberships: a pair a block reads is read whatever the groups.
// With head_groups, a query head h whose entry is 0 reads no group (the group switch of
// block_budget.h): its far pairs outside its blocks have A_ij = 0 (weight eps) and give no
// gradient to the memberships.
struct SoftKeys {
  const float* pk = nullptr;  // [RH, N, G] key memberships, or null: the keys use p
  float* dpk = nullptr;       // [RH, N, G] their gradient (accumulated), or null to skip it
  int64_t route_heads = 1;    // RH
  const uint64_t* block_bits = nullptr;  // [H, N, block_words], or null: no blocks
  int64_t block_size = 0, block_words = 0;
  const float* eq = nullptr;  // [RH, N] far-pair terms of the queries, or null
  const float* ek = nullptr;  // [RH, N] of the keys, or null
  float* deq = nullptr;       // [RH, N] gradients of the terms through the pairs blocks read, or null
  float* dek = nullptr;
  const int64_t* head_groups = nullptr;  // [H]: 0 where the head reads blocks alone, or null: every head reads its groups
};

// (q, k, v, p) -> o [N, H, Dh], lse [H, N] (lse may be null).
void soft_attention_forward(const float* q, const float* k, const float* v, const float* p, float* o, float* lse,
                            const AttnShape& s, const SoftKeys& keys = {});

// Given dout [N, H, Dh] and the forward's o and lse, accumulates (+=) dq, dk, dv and, when p is
// not null, dp [N, G] (dp may be null to skip it; with keys.pk the queries' side only, the keys'
// side going to keys.dpk). Buffers the caller wants fresh must be zeroed.
void soft_attention_backward(const float* q, const float* k, const float* v, const float* p, const float* o,
                             const float* lse, const float* dout, float* dq, float* dk, float* dv, float* dp,
                             const AttnShape& s, const SoftKeys& keys = {});

}  // namespace focus::cpu
