// Attention mass by key group, for router distillation: how much of a frozen model's attention
// probability each query row puts on the keys of each group, counting only the "far" pairs that
// Focus attention would route (beyond the local window and not a sink).
//
// Self-attention over n = s.n_q tokens at positions 0 .. n-1 (s.n_kv == n, s.q_pos0 == 0),
// causal, no sliding window (s.sliding_window == 0). Given the dense forward's lse [H, n]
// (flash_attention), the probability of pair (i, j) for head h is
//   A^h_ij = exp(scale * q_ih . k_j,kv(h) - lse[h, i])        for j <= i
// and a pair is far when F(i, j) = (j <= i - w) and (j >= S), w = s.local_window >= 1,
// S = s.sinks. Uses n_q, n_kv, q_pos0, heads, kv_heads, head_dim, q_stride, kv_stride (0 means
// contiguous), scale, local_window, sinks and sliding_window.
//
// Heads: MassHeads::Mean averages over all H heads (one output row per token); MassHeads::PerKvHead
// gives one row per kv head, the average over the H / HKV query heads that share it (GQA groups).
// Write R for the rows per token: 1 (Mean) or HKV (PerKvHead).
//
// Layouts (row-major, contiguous):
//   q [n, H, Dh] (rows q_stride apart)   k [n, HKV, Dh] (rows kv_stride apart)   lse [H, n]
//   X, dX   [n, C]      the key assignment over C groups, shared by every head (soft or one-hot)
//   M, dM   [n, R, C]   far     [n, R]
//
// Flash-style: 64 x 64 tiles of recomputed scores, no n x n buffer; the probabilities of the heads
// that are averaged together are summed in the tile first, so the product with X (or dM) is done
// once per output row, not once per head: O(n^2 (H Dh + R C)). Tiles with no far pair are
// skipped. The forward is parallel over query tiles and the backward over key tiles, so every
// output row has one writer and the bits do not depend on the thread count.
#pragma once
#include <cstdint>

#include "kernels/cpu/attn_shape.h"

namespace focus::cpu {

enum class MassHeads { Mean, PerKvHead };

// Pairs left out of the mass (per head), e.g. those another selection reads already: with
// words = ceil(n / 64),
//   by_row[(h * n + i) * words + j / 64] has bit j % 64 set when pair (i, j) of head h is left out,
//   by_key[(h * n + j) * words + i / 64] the same bits, transposed (the backward reads it).
// h counts the call's heads (s.heads). A left-out pair counts neither in M nor in far, and its
// gradient is zero.
struct MassExclusion {
  const uint64_t* by_row = nullptr;
  const uint64_t* by_key = nullptr;
  int64_t words = 0;
};

// M[i, r, :] = mean over the heads h of r of sum_{j: F(i, j)} A^h_ij X[j, :], written (not
// accumulated); far[i, r] = the same with X = 1, the total far mass of the row. M and far may each
// be null (X may be null when M is). With ex, its pairs are not far.
void attention_mass_forward(const float* q, const float* k, const float* lse, const float* X, int64_t C,
                            const AttnShape& s, MassHeads heads, float* M, float* far = nullptr,
                            const MassExclusion* ex = nullptr);

// The transpose, with A held fixed (no gradient into q, k or lse):
//   dX[j, :] += sum_i sum_r [F(i, j)] (mean over the heads h of r of A^h_ij) dM[i, r, :].
// Accumulates into dX; zero it first for a fresh gradient. With ex, its pairs are not far.
void attention_mass_backward(const float* q, const float* k, const float* lse, const float* dM, int64_t C,
                             const AttnShape& s, MassHeads heads, float* dX, const MassExclusion* ex = nullptr);

}  // namespace focus::cpu
