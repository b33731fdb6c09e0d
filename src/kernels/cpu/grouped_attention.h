// Asymmetric ("grouped") Focus attention in hard mode. Keys and queries are routed separately:
// every key belongs to exactly one group per routing head, and every (query row, query head)
// lists a few groups it reads. A row sees its local window, the sinks and, beyond the window,
// the keys of the groups it reads. Unlike the symmetric kernels (sparse_attention.h), a key's
// group says nothing about the rows that read it, and the routing may differ between heads.
//
//   grouped_attention_reference  full score row per (row, head), double accumulation (tests only)
//   grouped_attention            exact fast kernel: window and sinks part, then per (head, group)
//                                the rows reading the group against the group's packed keys,
//                                merged exactly by log-sum-exp; decoding gathers each row's
//                                visible keys instead
//   grouped_pair_count           the exact number of visible pairs
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/cpu/attn_shape.h"
#include "kernels/cpu/kv_types.h"

namespace focus::cpu {

struct GroupedKvRuns;

// The routing of one call. Query head h uses routing head r(h) = h / (heads / route_heads)
// (route_heads = 1: one routing per layer; kv_heads: one per kv head; heads: one per query head).
struct GroupedRouting {
  int64_t n_groups = 0;                   // G; group ids in [0, G)
  int64_t route_heads = 1;                // RH, divides s.heads
  const int32_t* key_group = nullptr;     // [RH, n_kv]: group of key position j under routing head r
  int kq = 1;                             // group slots per (query row, query head)
  const int32_t* query_groups = nullptr;  // [n_q, heads, kq]: groups the row reads; -1 marks an unused
                                          // slot; the used ids of one slot list are distinct
  // Optional positional blocks read besides the groups (the hybrid pattern): key j is in block
  // j / block_size, and every (query row, query head) lists kb blocks it reads beyond its window.
  int64_t block_size = 0;                 // B >= 1 when kb > 0
  int kb = 0;                             // block slots per (query row, query head); 0: no blocks
  const int32_t* query_blocks = nullptr;  // [n_q, heads, kb]: block ids, -1 unused, used ids distinct
  // Optional far-pair terms (routers with a learned weighting of the far keys read): a pair read
  // beyond the window (j >= sinks and p - j >= local_window), through a group or a block, by a query
  // head of routing head r scores scale * q.k + far_q[r][t] + far_k[r][j]. Both set or neither; finite.
  const float* const* far_q = nullptr;  // [RH] rows of n_q floats: the terms of this call's rows
  const float* const* far_k = nullptr;  // [RH] rows of n_kv floats: the terms of keys 0 .. n_kv-1
  // Optional, decoding over a cache (see GroupedKvRuns): the group keys beyond the window are read
  // from these runs instead of gathered from k and v (the same pairs; the partial sums are cut
  // differently, so the result is the same up to rounding). Calls with many rows ignore them.
  const GroupedKvRuns* runs = nullptr;
};

// The pattern. Query row t has position p = s.q_pos0 + t; pair (t, j) is visible for head h iff
// j <= p and (p - j < s.local_window or j < s.sinks or key_group[r(h)][j] is one of
// query_groups[t][h][0 .. kq) or j / block_size is one of query_blocks[t][h][0 .. kb)). A key in both
// a read group and a read block counts once. With far-pair terms, every pair read beyond the window
// and the sinks (through a group or a block) adds far_q[r(h)][t] + far_k[r(h)][j] to its scaled
// score. s.sliding_window must be 0 and s.local_window >= 1, so every row
// sees itself. o = softmax of the scaled scores over the visible keys, times v; lse[h, t] = the
// natural log-sum-exp of the visible scaled scores. GQA: query head h reads kv head
// h / (heads / kv_heads).
//
// Layouts as in every kernel (attn_shape.h): q [n_q, heads, head_dim] rows s.q_stride apart;
// k, v [n_kv, kv_heads, head_dim] rows s.kv_stride apart; o [n_q, heads, head_dim] rows
// s.o_stride apart; lse (optional, may be null) [heads, n_q]. Needs q_pos0 + n_q <= n_kv.

// The members of every (routing head, group), in increasing position: what the fast kernel reads
// instead of scanning key_group. A KV cache keeps one across decoding steps, appending the groups
// of the new keys (append) and dropping rolled-back ones (truncate).
struct GroupedKeyIndex {
  int64_t n_groups = 0, route_heads = 0;
  int64_t n_keys = 0;                         // positions 0 .. n_keys-1 are indexed
  std::vector<std::vector<int32_t>> members;  // [RH * G]: member positions of (r, g), increasing
  std::vector<std::vector<int32_t>> key_group;  // [RH] of n_keys: the group of each key under head r

  // Indexes keys 0 .. n_kv-1 of `routing` (its n_groups, route_heads and key_group [RH, n_kv]).
  void build(const GroupedRouting& routing, int64_t n_kv);
  // Starts an empty index for G groups and RH routing heads.
  void reset(int64_t n_groups, int64_t route_heads);
  // Appends keys n_keys .. n_keys + n_new - 1; key_group_rows is [RH, n_new] (the groups of the
  // new keys under routing head 0, then under head 1, ...). Throws focus::Error on an id outside
  // [0, G), leaving the index unchanged.
  void append(const int32_t* key_group_rows, int64_t n_new);
  // Keeps keys 0 .. n-1 (n <= n_keys).
  void truncate(int64_t n);
  // Raises the group count to G >= n_groups, keeping every member list: a routing whose group ids
  // grow with the sequence (fixed-size blocks of positions) extends its index instead of
  // rebuilding it. O(RH * G).
  void grow(int64_t G);
  const std::vector<int32_t>& group(int64_t r, int64_t g) const { return members[r * n_groups + g]; }
  const int32_t* groups_of_keys(int64_t r) const { return key_group[r].data(); }
};

// The keys and values of every (routing head, group) copied into one contiguous run, in member
// order, for decoding. A decoding row reads a few groups' members beyond its window: gathered
// from the cache, each is a cache miss of its own (the members of one group are spread over the
// whole sequence); read from a run, they stream. The price is a second copy of the keys and
// values of the layer. Routing head r holds the rows of its kv heads (kv_heads / route_heads of
// them, side by side: a run's row is width = that many times head_dim elements), so route_heads
// must divide kv_heads. A KV cache keeps the runs beside its GroupedKeyIndex: sync after the
// index grows, truncate when it is truncated.
struct GroupedKvRuns {
  KvType type = KvType::F32;
  int64_t n_groups = 0, route_heads = 0, kv_per_route = 0, head_dim = 0;
  int64_t n_keys = 0;                     // the runs hold the members of positions 0 .. n_keys-1
  std::vector<std::vector<uint8_t>> k, v;  // [RH * G] rows of width elements of type `type`
  // With far-pair terms, each run's members' terms (far_k[r][j] of GroupedRouting) in run order:
  // a row reads them as it streams the run, instead of gathering them over the sequence. Empty
  // without them.
  std::vector<std::vector<float>> far;  // [RH * G] rows floats each, or empty
  std::vector<int64_t> rows;               // [RH * G] rows each run holds
  int64_t width() const { return kv_per_route * head_dim; }
  // Copies the rows of the members idx holds beyond the runs' (positions n_keys .. idx.n_keys-1)
  // from the cache k, v ([n, kv_heads, head_dim], rows kv_stride elements apart, at least
  // idx.n_keys rows), and with far_k ([RH] rows of at least idx.n_keys floats) their far-pair
  // terms. The first call fixes the layout and whether terms are held; a later one with another
  // throws.
  void sync(const GroupedKeyIndex& idx, KvView k, KvView v, int64_t kv_heads, int64_t head_dim, int64_t kv_stride,
            const float* const* far_k = nullptr);
  // Keeps the members of positions 0 .. n-1: call after idx.truncate(n).
  void truncate(const GroupedKeyIndex& idx, int64_t n);
};

// The obviously-correct version: every key of a row tested against the pattern, scores and sums
// in double. Tests only.
void grouped_attention_reference(const float* q, const float* k, const float* v, float* o, float* lse,
                                 const AttnShape& s, const GroupedRouting& routing);

// The fast exact kernel, for any q_pos0 (prefill, chunked prefill, decoding). idx must index at
// least the n_kv keys under routing.key_group (same G and RH); routing.key_group itself is not
// read. More than 64 (row, head) pairs run in tiles (with blocks, kb > 0: the tiles without them,
// then the block keys outside each row's groups in tiles of neighbouring rows, as block_list_attention
// reads its blocks, merged in): the window and sinks part
// (focus_window_attention for self-attention, q_pos0 == 0 and n_q == n_kv; else each row's short
// list gathered), then, per kv head, the rows reading each group against that group's keys beyond
// the window packed into key tiles, one partial state per (row, head, slot), merged into the
// window part in slot order. Fewer pairs (decoding) gather each (row, head)'s visible keys and cut
// them into fixed slices whose partial states are merged in order, the (row, head, slice) tasks
// spread over threads (flash-decoding). Either way the result does not depend on the thread
// count. Throws focus::Error on a bad shape, a query group id outside [-1, G) or listed twice in
// one slot list, or an index that does not match the routing. With pairs, also *pairs =
// grouped_pair_count(s, routing, idx) (the routing checked once for both).
void grouped_attention(const float* q, const float* k, const float* v, float* o, float* lse, const AttnShape& s,
                       const GroupedRouting& routing, const GroupedKeyIndex& idx, int64_t* pairs = nullptr);
// Up to this many (row, head) pairs a call is decoding-sized: it takes the gathered path.
constexpr int64_t kFewPairs = 64;

// The same over a KV cache of any element type (kv_stride in elements): decoding reads the
// cached elements directly; more rows run the float kernel on the widened values.
void grouped_attention(const float* q, KvView k, KvView v, float* o, float* lse, const AttnShape& s,
                       const GroupedRouting& routing, const GroupedKeyIndex& idx, int64_t* pairs = nullptr);

// Block lists (block top-k's pattern, focus/block_topk.h) over a prefill from position 0 (q_pos0
// == 0, n_q == n_kv): row t of head h reads, beyond its window and the sinks, the keys j <= t - w
// of the blocks lists[(t * heads + h) * kq + c] (blocks of `block` consecutive positions; -1: no
// block). The window part first (focus_window_attention); then the rows of a head, kListRows at a
// time: the union of their blocks is packed once into key tiles, each row sees in them the keys
// of its own blocks (a -inf bias elsewhere), and its partial state is merged into the window
// part. Neighbouring rows choose much the same blocks, so the work of the union is about twice
// that of the rows' own blocks, done in dense tiles. Does not depend on the thread count. Throws
// focus::Error on a bad shape or on a block id outside the keys among the lists it reads (those of
// rows with a far key); a block listed twice for a row is read once.
constexpr int64_t kListRows = 16;
void block_list_attention(const float* q, const float* k, const float* v, float* o, float* lse, const AttnShape& s,
                          int64_t block, const int32_t* lists, int64_t kq);

// Exact visible (row, key) pairs summed over the query heads (density = count / (heads * causal
// pairs)), from the key index (routing.key_group is not read) in O(n_q * heads * kq * log n_kv):
// a decoding step counts its pairs without a pass over every cached key.
int64_t grouped_pair_count(const AttnShape& s, const GroupedRouting& routing, const GroupedKeyIndex& idx);

// grouped_attention keeps its key tiles and partial states in buffers of the calling thread that
// only grow; bytes held, and a trim that frees them when they exceed max_bytes.
size_t grouped_attention_scratch_bytes();
void grouped_attention_trim_scratch(size_t max_bytes = 0);

}  // namespace focus::cpu
