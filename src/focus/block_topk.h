// Block top-k attention, the training-free baseline in the manner of Quest: keys are cut into
// blocks of B consecutive positions, and each (query row, query head) reads, beyond its local
// window and the sinks, the block that holds its last far key plus the K complete far blocks
// with the largest upper bound of q.k,
//   bound(q, b) = sum_d max(q_d * kmax_b,d, q_d * kmin_b,d),
// where kmin_b and kmax_b are the elementwise minimum and maximum of block b's keys (after RoPE,
// per kv head). Ties go to the lower block index.
//
// Registered as the attention policy "blocktopk" with the options block (B, default 64), k (K,
// default 8), window (w, default 256), sinks (S, default 1) and every (R, default 1: the blocks
// chosen once per R rows, BlockTopKSettings::select_every), e.g.
//   focus eval --attention blocktopk:block=64,k=8,window=256,sinks=1
// It runs on the grouped kernel (kernels/cpu/grouped_attention.h): key j is in group j / B, and a
// row's group list is its blocks. Only complete blocks are scored, so a block's bounds never
// change once it exists: prefill, chunked prefill and token-by-token decoding route alike.
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "kernels/cpu/grouped_attention.h"
#include "kernels/cpu/kv_types.h"
#include "kernels/cpu/simd.h"
#include "model/attention.h"

namespace focus {

struct BlockTopKSettings {
  int64_t block = 64;    // B: key j is in block j / B
  int64_t k = 8;         // K: far blocks chosen by their bound, besides the forced current one
  int64_t window = 256;  // w: keys p - w < j <= p are always visible
  int64_t sinks = 1;     // S: keys j < S are always visible
  // R: the blocks are chosen once every R rows. Row p's last far key f = p - w; the row with
  // f0 = f - f % R (its tile's first, at or before p: causal) chooses the top K blocks before its
  // own current block f0 / B, and every row of the tile reads those K, plus every block from f0 / B
  // to its own current block. R = 1: each row chooses for itself. A tile of R rows scores the
  // blocks once instead of R times, and its rows read the same blocks.
  int64_t select_every = 1;
  // Per query head of the layer: its own K (block_budget.h); empty: every head reads k. When set,
  // k is their maximum.
  std::vector<int64_t> head_k;
  // Per query head: the near blocks it reads besides its K, the N complete blocks just before the
  // block of its last far key, whatever their bound (a window wider by N blocks; block_budget.h);
  // empty: none. Not with select_every > 1.
  std::vector<int64_t> head_near;
  // A constant added to the scaled score of every pair read beyond the window and the sinks
  // (option far=C; 0: none): a training-free counterpart of the routers' far-pair terms, which
  // shift the far pairs a sparse row reads against its window.
  float far_bias = 0.f;
  int64_t k_of(int64_t h) const { return head_k.empty() ? k : head_k[h]; }
  int64_t near_of(int64_t h) const { return head_near.empty() ? 0 : head_near[h]; }
  // Per-head budgets (and near blocks, empty or one per head), k the largest K_h + N_h.
  void set_head_k(std::vector<int64_t> v, std::vector<int64_t> near = {}) {
    head_k = std::move(v);
    head_near = std::move(near);
    k = 0;
    for (size_t h = 0; h < head_k.size(); ++h) k = std::max(k, head_k[h] + (head_near.empty() ? 0 : head_near[h]));
  }
};

// The order blocks are chosen in: larger bound first, ties to the lower block index, so the
// choice does not depend on the order the candidates were scored in.
inline bool block_ranks_before(const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// The settings of a spec's options (block, k, window, sinks, or budget=FILE: per-head budgets
// measured by `focus budget`, which also fix block, window and sinks) for a layer of c; throws
// focus::Error naming a bad one.
BlockTopKSettings block_topk_settings(const AttentionOptions& options, const ModelConfig& c, int64_t layer);

// The policy itself, shared by every layer it runs on.
std::shared_ptr<const AttentionPolicy> block_topk_attention(const BlockTopKSettings& s);

// What the policy keeps about one layer's cached keys: their blocks (the kernel's key groups and
// the index of their members) and the bounds of every complete block.
struct BlockTopKState final : AttentionState {
  // Blocks are scored kBlockTile at a time: a tile's minima (and maxima) are stored dimension by
  // dimension, the tile's blocks side by side, so one vector operation serves a tile's blocks.
  static constexpr int64_t kBlockTile = cpu::simd::kV;
  BlockTopKState(int64_t block_, int64_t kv_heads_, int64_t head_dim_)
      : block(block_), kv_heads(kv_heads_), head_dim(head_dim_) {
    index.reset(1, 1);
  }
  int64_t block = 0, kv_heads = 0, head_dim = 0;
  cpu::GroupedKeyIndex index;  // key j in group j / block; grows with the sequence, never rebuilt
  // Elementwise minimum and maximum of each complete block's keys, per kv head:
  // [tiles][kv_heads][head_dim][min, max][kBlockTile]; lanes of blocks not complete are unused.
  std::vector<float> range;
  int64_t index_grows = 0;   // how often the index gained groups (once per new block at most)
  // With select_every R > 1: the blocks chosen by each tile's first row (position w + i R for
  // tile i), kept so that the tile's later rows (a decoding step, a chunk that starts inside the
  // tile) read them: tile i's lists, one per query head, each of the same width, are
  // chosen[chosen_at[i] ..  chosen_at[i + 1]). R and w are those of the first call that kept any.
  std::vector<int32_t> chosen;
  std::vector<int64_t> chosen_at{0};
  int64_t chosen_every = 0, chosen_window = 0;
  int64_t chosen_tiles() const { return (int64_t)chosen_at.size() - 1; }

  int64_t len() const { return index.n_keys; }
  int64_t complete_blocks() const { return len() / block; }
  // Where block b's minimum of dimension d of kv head kvh is; its maximum is kBlockTile further.
  int64_t at(int64_t b, int64_t kvh, int64_t d) const {
    return (((b / kBlockTile) * kv_heads + kvh) * head_dim + d) * 2 * kBlockTile + b % kBlockTile;
  }
  // Takes in keys len() .. n-1 of k ([n, kv_heads * head_dim] rows kv_stride elements apart, floats
  // or a KV cache's elements: a block's bounds are made when its last key arrives, from all of its keys).
  void append(cpu::KvView k, int64_t kv_stride, int64_t n);
  void truncate(int64_t n) override;
};

// Quest's upper bound of q.k over each complete block b0 .. b1-1 of kv head kvh, into out[b - b0]:
//   bound(q, b) = sum_d max(q_d * kmax_b,d, q_d * kmin_b,d) = sum_d q_d * (q_d >= 0 ? kmax_b,d : kmin_b,d),
// summed over d in order. The selection and the budget calibration (block_budget.h) both score
// with it, so they rank blocks with the same bits.
void block_bounds(const float* q, const BlockTopKState& st, int64_t kvh, int64_t b0, int64_t b1, float* out);
// The same for nh query heads of kv head kvh at once (their queries hd floats apart in q, their
// bounds out_stride floats apart in out), with the same bits as one head at a time: each pair of
// block ranges is read once for all of them.
void block_bounds(const float* q, int64_t nh, const BlockTopKState& st, int64_t kvh, int64_t b0, int64_t b1,
                  float* out, int64_t out_stride);

// The top of one (row, head)'s candidates: lists in slots[1 ..] the Kh blocks lo + x (1 <= Kh < nb)
// with the largest bounds bd[x], ascending by block (every block above the Kh-th largest bound,
// and of those equal to it the lowest ones, as block_ranks_before orders them). NaN ranks last:
// bd is changed, NaN becoming -inf. scratch: the caller's buffer, reused.
void block_topk_pick(float* bd, int64_t nb, int64_t Kh, int64_t lo, int32_t* slots, std::vector<float>& scratch);

// The blocks of every (row, head) of call a into qg [T, heads, kq]; returns kq = s.k + 1 (or
// fewer when the call's rows have fewer candidates). Slot 0 holds the block of the row's last far
// key p - w (its keys up to p - w are far, the rest are in the window, which the kernel shows
// anyway); the others the top K (head h: s.k_of(h)) complete blocks before it by their bound,
// ascending, then -1; a head with near blocks N_h lists, of its K_h + N_h, the N_h before slot 0's
// block and its top K_h of the others. A row with no far key beyond the sinks (p - w < S) reads
// nothing. st must hold the keys up to the call's last row.
// With s.select_every R > 1 a row's chosen blocks are its tile's (BlockTopKSettings::select_every),
// followed by the blocks from the tile's first far block up to its own current one (kq is larger
// by the most of those); the tiles' choices made in this call are kept in st, and those of tiles
// that began before the call are read from it.
int block_topk_select(const AttentionCall& a, BlockTopKState& st, const BlockTopKSettings& s,
                      std::vector<int32_t>& qg);
// The same for a whole window from position 0 (training): the blocks' bounds from the call's keys.
int block_topk_select_window(const AttentionCall& a, const BlockTopKSettings& s, std::vector<int32_t>& qg);

}  // namespace focus
