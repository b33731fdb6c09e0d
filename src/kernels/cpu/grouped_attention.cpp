#include "kernels/cpu/grouped_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <numeric>
#include <omp.h>
#include <type_traits>
#include <vector>

#include "core/error.h"
#include "core/threads.h"
#include "kernels/cpu/decode_slices.h"
#include "kernels/cpu/simd.h"
#include "kernels/cpu/sparse_attention.h"
#include "kernels/cpu/tile_engine.h"

namespace focus::cpu {
namespace {

using namespace tiles;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

void check_shape(const AttnShape& s) {
  FOCUS_CHECK(s.n_q >= 0 && s.n_kv >= 0 && s.n_kv < (int64_t{1} << 31), "grouped attention: n_q ", s.n_q,
              " or n_kv ", s.n_kv, " out of range");
  FOCUS_CHECK(s.q_pos0 >= 0 && s.q_pos0 + s.n_q <= s.n_kv, "grouped attention: rows at positions ", s.q_pos0,
              " .. ", s.q_pos0 + s.n_q - 1, " need keys up to there, n_kv is ", s.n_kv);
  FOCUS_CHECK(s.heads >= 1 && s.kv_heads >= 1 && s.heads % s.kv_heads == 0, "grouped attention: heads ", s.heads,
              " not a multiple of kv_heads ", s.kv_heads);
  FOCUS_CHECK(s.head_dim >= 1, "grouped attention: head_dim must be positive");
  FOCUS_CHECK(s.q_stride >= s.heads * s.head_dim && s.o_stride >= s.heads * s.head_dim &&
                  s.kv_stride >= s.kv_heads * s.head_dim,
              "grouped attention: row strides smaller than a row");
  FOCUS_CHECK(s.sliding_window == 0, "grouped attention: sliding_window must be 0, got ", s.sliding_window);
  FOCUS_CHECK(s.local_window >= 1, "grouped attention: local_window must be >= 1, got ", s.local_window);
  FOCUS_CHECK(s.sinks >= 0, "grouped attention: sinks must be >= 0, got ", s.sinks);
}

// Ids in [-1, n) of every (row, head)'s list of width k at lists, each id >= 0 at most once per list;
// what names the ids in errors ("group", "block"). Linear in the lists' size: a list can hold
// hundreds of blocks (per-head block budgets).
// The lists are read in parallel (a prefill's are millions of ids), each thread marking ids in its
// own table; the first list in order that breaks a rule is read once more to name the problem.
void check_slot_lists(const AttnShape& s, const int32_t* lists, int64_t k, int64_t n, const char* what) {
  const int64_t count = s.n_q * s.heads;
  auto list_ok = [&](int64_t list, std::vector<int64_t>& seen) {  // seen: the list an id was last seen in
    const int32_t* g = lists + list * k;
    for (int64_t c = 0; c < k; ++c) {
      if (g[c] < -1 || g[c] >= n) return false;
      if (g[c] < 0) continue;
      if (seen[g[c]] == list) return false;
      seen[g[c]] = list;
    }
    return true;
  };
  std::atomic<int64_t> first_bad{count};
  const bool par = count * k > (int64_t{1} << 16);
  // Each thread's marks, allocated before the team starts (nothing may throw inside it); on one
  // thread (decoding) the calling thread's, kept across calls.
  std::vector<std::vector<int64_t>> marks;
  thread_local std::vector<int64_t> own;
  if (par)
    marks.assign(omp_get_max_threads(), std::vector<int64_t>(n, -1));
  else
    own.assign(n, -1);
  parallel_for(count, par, [&](int64_t list) {
    if (list_ok(list, par ? marks[omp_get_thread_num()] : own)) return;
    int64_t b = first_bad.load();
    while (list < b && !first_bad.compare_exchange_weak(b, list)) {
    }
  });
  const int64_t list = first_bad.load();
  if (list == count) return;
  const int64_t t = list / s.heads, h = list % s.heads;
  const int32_t* g = lists + list * k;
  std::vector<char> seen(n, 0);
  for (int64_t c = 0; c < k; ++c) {
    FOCUS_CHECK(g[c] >= -1 && g[c] < n, "grouped attention: query ", what, " id ", g[c], " (row ", t, ", head ", h,
                ", slot ", c, ") outside [-1, ", n, ")");
    if (g[c] < 0) continue;
    FOCUS_CHECK(!seen[g[c]], "grouped attention: row ", t, ", head ", h, " lists ", what, " ", g[c], " twice");
    seen[g[c]] = 1;
  }
  FOCUS_CHECK(false, "grouped attention: the ", what, " list of row ", t, ", head ", h, " was refused");
}

// The query side: slot ids in [-1, G), used ids of one slot list distinct.
void check_routing(const AttnShape& s, const GroupedRouting& r) {
  FOCUS_CHECK(r.n_groups >= 1 && r.n_groups < (int64_t{1} << 31), "grouped attention: n_groups ", r.n_groups,
              " out of range");
  FOCUS_CHECK(r.route_heads >= 1 && s.heads % r.route_heads == 0, "grouped attention: route_heads ",
              r.route_heads, " does not divide heads ", s.heads);
  FOCUS_CHECK(r.kq >= 1, "grouped attention: kq must be >= 1, got ", r.kq);
  FOCUS_CHECK(s.n_q == 0 || r.query_groups, "grouped attention: no query_groups");
  if (s.n_q > 0) check_slot_lists(s, r.query_groups, r.kq, r.n_groups, "group");
  FOCUS_CHECK(!r.far_q == !r.far_k, "grouped attention: far-pair terms need both far_q and far_k");
  if (r.far_q) {
    for (int64_t rh = 0; rh < r.route_heads; ++rh) {
      FOCUS_CHECK((s.n_q == 0 || r.far_q[rh]) && (s.n_kv == 0 || r.far_k[rh]),
                  "grouped attention: no far-pair terms for routing head ", rh);
      for (int64_t t = 0; t < s.n_q; ++t)
        FOCUS_CHECK(std::isfinite(r.far_q[rh][t]), "grouped attention: far-pair term of row ", t, " (routing head ",
                    rh, ") is ", r.far_q[rh][t]);
      // (The keys' terms are checked where they are read: a decoding step does not pass over the cache.)
    }
  }
  if (r.kb == 0) return;
  FOCUS_CHECK(r.kb > 0 && r.block_size >= 1, "grouped attention: kb ", r.kb, " and block_size ", r.block_size,
              " must be positive");
  FOCUS_CHECK(s.n_q == 0 || r.query_blocks, "grouped attention: kb ", r.kb, " but no query_blocks");
  const int64_t nb = (s.n_kv + r.block_size - 1) / r.block_size;
  if (s.n_q > 0) check_slot_lists(s, r.query_blocks, r.kb, nb, "block");
}

// The key side as stored in a routing: [RH, n_kv] ids in [0, G).
void check_key_groups(const int32_t* key_group, int64_t n_kv, int64_t G, int64_t RH) {
  FOCUS_CHECK(n_kv == 0 || key_group, "grouped attention: no key_group");
  for (int64_t x = 0; x < RH * n_kv; ++x)
    FOCUS_CHECK(key_group[x] >= 0 && key_group[x] < G, "grouped attention: key group id ", key_group[x], " (key ",
                x % std::max<int64_t>(1, n_kv), ", routing head ", x / std::max<int64_t>(1, n_kv), ") outside [0, ",
                G, ")");
}

inline int64_t route_of(const AttnShape& s, const GroupedRouting& r, int64_t h) {
  return h / (s.heads / r.route_heads);
}

bool reads(const GroupedRouting& r, const int32_t* slots, int32_t g) {
  for (int c = 0; c < r.kq; ++c)
    if (slots[c] == g) return true;
  return false;
}

// The lanes of simd::kV consecutive keys (their groups g, loaded from the index) whose group is
// one of gs[0 .. kq): the keys a row reads through its groups, not through its blocks.
inline simd::vi in_groups(simd::vi g, const int32_t* gs, int kq) {
  simd::vi in{};
  for (int x = 0; x < kq; ++x) in |= g == gs[x];
  return in;
}

// The keys of block b beyond the sinks and before lo (the row's window), [j0, j1) (empty when
// j1 <= j0).
inline std::pair<int64_t, int64_t> block_far_keys(const AttnShape& s, const GroupedRouting& r, int64_t b, int64_t lo) {
  return {std::max<int64_t>(b * r.block_size, s.sinks), std::min<int64_t>((b + 1) * r.block_size, lo)};
}

// Whether query heads h0 .. h0+nh-1 of row t read the same groups (one routing head, the same
// slots), so that one pass over their keys serves them all.
bool same_groups(const AttnShape& s, const GroupedRouting& r, int64_t t, int64_t h0, int64_t nh) {
  const int32_t* g0 = r.query_groups + (t * s.heads + h0) * r.kq;
  for (int64_t hh = 1; hh < nh; ++hh) {
    const int32_t* g1 = r.query_groups + (t * s.heads + h0 + hh) * r.kq;
    if (route_of(s, r, h0 + hh) != route_of(s, r, h0) || !std::equal(g0, g0 + r.kq, g1)) return false;
  }
  return true;
}

// Appends to keys the union of the block keys beyond the window of query heads h0 .. h0+nh-1 of
// row t (which read the same groups) that are not in their groups, in increasing position. When
// some head does not read all of them, bias becomes [slices][nh][kSlice] over the whole list: 0
// where head hh reads key m (every key before the appended ones), -inf elsewhere; otherwise bias
// is left empty. With far-pair terms (far.k non-null), the bias is made whenever a key is
// appended, and each far pair read carries far.eq + far.k[j]: the appended keys and the keys
// [far.g0, far.g1) before them (the groups' members).
// Returns the first such key whose term is not finite, or -1; visible, when given, gets the
// (appended key, head) pairs read.
struct UnitFarTerms {
  const float* k = nullptr;  // the keys' terms of the unit's routing head (null: none)
  float eq = 0.f;            // the row's term
  int64_t g0 = 0, g1 = 0;    // the groups' members in the list, [g0, g1)
};
int64_t add_unit_block_keys(const AttnShape& s, const GroupedRouting& r, const GroupedKeyIndex& idx, int64_t t,
                            int64_t h0, int64_t nh, std::vector<int32_t>& keys, std::vector<float>& bias,
                            const UnitFarTerms& far, int64_t* visible) {
  const float* far_k = far.k;
  const float far_eq = far.eq;
  const int64_t g0 = far.g0, g1 = far.g1;
  bias.clear();
  if (visible) *visible = 0;
  const int64_t lo = std::max<int64_t>(0, s.q_pos0 + t - s.local_window + 1);
  if (lo <= s.sinks) return -1;
  FOCUS_CHECK(nh <= 64, "grouped attention: more than 64 query heads share a kv head");
  // (block, head in unit), sorted; then the keys each block adds, as runs of the list with the
  // heads that read them (bit hh).
  struct Run {
    int64_t m0, m1;
    uint64_t heads;
  };
  static thread_local std::vector<std::pair<int32_t, int32_t>> blocks;
  static thread_local std::vector<Run> runs;
  blocks.clear();
  for (int64_t hh = 0; hh < nh; ++hh) {
    const int32_t* bs = r.query_blocks + (t * s.heads + h0 + hh) * r.kb;
    for (int c = 0; c < r.kb; ++c)
      if (bs[c] >= 0) blocks.push_back({bs[c], (int32_t)hh});
  }
  if (blocks.empty()) return -1;
  std::sort(blocks.begin(), blocks.end());
  runs.clear();
  const int32_t* gs = r.query_groups + (t * s.heads + h0) * r.kq;
  const int32_t* kg = idx.groups_of_keys(route_of(s, r, h0));
  const int64_t base = (int64_t)keys.size();
  // The blocks' groups and terms are scattered over arrays that a decoding step's weights have
  // pushed out of the caches since the layer's last step: their lines are requested all at once
  // first, so that the misses overlap instead of coming one block after another.
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (i > 0 && blocks[i].first == blocks[i - 1].first) continue;
    const auto [j0, j1] = block_far_keys(s, r, blocks[i].first, lo);
    for (int64_t j = j0; j < j1; j += 16) {
      __builtin_prefetch(kg + j);
      if (far_k) __builtin_prefetch(far_k + j);
    }
    if (j1 > j0) {
      __builtin_prefetch(kg + j1 - 1);
      if (far_k) __builtin_prefetch(far_k + j1 - 1);
    }
  }
  for (size_t i = 0; i < blocks.size();) {
    const int32_t b = blocks[i].first;
    uint64_t heads = 0;
    for (; i < blocks.size() && blocks[i].first == b; ++i) heads |= uint64_t{1} << blocks[i].second;
    // The block's keys beyond the sinks and before the window, less those of the unit's groups:
    // a vector of keys' groups at a time, the keys listed from the lanes left.
    const auto [j0, j1] = block_far_keys(s, r, b, lo);
    if (j1 <= j0) continue;
    const int64_t m0 = (int64_t)keys.size();
    keys.resize(m0 + j1 - j0);
    int32_t* out = keys.data() + m0;
    int64_t c = 0, j = j0;
    for (; j + simd::kV <= j1; j += simd::kV)
      for (uint32_t bits = simd::lane_bits(~in_groups(simd::loadi(kg + j), gs, r.kq)); bits; bits &= bits - 1)
        out[c++] = (int32_t)(j + __builtin_ctz(bits));
    for (; j < j1; ++j)
      if (!reads(r, gs, kg[j])) out[c++] = (int32_t)j;
    keys.resize(m0 + c);
    if (c > 0) runs.push_back({m0, m0 + c, heads});
  }
  const int64_t n_keys = (int64_t)keys.size();
  if (n_keys == base) return -1;
  if (visible)
    for (const Run& u : runs) *visible += (u.m1 - u.m0) * __builtin_popcountll(u.heads);
  const uint64_t all = nh == 64 ? ~uint64_t{0} : (uint64_t{1} << nh) - 1;
  if (!far_k && std::all_of(runs.begin(), runs.end(), [&](const Run& x) { return x.heads == all; })) return -1;
  const int64_t slices = (n_keys + kSlice - 1) / kSlice;
  // Every entry a slice's partial reads ([0, len) of each head's row) is written below.
  bias.resize(slices * nh * kSlice);
  auto at = [&](int64_t m, int64_t hh) -> float& { return bias[((m / kSlice) * nh + hh) * kSlice + m % kSlice]; };
  int64_t bad = -1;
  auto term = [&](int64_t m) {
    if (!far_k) return 0.f;
    const float e = far_k[keys[m]];
    if (!std::isfinite(e) && bad < 0) bad = keys[m];
    return far_eq + e;
  };
  for (int64_t m = 0; m < base; ++m) {
    const float x = m >= g0 && m < g1 ? term(m) : 0.f;
    for (int64_t hh = 0; hh < nh; ++hh) at(m, hh) = x;
  }
  for (const Run& u : runs)
    for (int64_t m = u.m0; m < u.m1; ++m) {
      const float x = term(m);
      for (int64_t hh = 0; hh < nh; ++hh) at(m, hh) = (u.heads >> hh & 1) ? x : kNegInf;
    }
  return bad;
}

// ---------------------------------------------------------------------------------------------
// Self-attention in tiles: the keys of one kv head beyond every row's window, in group order under
// one routing head, packed into key tiles (each group starts on a tile boundary).
struct PackedKeys {
  int64_t hdp = 0, n_tiles = 0;
  std::vector<int64_t> tile_off;  // [G + 1] first tile of each group
  std::vector<int64_t> a0;        // [G] first member of the group at a position >= sinks
  std::vector<int32_t> slot_pos;  // [tiles * kBk] key position at each slot, -1 for padding
  std::vector<float> slot_far;    // [tiles * kBk] far-pair term of each slot's key (with far terms)
  FloatBuffer kt, v;              // [tiles][hdp][kBk] transposed keys, [tiles][kBk][hdp] values

  // Members at positions S .. last (the last position any row reads beyond its window); far_k:
  // the routing head's far-pair terms of the keys, or null.
  void build(const GroupedKeyIndex& idx, int64_t r, int64_t S, int64_t last, int64_t hdp_, const float* far_k) {
    const int64_t G = idx.n_groups;
    hdp = hdp_;
    tile_off.assign(G + 1, 0);
    a0.assign(G, 0);
    std::vector<int64_t> len(G, 0);
    for (int64_t g = 0; g < G; ++g) {
      const auto& m = idx.group(r, g);
      const auto lo = std::lower_bound(m.begin(), m.end(), S);
      const auto hi = std::upper_bound(lo, m.end(), last);
      a0[g] = lo - m.begin();
      len[g] = hi - lo;
      tile_off[g + 1] = tile_off[g] + (len[g] + kBk - 1) / kBk;
    }
    n_tiles = tile_off[G];
    slot_pos.assign(n_tiles * kBk, -1);
    for (int64_t g = 0; g < G; ++g)
      std::copy_n(idx.group(r, g).begin() + a0[g], len[g], slot_pos.begin() + tile_off[g] * kBk);
    slot_far.clear();
    if (far_k) {
      slot_far.resize(slot_pos.size());
      for (size_t x = 0; x < slot_pos.size(); ++x) {
        slot_far[x] = slot_pos[x] < 0 ? 0.f : far_k[slot_pos[x]];
        FOCUS_CHECK(std::isfinite(slot_far[x]), "grouped attention: far-pair term of key ", slot_pos[x],
                    " (routing head ", r, ") is ", slot_far[x]);
      }
    }
    kt.resize(std::max<int64_t>(1, n_tiles) * hdp * kBk);
    v.resize(std::max<int64_t>(1, n_tiles) * kBk * hdp);
  }
  const float* kt_tile(int64_t t) const { return kt.data() + t * hdp * kBk; }
  const float* v_tile(int64_t t) const { return v.data() + t * kBk * hdp; }

  // Copies tile t's keys and values of kv head kvh; the transposed writes stay in one 16 KiB tile.
  void fill_tile(int64_t t, const float* k, const float* vv, const AttnShape& s, int64_t kvh) {
    const int64_t hd = s.head_dim;
    float* kt_t = kt.data() + t * hdp * kBk;
    float* v_t = v.data() + t * kBk * hdp;
    for (int c = 0; c < kBk; ++c) {
      const int64_t j = slot_pos[t * kBk + c];
      float* vr = v_t + c * hdp;
      if (j < 0) {
        for (int64_t d = 0; d < hdp; ++d) kt_t[d * kBk + c] = 0.f;
        std::fill(vr, vr + hdp, 0.f);
        continue;
      }
      const float* kr = k + j * s.kv_stride + kvh * hd;
      for (int64_t d = 0; d < hd; ++d) kt_t[d * kBk + c] = kr[d];
      for (int64_t d = hd; d < hdp; ++d) kt_t[d * kBk + c] = 0.f;
      std::memcpy(vr, vv + j * s.kv_stride + kvh * hd, hd * sizeof(float));
      std::fill(vr + hd, vr + hdp, 0.f);
    }
  }
};

// A row reading a group: its row index, how many of the group's packed keys it sees (a prefix:
// the keys at positions <= p - w), and the slot the group has in its list.
struct RowRef {
  int32_t t, cut, slot;
};

// One unit of work: query tile [b, e) of the rows of (local head hl, group g).
struct Item {
  int32_t hl, g;
  int64_t b, e, cost;
};

// The rows of each (local head, group) of one kv head, in increasing row order (so the cuts do
// not decrease), and the items that cover them, costliest first so the cheap ones even out the
// finish.
struct RowLists {
  std::vector<int64_t> off;  // [hpk * G + 1]
  std::vector<RowRef> rows;
  std::vector<Item> items;
  std::vector<int32_t> cuts;  // [hpk, n_q, kq] keys seen per slot (0: none or unused)
  std::vector<int64_t> cur;

  void build(const AttnShape& s, const GroupedRouting& r, const std::vector<PackedKeys>& packed, int64_t kvh,
             int64_t r_first) {
    const int64_t hpk = s.heads / s.kv_heads, G = r.n_groups, w = s.local_window;
    off.assign(hpk * G + 1, 0);
    // A list's rows come in increasing position, so its cut only moves forward: one pointer per
    // list walks the group's members once (no search per row).
    cuts.resize(hpk * s.n_q * r.kq);
    cur.assign(hpk * G, 0);
    for (int64_t hl = 0; hl < hpk; ++hl) {
      const int64_t h = kvh * hpk + hl, rh = route_of(s, r, h);
      const PackedKeys& P = packed[rh - r_first];
      for (int64_t t = 0; t < s.n_q; ++t) {
        const int32_t* gs = r.query_groups + (t * s.heads + h) * r.kq;
        const int64_t lim = s.q_pos0 + t - w;  // beyond the window: positions <= lim
        for (int c = 0; c < r.kq; ++c) {
          int32_t& cut = cuts[(hl * s.n_q + t) * r.kq + c];
          cut = 0;
          if (gs[c] < 0) continue;
          const int64_t list = hl * G + gs[c], end = (P.tile_off[gs[c] + 1] - P.tile_off[gs[c]]) * kBk;
          const int32_t* pos = P.slot_pos.data() + P.tile_off[gs[c]] * kBk;  // -1 past the members
          int64_t a = cur[list];
          while (a < end && pos[a] >= 0 && pos[a] <= lim) ++a;
          cur[list] = a;
          cut = (int32_t)a;
          if (cut > 0) ++off[list + 1];
        }
      }
    }
    for (int64_t x = 0; x < hpk * G; ++x) off[x + 1] += off[x];
    rows.resize(off.back());
    cur.assign(off.begin(), off.end() - 1);
    for (int64_t hl = 0; hl < hpk; ++hl)
      for (int64_t t = 0; t < s.n_q; ++t) {
        const int32_t* gs = r.query_groups + (t * s.heads + kvh * hpk + hl) * r.kq;
        for (int c = 0; c < r.kq; ++c) {
          const int32_t cut = cuts[(hl * s.n_q + t) * r.kq + c];
          if (cut > 0) rows[cur[hl * G + gs[c]]++] = RowRef{(int32_t)t, cut, c};
        }
      }
    items.clear();
    for (int64_t hl = 0; hl < hpk; ++hl)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t b0 = off[hl * G + g], e0 = off[hl * G + g + 1];
        for (int64_t b = b0; b < e0; b += kBq) {
          const int64_t e = std::min(e0, b + kBq);
          items.push_back({(int32_t)hl, (int32_t)g, b, e, (rows[e - 1].cut + kBk - 1) / kBk});
        }
      }
    std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  }
};

// The calling thread's buffers that only grow (handed to the parallel team by reference).
struct Scratch {
  std::vector<PackedKeys> packed;  // per routing head of one kv head
  FloatBuffer win_lse;             // [heads, n] the window part's lse
  FloatBuffer slot_o, slot_lse;    // [n, hpk, kq, hd] / [n, hpk, kq] the group parts of one kv head
  FloatBuffer list_k, list_v;      // block_list_attention's keys block by block and padded values
  size_t bytes() const {
    size_t b = win_lse.bytes() + slot_o.bytes() + slot_lse.bytes() + list_k.bytes() + list_v.bytes();
    for (const auto& p : packed) b += p.kt.bytes() + p.v.bytes();
    return b;
  }
  void release() {
    packed.clear();
    win_lse.release();
    slot_o.release();
    slot_lse.release();
    list_k.release();
    list_v.release();
  }
};
thread_local Scratch tl_scratch;

// One item: the item's rows against the packed keys of their group, each row seeing a prefix of
// them; the partial state goes to the row's slot.
// With far-pair terms (add: a [kBq][kBk] scratch tile) each key's term is added to its scores, and
// the row's term to the slot's log-sum-exp.
void run_item(QueryTile& qt, RowSpan* spans, const Item& it, const RowLists& L, const PackedKeys& P, const float* q,
              const AttnShape& s, const GroupedRouting& r, int64_t kvh, float* slot_o, float* slot_lse, float* add) {
  const int64_t hd = s.head_dim, hpk = s.heads / s.kv_heads, h = kvh * hpk + it.hl;
  const RowRef* rows = L.rows.data() + it.b;
  const int n = (int)(it.e - it.b);
  qt.reset(n);
  for (int i = 0; i < n; ++i) qt.load_row(i, q + (int64_t)rows[i].t * s.q_stride + h * hd, hd, s.scale);
  const int64_t tile0 = P.tile_off[it.g], cut_max = rows[n - 1].cut;
  int r0 = 0;
  for (int64_t lt = 0; lt * kBk < cut_max; ++lt) {
    const int64_t j0 = lt * kBk;
    while (r0 < n && rows[r0].cut <= j0) ++r0;  // cuts do not decrease: the rows that see nothing lead
    for (int i = r0; i < n; ++i) {
      spans[i] = RowSpan{};
      spans[i].hi0 = (int)std::min<int64_t>(kBk, rows[i].cut - j0);
    }
    if (P.slot_far.empty()) {
      qt.visit(P.kt_tile(tile0 + lt), P.v_tile(tile0 + lt), P.hdp, r0, n, spans, nullptr);
      continue;
    }
    const float* far = P.slot_far.data() + (tile0 + lt) * kBk;
    for (int i = r0; i < n; ++i) std::copy_n(far, kBk, add + i * kBk);
    qt.visit<ExpMode::FastWhenFull, true>(P.kt_tile(tile0 + lt), P.v_tile(tile0 + lt), P.hdp, r0, n, spans, nullptr,
                                          add);
  }
  const float* far_q = r.far_q ? r.far_q[route_of(s, r, h)] : nullptr;
  for (int i = 0; i < n; ++i) {
    const int64_t x = ((int64_t)rows[i].t * hpk + it.hl) * r.kq + rows[i].slot;
    qt.store_row(i, slot_o + x * hd, hd, slot_lse + x);
    if (far_q) slot_lse[x] += far_q[rows[i].t];
  }
}

void gathered_window_attention(const float* q, const float* k, const float* v, float* o, float* lse,
                               const AttnShape& s, const GroupedRouting& r, const GroupedKeyIndex& idx);

// Many rows: the window and sinks part (focus_window_attention for self-attention, else gathered
// per row, a short list), then the group part in tiles, merged into it.
void tiled_attention(const float* q, const float* k, const float* v, float* o, float* lse, const AttnShape& s,
                     const GroupedRouting& r, const GroupedKeyIndex& idx) {
  const int64_t n = s.n_q, hd = s.head_dim, hdp = padded_dim(hd), hpk = s.heads / s.kv_heads, kq = r.kq;
  Scratch& sc = tl_scratch;
  sc.win_lse.resize(s.heads * n);
  float* wl = sc.win_lse.data();
  if (s.q_pos0 == 0 && s.n_kv == n)
    focus_window_attention(q, k, v, o, wl, s);
  else
    gathered_window_attention(q, k, v, o, wl, s, r, idx);
  // No row reads beyond its window before position w + sinks; the last row reads up to p_last - w.
  const int64_t last = s.q_pos0 + n - 1 - s.local_window;
  if (last >= s.sinks) {
    sc.slot_o.resize(n * hpk * kq * hd);
    sc.slot_lse.resize(n * hpk * kq);
    float *so = sc.slot_o.data(), *sl = sc.slot_lse.data();
    RowLists L;
    for (int64_t kvh = 0; kvh < s.kv_heads; ++kvh) {
      // The routing heads of this kv head's query heads: a contiguous range.
      const int64_t r_first = route_of(s, r, kvh * hpk), r_last = route_of(s, r, kvh * hpk + hpk - 1);
      if ((int64_t)sc.packed.size() < r_last - r_first + 1) sc.packed.resize(r_last - r_first + 1);
      int64_t tiles = 0;
      for (int64_t rh = r_first; rh <= r_last; ++rh) {
        sc.packed[rh - r_first].build(idx, rh, s.sinks, last, hdp, r.far_k ? r.far_k[rh] : nullptr);
        tiles += sc.packed[rh - r_first].n_tiles;
      }
      L.build(s, r, sc.packed, kvh, r_first);
      std::fill(sl, sl + n * hpk * kq, kNegInf);
      std::vector<PackedKeys>& packed = sc.packed;
#pragma omp parallel
      {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
          int64_t x = t, p = 0;
          while (x >= packed[p].n_tiles) x -= packed[p++].n_tiles;
          packed[p].fill_tile(x, k, v, s, kvh);
        }
        QueryTile qt(hdp);
        RowSpan spans[kBq];
        AlignedFloats add(r.far_q ? kBq * kBk : 0);
#pragma omp for schedule(dynamic, 1)
        for (size_t i = 0; i < L.items.size(); ++i) {
          const Item& it = L.items[i];
          const PackedKeys& P = packed[route_of(s, r, kvh * hpk + it.hl) - r_first];
          run_item(qt, spans, it, L, P, q, s, r, kvh, so, sl, add.data());
        }
        // The window part first, then the slots in order: a fixed order, whoever ran the items.
#pragma omp for schedule(static)
        for (int64_t t = 0; t < n; ++t)
          for (int64_t hl = 0; hl < hpk; ++hl) {
            const int64_t h = kvh * hpk + hl, x0 = (t * hpk + hl) * kq;
            bool any = false;
            for (int64_t c = 0; c < kq; ++c) any |= sl[x0 + c] != kNegInf;
            if (!any) continue;
            float* orow = o + t * s.o_stride + h * hd;
            wl[h * n + t] = merge_partials(kq + 1, hd, orow, [&](int64_t c) {
              return c == 0 ? Partial{wl[h * n + t], 1.f, orow} : Partial{sl[x0 + c - 1], 1.f, so + (x0 + c - 1) * hd};
            });
          }
      }
    }
  }
  if (lse) std::copy(wl, wl + s.heads * n, lse);
}

// ---------------------------------------------------------------------------------------------
// Chunks and decoding: each (row, head) gathers its visible keys (sinks, the members of its groups
// beyond the window, the window) and cuts them into slices of kSlice keys; each slice's partial
// state (m, l, then head_dim unnormalised output floats) is merged in slice order.
// (kSlice: decode_slices.h.) Up to kFewPairs (row, head) pairs (grouped_attention.h: decoding,
// small chunks), every (row, head, slice) is a task and the group part is gathered too: too few
// rows to fill a query tile.

// The keys of (row t, head h): the sinks, the members of its groups beyond the window (keys
// [*g0, *g1), when g0 is given), then the window (unless window is false).
void row_keys(const AttnShape& s, const GroupedRouting& r, const GroupedKeyIndex& idx, int64_t t, int64_t h,
              bool with_groups, std::vector<int32_t>& keys, int64_t* g0 = nullptr, int64_t* g1 = nullptr,
              bool window = true) {
  keys.clear();
  const int64_t p = s.q_pos0 + t, lo = std::max<int64_t>(0, p - s.local_window + 1);
  for (int64_t j = 0; j < std::min(s.sinks, lo); ++j) keys.push_back((int32_t)j);
  if (g0) *g0 = (int64_t)keys.size();
  if (with_groups && lo > s.sinks) {
    const int32_t* gs = r.query_groups + (t * s.heads + h) * r.kq;
    for (int c = 0; c < r.kq; ++c) {
      if (gs[c] < 0) continue;
      const auto& m = idx.group(route_of(s, r, h), gs[c]);
      const auto a = std::lower_bound(m.begin(), m.end(), (int32_t)s.sinks);
      keys.insert(keys.end(), a, std::lower_bound(a, m.end(), (int32_t)lo));
    }
  }
  if (g1) *g1 = (int64_t)keys.size();
  if (window)
    for (int64_t j = lo; j <= p; ++j) keys.push_back((int32_t)j);
}

// The partial state of query row qr (kv head kvh) over keys[0 .. len) into part (head_dim + 2).
void slice_partial(const float* qr, const float* k, const float* v, const AttnShape& s, int64_t kvh,
                   const int32_t* keys, int64_t len, float* sc, float* part) {
  using namespace simd;
  const int64_t hd = s.head_dim;
  float mx = kNegInf;
  for (int64_t m = 0; m < len; ++m) {
    if (m + 4 < len) __builtin_prefetch(k + (int64_t)keys[m + 4] * s.kv_stride + kvh * hd);
    sc[m] = decode_detail::dot(qr, k + (int64_t)keys[m] * s.kv_stride + kvh * hd, hd) * s.scale;
    mx = std::max(mx, sc[m]);
  }
  float sum = 0.f;
  for (int64_t m = 0; m < len; ++m) sum += (sc[m] = std::exp(sc[m] - mx));
  part[0] = mx;
  part[1] = sum;
  float* acc = part + 2;
  std::fill(acc, acc + hd, 0.f);
  for (int64_t m = 0; m < len; ++m) {
    if (m + 4 < len) __builtin_prefetch(v + (int64_t)keys[m + 4] * s.kv_stride + kvh * hd);
    const float* vr = v + (int64_t)keys[m] * s.kv_stride + kvh * hd;
    const float wt = sc[m];
    int64_t x = 0;
    const vf wv = bcast(wt);
    for (; x + kV <= hd; x += kV) store(acc + x, vfma(wv, load(vr + x), load(acc + x)));
    for (; x < hd; ++x) acc[x] += wt * vr[x];
  }
}

float merge_slices(const float* parts, int64_t slices, int64_t hd, float* out) {
  return merge_partials(slices, hd, out, [&](int64_t c) {
    const float* pr = parts + c * (hd + 2);
    return Partial{pr[0], pr[1], pr + 2};
  });
}

template <class E>
constexpr KvType kv_type_of() {
  return std::is_same_v<E, Half> ? KvType::F16 : std::is_same_v<E, BHalf> ? KvType::BF16 : KvType::F32;
}

// 0, 1, 2, ...: the row list of a slice that reads consecutive rows (a group's run).
const int32_t* consecutive_rows() {
  static const std::vector<int32_t> rows = [] {
    std::vector<int32_t> x(kSlice);
    for (int64_t i = 0; i < kSlice; ++i) x[i] = (int32_t)i;
    return x;
  }();
  return rows.data();
}

// Few (row, head) pairs (decoding), keys and values of element type E: the query heads of a kv
// head that read the same groups (the same routing head and group slots: always so with one
// router per layer or per kv head) form one unit, computed together so that each key and value
// row is loaded once for them; otherwise each (row, head) is its own unit. With blocks, a unit's
// keys are its groups' plus the union of its heads' block keys, each hidden (a bias of -inf) from
// the heads that do not read it. A unit reads its window as consecutive rows of the cache, in
// place; with runs of the groups' keys (r.runs), its groups' members beyond the window from their
// runs; the rest (sinks, groups without runs, blocks) through a list of positions. With far-pair
// terms, the group and block keys carry them as a bias (the heads of a unit share one routing
// head, so one term; runs that hold the terms give them in run order). A unit's list, window and
// runs are cut into slices of at most kSlice keys; every (unit, slice) of the window and runs is a
// task, so one long row fills the threads, and each unit's list is a job that makes the list and
// computes its slices; jobs and tasks share one parallel region (a thread done with a list takes
// tasks while another still makes its own). The slices are merged in order per head: list,
// window, runs. pairs, when given, gets the (row, head, key) pairs read: grouped_pair_count's
// number, counted from the slices.
template <class E>
void gathered_decode(const float* q, const E* k, const E* v, float* o, float* lse, const AttnShape& s,
                     const GroupedRouting& r, const GroupedKeyIndex& idx, bool with_groups, int64_t* pairs = nullptr) {
  const int64_t hd = s.head_dim, hpk = s.heads / s.kv_heads, part = hd + 2;
  const GroupedKvRuns* runs = with_groups ? r.runs : nullptr;
  if (runs) {
    FOCUS_CHECK(runs->type == kv_type_of<E>() && runs->n_groups == r.n_groups && runs->route_heads == r.route_heads &&
                    runs->kv_per_route * r.route_heads == s.kv_heads && runs->head_dim == hd &&
                    runs->n_keys >= s.n_kv,
                "grouped attention: the runs of group keys do not match the routing or the cache");
  }
  struct Unit {
    int64_t t, h0, nh;
    int64_t far_rh = -1;  // the routing head of its far-pair terms, -1 without
    float far_eq = 0.f;
    int64_t g0 = 0, g1 = 0;  // its list's group members: keys [g0, g1)
    int64_t bad_far = -1;    // a block key whose far-pair term is not finite, or -1
    int64_t block_pairs = 0;  // its block keys' (key, head) pairs read
    int64_t list_base = 0;    // its list's keys before the block keys (every head reads them)
  };
  // One slice of a unit: rows idx[0 .. len) of kb, vb (stride elements apart); rows [f0, f1) are
  // group keys whose far-pair terms are those of positions pos[f0 .. f1).
  struct Task {
    int64_t u;
    const E *kb, *vb;
    int64_t stride;
    const int32_t* idx;
    int64_t len;
    const int32_t* pos;
    int64_t f0, f1;
    const float* bias;  // blocks: [nh][kSlice] (bias_hs kSlice), or null
    int64_t out;        // its partial states: parts + out, one per head of the unit
    const float* far = nullptr;  // a run's slice: the far-pair terms of rows [f0, f1) held beside it, or null
  };
  // The buffers of a call, kept per thread (a decoding step makes no allocations of its own).
  thread_local struct {
    std::vector<Unit> units;
    std::vector<std::vector<int32_t>> keys;
    std::vector<std::vector<float>> bias;  // [slices, nh, kSlice] when the unit's heads read different blocks
    std::vector<Task> tasks;
    std::vector<int64_t> first;  // the tasks of unit u: first[u] .. first[u+1]-1
    std::vector<float> parts;
    std::vector<std::vector<float>> list_parts;  // [U]: the partial states of each unit's list slices
    std::vector<int64_t> list_slices;            // [U]: how many
  } scratch;
  std::vector<Unit>& units = scratch.units;
  units.clear();
  for (int64_t t = 0; t < s.n_q; ++t)
    for (int64_t kvh = 0; kvh < s.kv_heads; ++kvh) {
      const int64_t h0 = kvh * hpk;
      const bool same = !with_groups || same_groups(s, r, t, h0, hpk);
      if (same)
        units.push_back({t, h0, hpk});
      else
        for (int64_t hh = 0; hh < hpk; ++hh) units.push_back({t, h0 + hh, 1});
    }
  const int64_t U = (int64_t)units.size();
  std::vector<std::vector<int32_t>>& keys = scratch.keys;
  std::vector<std::vector<float>>& bias = scratch.bias;
  std::vector<std::vector<float>>& list_parts = scratch.list_parts;
  if ((int64_t)keys.size() < U) keys.resize(U), bias.resize(U), list_parts.resize(U);
  std::vector<Task>& tasks = scratch.tasks;
  tasks.clear();
  std::vector<int64_t>& first = scratch.first;
  first.assign(U + 1, 0);
  // The slices known before any list is made: each unit's window (consecutive rows of the cache,
  // read in place: no list, no bias) and its groups' runs.
  int64_t n_parts = 0;
  for (int64_t u = 0; u < U; ++u) {
    Unit& un = units[u];
    const int64_t kvh = un.h0 / hpk, rh = route_of(s, r, un.h0);
    if (with_groups && r.far_q) {
      un.far_rh = rh;
      un.far_eq = r.far_q[rh][un.t];
    }
    const int64_t p = s.q_pos0 + un.t, lo = std::max<int64_t>(0, p - s.local_window + 1);
    for (int64_t j0 = lo; j0 <= p; j0 += kSlice) {
      const int64_t len = std::min<int64_t>(kSlice, p + 1 - j0);
      tasks.push_back({u, k + j0 * s.kv_stride + kvh * hd, v + j0 * s.kv_stride + kvh * hd, s.kv_stride,
                       consecutive_rows(), len, nullptr, 0, 0, nullptr, n_parts});
      n_parts += un.nh * part;
    }
    if (!runs || lo <= s.sinks) {
      first[u + 1] = (int64_t)tasks.size();
      continue;
    }
    const int32_t* gs = r.query_groups + (un.t * s.heads + un.h0) * r.kq;
    const int64_t W = runs->width(), col = (kvh - rh * runs->kv_per_route) * hd;
    for (int c = 0; c < r.kq; ++c) {
      if (gs[c] < 0) continue;
      const std::vector<int32_t>& m = idx.group(rh, gs[c]);
      const int64_t x = rh * r.n_groups + gs[c];
      const int64_t a = std::lower_bound(m.begin(), m.end(), (int32_t)s.sinks) - m.begin();
      const int64_t b = std::lower_bound(m.begin() + a, m.end(), (int32_t)lo) - m.begin();
      FOCUS_CHECK(runs->rows[x] >= b, "grouped attention: the run of group ", gs[c], " (routing head ", rh,
                  ") holds ", runs->rows[x], " keys, ", b, " needed");
      const E* rk = reinterpret_cast<const E*>(runs->k[x].data()) + col;
      const E* rv = reinterpret_cast<const E*>(runs->v[x].data()) + col;
      const float* rf = un.far_rh >= 0 && !runs->far.empty() ? runs->far[x].data() : nullptr;
      for (int64_t m0 = a; m0 < b; m0 += kSlice) {
        const int64_t len = std::min(kSlice, b - m0);
        tasks.push_back({u, rk + m0 * W, rv + m0 * W, W, consecutive_rows(), len, m.data() + m0, 0,
                         un.far_rh >= 0 ? len : 0, nullptr, n_parts, rf ? rf + m0 : nullptr});
        n_parts += un.nh * part;
      }
    }
    first[u + 1] = (int64_t)tasks.size();
  }
  std::vector<float>& parts = scratch.parts;
  parts.resize(n_parts);
  const int64_t n_tasks = (int64_t)tasks.size();
  std::atomic<int64_t> bad_far{-1};  // a key whose far-pair term is not finite: (unit << 32) + key
  // One slice's partial states (one per head of its unit) into out.
  auto run_task = [&](const Task& tk, float* sc, float* far_row, float* out) {
    const Unit& un = units[tk.u];
    const float* b = tk.bias;
    if (tk.far) {  // a run's slice: its terms beside it (f0 = 0, f1 = len)
      for (int64_t m = 0; m < tk.len; ++m) {
        const float e = tk.far[m];
        if (!std::isfinite(e)) bad_far.store(tk.u * (int64_t{1} << 32) + tk.pos[m]);
        far_row[m] = un.far_eq + e;
      }
      b = far_row;
    } else if (un.far_rh >= 0 && tk.f1 > tk.f0 && !tk.bias) {  // (a block keys' bias holds the terms)
      const float* ek = r.far_k[un.far_rh];
      // The terms of a group's members are scattered over the sequence: requested ahead.
      constexpr int64_t kAhead = 16;
      for (int64_t m = tk.f0; m < std::min(tk.f1, tk.f0 + kAhead); ++m) __builtin_prefetch(ek + tk.pos[m]);
      for (int64_t m = 0; m < tk.len; ++m) {
        if (m + kAhead >= tk.f0 && m + kAhead < tk.f1) __builtin_prefetch(ek + tk.pos[m + kAhead]);
        const bool far = m >= tk.f0 && m < tk.f1;
        const float e = far ? ek[tk.pos[m]] : 0.f;
        if (!std::isfinite(e)) bad_far.store(tk.u * (int64_t{1} << 32) + tk.pos[m]);
        far_row[m] = far ? un.far_eq + e : 0.f;
      }
      b = far_row;
    }
    heads_slice_partials(q + un.t * s.q_stride + un.h0 * hd, un.nh, tk.kb, tk.vb, tk.stride, tk.idx, b, tk.len, hd,
                         s.scale, sc, out, part, b == tk.bias ? kSlice : 0);
  };
  // Unit u's list of keys read by position (the sinks, the groups without runs, the blocks), then
  // its slices, on the thread that made it; returns the slice count.
  auto list_job = [&](int64_t u, float* sc, float* far_row) -> int64_t {
    Unit& un = units[u];
    const int64_t kvh = un.h0 / hpk, rh = route_of(s, r, un.h0);
    row_keys(s, r, idx, un.t, un.h0, with_groups && !runs, keys[u], &un.g0, &un.g1, /*window=*/false);
    un.list_base = (int64_t)keys[u].size();
    bias[u].clear();
    // With far-pair terms a bias made for block keys carries the groups' terms too (g0 .. g1).
    if (with_groups && r.kb > 0)
      un.bad_far = add_unit_block_keys(s, r, idx, un.t, un.h0, un.nh, keys[u], bias[u],
                                       UnitFarTerms{un.far_rh >= 0 ? r.far_k[rh] : nullptr, un.far_eq, un.g0, un.g1},
                                       &un.block_pairs);
    if (un.bad_far >= 0) return 0;  // refused below, before anything is merged
    const int64_t n = (int64_t)keys[u].size(), slices = (n + kSlice - 1) / kSlice;
    list_parts[u].resize(slices * un.nh * part);
    for (int64_t c = 0; c < slices; ++c) {
      const int64_t m0 = c * kSlice, len = std::min(kSlice, n - m0);
      const int32_t* kl = keys[u].data() + m0;
      const Task tk{u, k + kvh * hd, v + kvh * hd, s.kv_stride, kl, len, kl, std::clamp(un.g0 - m0, int64_t{0}, len),
                    std::clamp(un.g1 - m0, int64_t{0}, len), bias[u].empty() ? nullptr : bias[u].data() + c * un.nh * kSlice,
                    0};
      run_task(tk, sc, far_row, list_parts[u].data() + c * un.nh * part);
    }
    return slices;
  };
  // Every unit's list job, then the slices known before (in that order, dynamically over the
  // threads: the lists are made side by side, and a thread done with one takes known slices while
  // another still makes its own). The lists are few microseconds of serial work each, repeated for
  // every kv head of every layer of a decoding step.
  std::vector<int64_t>& list_slices = scratch.list_slices;
  list_slices.assign(U, 0);
  const int64_t n_jobs = U + n_tasks;
  parallel_for_checked(n_jobs, n_jobs > 1 && n_jobs * kSlice * hd > 32768 && num_threads() > 1, [&](int64_t i) {
    thread_local std::vector<float> sc, far_row;  // this thread's
    sc.resize(hpk * kSlice);
    far_row.resize(kSlice);
    if (i < U)
      list_slices[i] = list_job(i, sc.data(), far_row.data());
    else
      run_task(tasks[i - U], sc.data(), far_row.data(), parts.data() + tasks[i - U].out);
  });
  for (int64_t u = 0; u < U; ++u)
    if (const int64_t j = units[u].bad_far; j >= 0) {
      const int64_t rh = route_of(s, r, units[u].h0);
      FOCUS_CHECK(false, "grouped attention: far-pair term of key ", j, " (routing head ", rh, ") is ", r.far_k[rh][j]);
    }
  if (const int64_t x = bad_far.load(); x >= 0) {
    const int64_t u = x >> 32, j = x & 0xffffffff;
    const int64_t rh = units[u].far_rh;
    FOCUS_CHECK(false, "grouped attention: far-pair term of key ", j, " (routing head ", rh, ") is ", r.far_k[rh][j]);
  }
  if (pairs) {
    int64_t n = 0;
    for (int64_t u = 0; u < U; ++u) {
      int64_t per_head = units[u].list_base;
      for (int64_t i = first[u]; i < first[u + 1]; ++i) per_head += tasks[i].len;
      n += units[u].nh * per_head + units[u].block_pairs;
    }
    *pairs = n;
  }
  // Per head: the list's slices, then the window's and the runs'.
  for (int64_t u = 0; u < U; ++u) {
    const Unit& un = units[u];
    const int64_t nl = list_slices[u];
    for (int64_t hh = 0; hh < un.nh; ++hh) {
      const int64_t h = un.h0 + hh;
      const float l = merge_partials(nl + first[u + 1] - first[u], hd, o + un.t * s.o_stride + h * hd, [&](int64_t c) {
        const float* pr = c < nl ? list_parts[u].data() + (c * un.nh + hh) * part
                                 : parts.data() + tasks[first[u] + c - nl].out + hh * part;
        return Partial{pr[0], pr[1], pr + 2};
      });
      if (lse) lse[h * s.n_q + un.t] = l;
    }
  }
}

// The window and sinks part alone, each row's keys gathered by position (few rows: gathered_decode).
void gathered_window_attention(const float* q, const float* k, const float* v, float* o, float* lse,
                               const AttnShape& s, const GroupedRouting& r, const GroupedKeyIndex& idx) {
  const int64_t hd = s.head_dim, hpk = s.heads / s.kv_heads, part = hd + 2;
  auto qrow = [&](int64_t t, int64_t h) { return q + t * s.q_stride + h * hd; };
  auto orow = [&](int64_t t, int64_t h) { return o + t * s.o_stride + h * hd; };
  if (s.n_q * s.heads <= kFewPairs) {
    gathered_decode(q, k, v, o, lse, s, r, idx, /*with_groups=*/false);
    return;
  }
#pragma omp parallel
  {
    std::vector<int32_t> keys;
    std::vector<float> sc(kSlice), parts;
#pragma omp for schedule(dynamic, 4)
    for (int64_t x = 0; x < s.n_q * s.heads; ++x) {
      const int64_t t = x / s.heads, h = x % s.heads;
      row_keys(s, r, idx, t, h, /*with_groups=*/false, keys);
      const int64_t slices = ((int64_t)keys.size() + kSlice - 1) / kSlice;
      parts.resize(slices * part);
      for (int64_t c = 0; c < slices; ++c)
        slice_partial(qrow(t, h), k, v, s, h / hpk, keys.data() + c * kSlice,
                      std::min<int64_t>(kSlice, (int64_t)keys.size() - c * kSlice), sc.data(), parts.data() + c * part);
      const float l = merge_slices(parts.data(), slices, hd, orow(t, h));
      if (lse) lse[h * s.n_q + t] = l;
    }
  }
}

void block_list_pass(const float* q, const float* k, const float* v, float* o, float* L, const AttnShape& s,
                     int64_t block, const int32_t* lists, int64_t kq, const GroupedRouting* hy,
                     const GroupedKeyIndex* idx);

// The hybrid pattern over many rows: the window, sinks and groups in tiles, then the keys of the
// rows' blocks that are not in their groups, in tiles of neighbouring rows (block_list_pass), their
// partial states merged into the tiled result (the two key sets are disjoint, so the union is exact).
void hybrid_attention(const float* q, const float* k, const float* v, float* o, float* lse, const AttnShape& s,
                      const GroupedRouting& r, const GroupedKeyIndex& idx) {
  const int64_t n = s.n_q;
  GroupedRouting groups = r;
  groups.kb = 0;
  groups.query_blocks = nullptr;
  std::vector<float> own;
  float* L = lse;
  if (!L) {
    own.resize(s.heads * n);
    L = own.data();
  }
  tiled_attention(q, k, v, o, L, s, groups, idx);
  block_list_pass(q, k, v, o, L, s, r.block_size, r.query_blocks, r.kb, &r, &idx);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
void GroupedKeyIndex::reset(int64_t G, int64_t RH) {
  FOCUS_CHECK(G >= 1 && G < (int64_t{1} << 31) && RH >= 1, "GroupedKeyIndex: bad n_groups ", G,
              " or route_heads ", RH);
  n_groups = G;
  route_heads = RH;
  n_keys = 0;
  members.assign(RH * G, {});
  key_group.assign(RH, {});
}

void GroupedKeyIndex::build(const GroupedRouting& routing, int64_t n_kv) {
  reset(routing.n_groups, routing.route_heads);
  append(routing.key_group, n_kv);
}

void GroupedKeyIndex::append(const int32_t* key_group_rows, int64_t n_new) {
  FOCUS_CHECK(n_new >= 0 && n_keys + n_new < (int64_t{1} << 31), "GroupedKeyIndex: ", n_keys + n_new,
              " keys out of range");
  if (n_new == 0) return;
  FOCUS_CHECK(!members.empty(), "GroupedKeyIndex: append before build or reset");
  for (int64_t x = 0; x < route_heads * n_new; ++x)
    FOCUS_CHECK(key_group_rows[x] >= 0 && key_group_rows[x] < n_groups, "GroupedKeyIndex: group id ",
                key_group_rows[x], " of key ", n_keys + x % n_new, " (routing head ", x / n_new, ") outside [0, ",
                n_groups, ")");
  for (int64_t rh = 0; rh < route_heads; ++rh) {
    for (int64_t j = 0; j < n_new; ++j)
      members[rh * n_groups + key_group_rows[rh * n_new + j]].push_back((int32_t)(n_keys + j));
    key_group[rh].insert(key_group[rh].end(), key_group_rows + rh * n_new, key_group_rows + (rh + 1) * n_new);
  }
  n_keys += n_new;
}

void GroupedKeyIndex::truncate(int64_t n) {
  FOCUS_CHECK(n >= 0 && n <= n_keys, "GroupedKeyIndex: cannot truncate ", n_keys, " keys to ", n);
  for (auto& m : members) m.resize(std::lower_bound(m.begin(), m.end(), (int32_t)n) - m.begin());
  for (auto& g : key_group) g.resize(n);
  n_keys = n;
}

void GroupedKvRuns::sync(const GroupedKeyIndex& idx, KvView kc, KvView vc, int64_t kv_heads, int64_t hd,
                         int64_t kv_stride, const float* const* far_k) {
  FOCUS_CHECK(kc.type == vc.type, "grouped attention: keys and values of different types");
  FOCUS_CHECK(idx.route_heads >= 1 && kv_heads % idx.route_heads == 0, "grouped attention: ", idx.route_heads,
              " routing heads do not divide ", kv_heads, " kv heads (runs of group keys)");
  if (rows.empty()) {
    type = kc.type;
    n_groups = idx.n_groups;
    route_heads = idx.route_heads;
    kv_per_route = kv_heads / idx.route_heads;
    head_dim = hd;
    n_keys = 0;
    k.assign(route_heads * n_groups, {});
    v.assign(route_heads * n_groups, {});
    far.assign(far_k ? route_heads * n_groups : 0, {});
    rows.assign(route_heads * n_groups, 0);
  }
  FOCUS_CHECK(type == kc.type && n_groups == idx.n_groups && route_heads == idx.route_heads &&
                  kv_per_route * route_heads == kv_heads && head_dim == hd && far.empty() == !far_k,
              "grouped attention: the runs of group keys were made for another layout");
  const int64_t es = kv_type_bytes(type), row = width() * es;
  const uint8_t *ks = static_cast<const uint8_t*>(kc.data), *vs = static_cast<const uint8_t*>(vc.data);
  auto bring = [&](int64_t rh, int64_t g) {
    const int64_t x = rh * n_groups + g;
    const std::vector<int32_t>& m = idx.group(rh, g);
    const int64_t have = rows[x], want = (int64_t)m.size();
    if (want <= have) return;
    k[x].resize(want * row);
    v[x].resize(want * row);
    const int64_t off = rh * kv_per_route * hd * es;  // the routing head's kv heads in a cache row
    for (int64_t i = have; i < want; ++i) {
      const int64_t src = (int64_t)m[i] * kv_stride * es + off;
      std::memcpy(k[x].data() + i * row, ks + src, row);
      std::memcpy(v[x].data() + i * row, vs + src, row);
    }
    if (far_k) {
      far[x].resize(want);
      for (int64_t i = have; i < want; ++i) far[x][i] = far_k[rh][m[i]];
    }
    rows[x] = want;
  };
  // Only the groups of the keys added since the last call have new members (a decoding step: one
  // key per routing head; the other groups' lists, cold by then, are not touched).
  const int64_t added = idx.n_keys - n_keys;
  if (n_keys > 0 && added >= 0 && added < n_groups) {
    for (int64_t rh = 0; rh < route_heads; ++rh)
      for (int64_t j = n_keys; j < idx.n_keys; ++j) bring(rh, idx.groups_of_keys(rh)[j]);
  } else {
    for (int64_t rh = 0; rh < route_heads; ++rh)
      for (int64_t g = 0; g < n_groups; ++g) bring(rh, g);
  }
  n_keys = idx.n_keys;
}

void GroupedKvRuns::truncate(const GroupedKeyIndex& idx, int64_t n) {
  if (rows.empty()) return;
  FOCUS_CHECK(idx.n_keys <= n && (int64_t)idx.members.size() == (int64_t)rows.size(),
              "GroupedKvRuns: truncate the key index first");
  const int64_t row = width() * kv_type_bytes(type);
  for (size_t x = 0; x < rows.size(); ++x) {
    rows[x] = std::min<int64_t>(rows[x], (int64_t)idx.members[x].size());
    k[x].resize(rows[x] * row);
    v[x].resize(rows[x] * row);
    if (!far.empty()) far[x].resize(rows[x]);
  }
  n_keys = std::min(n_keys, n);
}

void GroupedKeyIndex::grow(int64_t G) {
  FOCUS_CHECK(!members.empty(), "GroupedKeyIndex: grow before build or reset");
  FOCUS_CHECK(G >= n_groups && G < (int64_t{1} << 31), "GroupedKeyIndex: cannot grow ", n_groups, " groups to ", G);
  if (G == n_groups) return;
  std::vector<std::vector<int32_t>> m(route_heads * G);
  for (int64_t rh = 0; rh < route_heads; ++rh)
    for (int64_t g = 0; g < n_groups; ++g) m[rh * G + g] = std::move(members[rh * n_groups + g]);
  members = std::move(m);
  n_groups = G;
}

void grouped_attention_reference(const float* q, const float* k, const float* v, float* o, float* lse,
                                 const AttnShape& s, const GroupedRouting& r) {
  check_shape(s);
  check_routing(s, r);
  check_key_groups(r.key_group, s.n_kv, r.n_groups, r.route_heads);
  const int64_t hd = s.head_dim, hpk = s.heads / s.kv_heads;
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t t = 0; t < s.n_q; ++t) {
    const int64_t p = s.q_pos0 + t;
    std::vector<double> sc(p + 1), acc(hd);
    for (int64_t h = 0; h < s.heads; ++h) {
      const int32_t* slots = r.query_groups + (t * s.heads + h) * r.kq;
      const int32_t* kg = r.key_group + route_of(s, r, h) * s.n_kv;
      const int32_t* bs = r.kb > 0 ? r.query_blocks + (t * s.heads + h) * r.kb : nullptr;
      auto in_block = [&](int64_t j) {
        for (int c = 0; c < r.kb; ++c)
          if (bs[c] >= 0 && bs[c] == j / r.block_size) return true;
        return false;
      };
      const float* qr = q + t * s.q_stride + h * hd;
      const int64_t kvh = h / hpk;
      const int64_t rh = route_of(s, r, h);
      double mx = -INFINITY;
      for (int64_t j = 0; j <= p; ++j) {
        const bool near = p - j < s.local_window || j < s.sinks;
        const bool vis = near || reads(r, slots, kg[j]) || in_block(j);
        sc[j] = -INFINITY;
        if (!vis) continue;
        const float* kr = k + j * s.kv_stride + kvh * hd;
        double d = 0;
        for (int64_t y = 0; y < hd; ++y) d += (double)qr[y] * kr[y];
        sc[j] = d * s.scale;
        if (r.far_q && !near) sc[j] += (double)r.far_q[rh][t] + (double)r.far_k[rh][j];
        mx = std::max(mx, sc[j]);
      }
      std::fill(acc.begin(), acc.end(), 0.0);
      double sum = 0;
      for (int64_t j = 0; j <= p; ++j) {
        if (sc[j] == -INFINITY) continue;
        const double e = std::exp(sc[j] - mx);
        sum += e;
        const float* vr = v + j * s.kv_stride + kvh * hd;
        for (int64_t y = 0; y < hd; ++y) acc[y] += e * vr[y];
      }
      float* orow = o + t * s.o_stride + h * hd;
      for (int64_t y = 0; y < hd; ++y) orow[y] = (float)(acc[y] / sum);  // sum >= 1: key p is visible
      if (lse) lse[h * s.n_q + t] = (float)(mx + std::log(sum));
    }
  }
}

namespace {
int64_t checked_pair_count(const AttnShape& s, const GroupedRouting& r, const GroupedKeyIndex& idx);
}  // namespace

void grouped_attention(const float* q, const float* k, const float* v, float* o, float* lse, const AttnShape& s,
                       const GroupedRouting& r, const GroupedKeyIndex& idx, int64_t* pairs) {
  check_shape(s);
  check_routing(s, r);
  FOCUS_CHECK(idx.n_groups == r.n_groups && idx.route_heads == r.route_heads, "grouped attention: the key index has ",
              idx.n_groups, " groups and ", idx.route_heads, " routing heads, the routing ", r.n_groups, " and ",
              r.route_heads);
  FOCUS_CHECK(idx.n_keys >= s.n_kv, "grouped attention: the key index holds ", idx.n_keys, " keys, ", s.n_kv,
              " needed");
  if (s.n_q > 0 && s.n_q * s.heads <= kFewPairs) {  // decoding: the kernel counts what it reads
    gathered_decode(q, k, v, o, lse, s, r, idx, /*with_groups=*/true, pairs);
    return;
  }
  if (pairs) *pairs = checked_pair_count(s, r, idx);
  if (s.n_q == 0) return;
  if (r.kb > 0)
    hybrid_attention(q, k, v, o, lse, s, r, idx);
  else
    tiled_attention(q, k, v, o, lse, s, r, idx);
}

void grouped_attention(const float* q, KvView k, KvView v, float* o, float* lse, const AttnShape& s,
                       const GroupedRouting& r, const GroupedKeyIndex& idx, int64_t* pairs) {
  FOCUS_CHECK(k.type == v.type, "grouped attention: keys and values of different types");
  if (k.type == KvType::F32)
    return grouped_attention(q, k.as<float>(), v.as<float>(), o, lse, s, r, idx, pairs);
  if (s.n_q * s.heads <= kFewPairs && s.n_q > 0) {  // decoding: read the cache as it is
    check_shape(s);
    check_routing(s, r);
    FOCUS_CHECK(idx.n_groups == r.n_groups && idx.route_heads == r.route_heads && idx.n_keys >= s.n_kv,
                "grouped attention: the key index does not match the routing or holds too few keys");
    with_kv_type(k.type, [&](auto tag) {
      using E = decltype(tag);
      gathered_decode(q, k.as<E>(), v.as<E>(), o, lse, s, r, idx, /*with_groups=*/true, pairs);
    });
    return;
  }
  // Many rows over a 16-bit cache (chunked prefill): the tiled kernel on its float values.
  static thread_local std::vector<float> kf, vf;
  const int64_t n = s.n_kv * s.kv_stride;
  kf.resize(n);
  vf.resize(n);
  kv_load_floats(k, n, kf.data());
  kv_load_floats(v, n, vf.data());
  grouped_attention(q, kf.data(), vf.data(), o, lse, s, r, idx, pairs);
}

namespace {

// Copies a run of len consecutive keys of a transposed block (row d at src + d * ld_src) into
// a key tile's columns (row d at dst + d * kBk), 32 bytes at a time, then 16, then one by one. The
// loops keep the dimension outside, so the compiler does not turn them into a library call per
// dimension.
inline void copy_run(float* dst, const float* src, int64_t ld_src, int64_t hd, int64_t len) {
  typedef float v4u __attribute__((vector_size(16), aligned(4)));
  typedef float v8u __attribute__((vector_size(32), aligned(4)));
  auto move4 = [](float* to, const float* from) { *reinterpret_cast<v4u*>(to) = *reinterpret_cast<const v4u*>(from); };
  auto move8 = [](float* to, const float* from) { *reinterpret_cast<v8u*>(to) = *reinterpret_cast<const v8u*>(from); };
  const int64_t l8 = len & ~int64_t{7}, l4 = len & ~int64_t{3};
  for (int64_t d = 0; d < hd; ++d) {
    float* to = dst + d * kBk;
    const float* from = src + d * ld_src;
    for (int64_t c = 0; c < l8; c += 8) move8(to + c, from + c);
    for (int64_t c = l8; c < l4; c += 4) move4(to + c, from + c);
    for (int64_t c = l4; c < len; ++c) to[c] = from[c];
  }
}

void block_list_pass(const float* q, const float* k, const float* v, float* o, float* L, const AttnShape& s,
                     int64_t block, const int32_t* lists, int64_t kq, const GroupedRouting* hy,
                     const GroupedKeyIndex* idx) {
  const int64_t n = s.n_q, nk = s.n_kv, p0 = s.q_pos0, hd = s.head_dim, hdp = padded_dim(hd), H = s.heads;
  const int64_t hpk = H / s.kv_heads, w = s.local_window, S = s.sinks, nb = (nk + block - 1) / block;
  // Rows before position S + w have no far key; a tile of rows is an item of one head.
  const int64_t first = std::clamp<int64_t>(S + w - p0, 0, n) / kListRows, tiles = (n + kListRows - 1) / kListRows;
  const int64_t items = H * (tiles - first);
  if (items <= 0) return;
  // The blocks the rows with far keys list, each id checked before anything is read. A prefill
  // from the start whose lists the hybrid's routing check has passed, with more slots than there
  // are blocks, stages every block instead of reading its lists once more (its rows' blocks are
  // its own keys'; a chunk over a long cache stages only what it lists).
  std::vector<int32_t> used;
  if (hy && p0 == 0 && (n - first * kListRows) * H * kq >= nb) {
    used.resize(nb);
    std::iota(used.begin(), used.end(), 0);
  } else {
    std::vector<char> used_mark(nb, 0);
    for (int64_t x = first * kListRows * H * kq; x < n * H * kq; ++x) {
      const int32_t b = lists[x];
      FOCUS_CHECK(b >= -1 && b < nb, "block list attention: block ", b, " outside the ", nb, " blocks of ", nk,
                  " keys");
      if (b >= 0) used_mark[b] = 1;
    }
    for (int64_t b = 0; b < nb; ++b)
      if (used_mark[b]) used.push_back((int32_t)b);
  }
  const int64_t nu = (int64_t)used.size();
  // The keys of those blocks, each block transposed: [kv_heads][blocks][hd][block], so a run of a
  // block's keys is a few consecutive floats per dimension, and a block is one contiguous piece.
  // The values are read where they lie, one row pointer per key of a tile; when a head's values
  // are not whole vectors, from a copy of the listed blocks' rows padded with zeros
  // ([kv_heads][nk][hdp]). Blocks no row lists are left unwritten (a few rows over a long cache copy
  // what they read, not the cache). (The calling thread's scratch, trimmed with the kernel's other
  // buffers, reached by the team through plain pointers.)
  const bool pad_v = hdp != hd;
  tl_scratch.list_k.resize(s.kv_heads * nb * hd * block);
  if (pad_v) tl_scratch.list_v.resize(s.kv_heads * nk * hdp);
  float* const kT = tl_scratch.list_k.data();
  float* const vP = pad_v ? tl_scratch.list_v.data() : nullptr;
#pragma omp parallel for schedule(static)
  for (int64_t x = 0; x < s.kv_heads * nu; ++x) {
    const int64_t kvh = x / nu, b = used[x % nu];
    float* dst = kT + (kvh * nb + b) * hd * block;
    for (int64_t j = b * block; j < std::min(nk, (b + 1) * block); ++j) {
      const float* kr = k + j * s.kv_stride + kvh * hd;
      for (int64_t d = 0; d < hd; ++d) dst[d * block + j - b * block] = kr[d];
      if (!pad_v) continue;
      float* vr = vP + (kvh * nk + j) * hdp;
      std::memcpy(vr, v + j * s.kv_stride + kvh * hd, hd * sizeof(float));
      std::fill(vr + hd, vr + hdp, 0.f);
    }
  }
  // Key j's value row of kv head kvh (hdp floats readable).
  const float* const v_base = pad_v ? vP : v;
  const int64_t v_head = pad_v ? nk * hdp : hd, v_key = pad_v ? hdp : s.kv_stride;
#pragma omp parallel
  {
    QueryTile qt(hdp);
    RowSpan spans[kBq];
    AlignedFloats kt(hdp * kBk), zero_row(hdp, 0.f), bias(kBq * kBk);
    const float* vrows[kBk];
    std::vector<int64_t> stamp(nb, -1);
    std::vector<int32_t> uni, uidx(nb);
    // The far keys of the union as runs of consecutive positions, one per block: (union index,
    // first position, length), cut at key tile boundaries.
    struct Run {
      int32_t u, j0, len, c;  // c: first slot in its key tile
    };
    std::vector<Run> runs;
    std::vector<int64_t> tile_runs;  // [key tiles + 1] first run of each key tile
    std::vector<uint64_t> sel;
    std::vector<float> part(hd);
    std::vector<char> seen(kListRows);
#pragma omp for schedule(dynamic, 1)
    for (int64_t x = 0; x < items; ++x) {
      const int64_t h = x % H, t0 = (first + x / H) * kListRows, t1 = std::min(n, t0 + kListRows);
      const int64_t kvh = h / hpk, nr = t1 - t0, last = p0 + t1 - 1 - w;  // the last far key of the tile
      if (last < S) continue;
      // The union of the rows' blocks, ascending, and each row's choice as bits over it.
      uni.clear();
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t c = 0; c < kq; ++c) {
          const int32_t b = lists[(t * H + h) * kq + c];
          if (b >= 0 && stamp[b] != x) {
            stamp[b] = x;
            uni.push_back(b);
          }
        }
      if (uni.empty()) continue;
      std::sort(uni.begin(), uni.end());
      const int64_t U = (int64_t)uni.size(), words = (U + 63) / 64;
      for (int64_t u = 0; u < U; ++u) uidx[uni[u]] = (int32_t)u;
      sel.assign(nr * words, 0);
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t c = 0; c < kq; ++c) {
          const int32_t b = lists[(t * H + h) * kq + c];
          if (b >= 0) sel[(t - t0) * words + uidx[b] / 64] |= uint64_t{1} << (uidx[b] % 64);
        }
      // Their far keys (positions S .. last), in key tiles of kBk slots.
      runs.clear();
      tile_runs.assign(1, 0);
      int64_t fill = 0;
      for (int64_t u = 0; u < U; ++u) {
        int64_t j = std::max<int64_t>(uni[u] * block, S);
        const int64_t j1 = std::min<int64_t>((uni[u] + 1) * block, last + 1);
        while (j < j1) {
          const int64_t len = std::min<int64_t>(j1 - j, kBk - fill);
          runs.push_back({(int32_t)u, (int32_t)j, (int32_t)len, (int32_t)fill});
          j += len;
          fill += len;
          if (fill == kBk) {
            tile_runs.push_back((int64_t)runs.size());
            fill = 0;
          }
        }
      }
      if (fill > 0) tile_runs.push_back((int64_t)runs.size());
      const int64_t key_tiles = (int64_t)tile_runs.size() - 1;
      if (key_tiles == 0) continue;
      qt.reset((int)nr);
      for (int64_t i = 0; i < nr; ++i) qt.load_row((int)i, q + (t0 + i) * s.q_stride + h * hd, hd, s.scale);
      std::fill(seen.begin(), seen.end(), 0);
      const float* kTh = kT + kvh * nb * hd * block;
      // The hybrid: the keys' groups and far terms under the head's routing head.
      const int64_t rh = hy ? route_of(s, *hy, h) : 0;
      const int32_t* kg = hy ? idx->groups_of_keys(rh) : nullptr;
      const float* fk = hy && hy->far_q ? hy->far_k[rh] : nullptr;
      for (int64_t kt_i = 0; kt_i < key_tiles; ++kt_i) {
        const Run* r0 = runs.data() + tile_runs[kt_i];
        const Run* r1 = runs.data() + tile_runs[kt_i + 1];
        const int64_t m = r1[-1].c + r1[-1].len;
        const float* const vh = v_base + kvh * v_head;
        for (const Run* r = r0; r < r1; ++r) {
          const int64_t b = r->j0 / block;
          copy_run(kt.data() + r->c, kTh + b * hd * block + (r->j0 - b * block), block, hd, r->len);
          for (int64_t c = 0; c < r->len; ++c) vrows[r->c + c] = vh + (r->j0 + c) * v_key;
        }
        for (int64_t d = 0; d < hdp; ++d)  // padding: zero keys (hidden by the spans) and dimensions
          std::fill(kt.data() + d * kBk + (d < hd ? m : 0), kt.data() + (d + 1) * kBk, 0.f);
        std::fill(vrows + m, vrows + kBk, zero_row.data());
        for (int64_t i = 0; i < nr; ++i) {
          const int64_t t = t0 + i, lim = p0 + t - w;
          const uint64_t* bits = sel.data() + i * words;
          const int32_t* gs = hy ? hy->query_groups + (t * H + h) * hy->kq : nullptr;
          const float fq = fk ? hy->far_q[rh][t] : 0.f;
          float* br = bias.data() + i * kBk;
          bool any = false;
          for (const Run* r = r0; r < r1; ++r) {
            // This row sees the run's keys up to lim when it chose the run's block (in the hybrid,
            // those outside its groups).
            const int64_t cut = (bits[r->u / 64] >> (r->u % 64) & 1) ? std::clamp<int64_t>(lim - r->j0 + 1, 0, r->len) : 0;
            float* bc = br + r->c;
            if (!hy) {
              for (int64_t c = 0; c < r->len; ++c) bc[c] = c < cut ? 0.f : kNegInf;
              any |= cut > 0;
              continue;
            }
            // A vector of keys at a time, then one by one (the keys' groups and terms are
            // consecutive in the index and the term rows).
            const int32_t* kj = kg + r->j0;
            const float* fj = fk ? fk + r->j0 : nullptr;
            int64_t c = 0;
            for (; c + simd::kV <= cut; c += simd::kV) {
              const simd::vi out = in_groups(simd::loadi(kj + c), gs, hy->kq);
              const simd::vf b = fj ? simd::bcast(fq) + simd::load(fj + c) : simd::vf{};
              simd::store(bc + c, simd::select(~out, b, simd::bcast(kNegInf)));
              any |= simd::lane_bits(~out) != 0;
            }
            for (; c < cut; ++c) {
              const bool vis = !reads(*hy, gs, kj[c]);
              bc[c] = vis ? (fj ? fq + fj[c] : 0.f) : kNegInf;
              any |= vis;
            }
            for (; c < r->len; ++c) bc[c] = kNegInf;
          }
          spans[i] = RowSpan{};
          if (any) {
            spans[i].hi0 = (int)m;
            seen[i] = 1;
          }
        }
        qt.visit<ExpMode::Exact, true>(kt.data(), tiles::GatheredRows{vrows}, 0, (int)nr, spans, nullptr, bias.data());
      }
      for (int64_t i = 0; i < nr; ++i) {
        if (!seen[i]) continue;
        const int64_t t = t0 + i;
        float pl;
        qt.store_row((int)i, part.data(), hd, &pl);
        float* orow = o + t * s.o_stride + h * hd;
        const float l0 = L[h * n + t];
        L[h * n + t] = merge_partials(2, hd, orow, [&](int64_t c) {
          return c == 0 ? Partial{l0, 1.f, orow} : Partial{pl, 1.f, part.data()};
        });
      }
    }
  }
}

}  // namespace

void block_list_attention(const float* q, const float* k, const float* v, float* o, float* lse, const AttnShape& s,
                          int64_t block, const int32_t* lists, int64_t kq) {
  check_shape(s);
  FOCUS_CHECK(s.q_pos0 == 0 && s.n_kv == s.n_q, "block list attention: a prefill from position 0 (q_pos0 ",
              s.q_pos0, ", ", s.n_q, " rows, ", s.n_kv, " keys)");
  FOCUS_CHECK(block >= 1 && kq >= 1, "block list attention: block ", block, ", ", kq, " slots");
  const int64_t n = s.n_q;
  if (n == 0) return;
  std::vector<float> own;
  float* L = lse;
  if (!L) {
    own.resize(s.heads * n);
    L = own.data();
  }
  focus_window_attention(q, k, v, o, L, s);
  block_list_pass(q, k, v, o, L, s, block, lists, kq, nullptr, nullptr);
}

namespace {

// Per routing head and block, how many of the block's far keys (from the sinks on, before the last
// key) each group holds: [route_heads][blocks][groups]. Empty when that table would be large.
std::vector<int32_t> block_group_counts(const AttnShape& s, const GroupedRouting& r, const GroupedKeyIndex& idx) {
  const int64_t B = r.block_size, nb = (s.n_kv + B - 1) / B, G = r.n_groups;
  std::vector<int32_t> counts;
  if (r.route_heads * nb * G > (int64_t{1} << 24)) return counts;
  counts.assign(r.route_heads * nb * G, 0);
  for (int64_t rh = 0; rh < r.route_heads; ++rh) {
    const int32_t* kg = idx.groups_of_keys(rh);
    int32_t* c = counts.data() + rh * nb * G;
    for (int64_t j = s.sinks; j < s.n_kv; ++j) ++c[(j / B) * G + kg[j]];
  }
  return counts;
}

// How many far keys (beyond the sinks, before hi_far) of the blocks read by (row t, head h) are
// outside its groups: a block wholly before hi_far from the counts (its keys less those of the
// row's groups), the others a vector of the keys' groups at a time.
int64_t count_block_extra_keys(const AttnShape& s, const GroupedRouting& r, const GroupedKeyIndex& idx,
                               const std::vector<int32_t>& counts, int64_t t, int64_t h, int64_t hi_far) {
  const int32_t* gs = r.query_groups + (t * s.heads + h) * r.kq;
  const int32_t* bs = r.query_blocks + (t * s.heads + h) * r.kb;
  const int64_t rh = route_of(s, r, h), G = r.n_groups, nb = (s.n_kv + r.block_size - 1) / r.block_size;
  const int32_t* kg = idx.groups_of_keys(rh);
  int64_t n = 0;
  for (int c = 0; c < r.kb; ++c) {
    if (bs[c] < 0) continue;
    const auto [j0, j1] = block_far_keys(s, r, bs[c], hi_far);
    if (j1 <= j0) continue;
    if (!counts.empty() && j1 == std::min<int64_t>((bs[c] + 1) * r.block_size, s.n_kv)) {
      const int32_t* bc = counts.data() + (rh * nb + bs[c]) * G;
      n += j1 - j0;
      for (int64_t i = 0; i < r.kq; ++i)
        if (gs[i] >= 0) n -= bc[gs[i]];
      continue;
    }
    int64_t j = j0;
    for (; j + simd::kV <= j1; j += simd::kV)
      n += simd::kV - __builtin_popcount(simd::lane_bits(in_groups(simd::loadi(kg + j), gs, r.kq)));
    for (; j < j1; ++j) n += !reads(r, gs, kg[j]);
  }
  return n;
}

}  // namespace

namespace {

// grouped_pair_count of a shape, routing and index already checked.
int64_t checked_pair_count(const AttnShape& s, const GroupedRouting& r, const GroupedKeyIndex& idx) {
  const int64_t w = s.local_window, S = s.sinks;
  // Many rows' blocks (a prefill) are counted from each block's group counts; a few rows (decoding)
  // key by key, cheaper than counting every block's keys.
  const std::vector<int32_t> counts =
      r.kb > 0 && s.n_q * s.heads * r.kb * r.block_size > 4 * r.route_heads * s.n_kv ? block_group_counts(s, r, idx)
                                                                                      : std::vector<int32_t>{};
  int64_t total = 0;
  // Rows are counted in parallel (a prefill's block keys are tens of millions per layer); integer
  // sums, so the count does not depend on the threads.
#pragma omp parallel for schedule(dynamic, 64) reduction(+ : total) if (s.n_q * s.heads > kFewPairs)
  for (int64_t t = 0; t < s.n_q; ++t) {
    const int64_t p = s.q_pos0 + t, lo = p - w + 1;  // group keys: S <= j < lo
    total += s.heads * (std::min(p + 1, w) + std::min(S, std::max<int64_t>(0, lo)));
    if (lo <= S) continue;
    for (int64_t h = 0; h < s.heads; ++h) {
      const int32_t* gs = r.query_groups + (t * s.heads + h) * r.kq;
      for (int c = 0; c < r.kq; ++c) {
        if (gs[c] < 0) continue;
        const auto& m = idx.group(route_of(s, r, h), gs[c]);
        const auto a = std::lower_bound(m.begin(), m.end(), (int32_t)S);
        total += std::lower_bound(a, m.end(), (int32_t)lo) - a;
      }
      if (r.kb > 0) total += count_block_extra_keys(s, r, idx, counts, t, h, lo);
    }
  }
  return total;
}

}  // namespace

int64_t grouped_pair_count(const AttnShape& s, const GroupedRouting& r, const GroupedKeyIndex& idx) {
  check_shape(s);
  check_routing(s, r);
  FOCUS_CHECK(idx.n_groups == r.n_groups && idx.route_heads == r.route_heads && idx.n_keys >= s.n_kv,
              "grouped attention: the key index (", idx.n_groups, " groups, ", idx.route_heads, " routing heads, ",
              idx.n_keys, " keys) does not match the routing (", r.n_groups, ", ", r.route_heads, ", ", s.n_kv, ")");
  return checked_pair_count(s, r, idx);
}

size_t grouped_attention_scratch_bytes() { return tl_scratch.bytes(); }

void grouped_attention_trim_scratch(size_t max_bytes) {
  if (tl_scratch.bytes() > max_bytes) tl_scratch.release();
}

}  // namespace focus::cpu
