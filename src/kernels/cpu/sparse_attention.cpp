#include "kernels/cpu/sparse_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <unordered_map>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/tile_engine.h"

namespace focus::cpu {
namespace {

using namespace tiles;

void check_shape(const AttnShape& s) {
  FOCUS_CHECK(s.n_q >= 0 && s.n_q < (int64_t{1} << 31), "focus attention: token count ", s.n_q, " out of range");
  FOCUS_CHECK(s.heads >= 1 && s.kv_heads >= 1 && s.heads % s.kv_heads == 0, "focus attention: heads ", s.heads,
              " not a multiple of kv_heads ", s.kv_heads);
  FOCUS_CHECK(s.head_dim >= 1, "focus attention: head_dim must be positive");
  FOCUS_CHECK(s.q_stride >= s.heads * s.head_dim && s.o_stride >= s.heads * s.head_dim &&
                  s.kv_stride >= s.kv_heads * s.head_dim,
              "focus attention: row strides smaller than a row");
  FOCUS_CHECK(s.n_kv == s.n_q && s.q_pos0 == 0, "focus attention: self-attention needs n_kv == n_q (", s.n_kv,
              " vs ", s.n_q, ") and q_pos0 == 0 (got ", s.q_pos0, ")");
  FOCUS_CHECK(s.sliding_window == 0, "focus attention: sliding_window must be 0, got ", s.sliding_window);
  FOCUS_CHECK(s.local_window >= 1, "focus attention: local_window must be >= 1, got ", s.local_window);
  FOCUS_CHECK(s.sinks >= 0, "focus attention: sinks must be >= 0, got ", s.sinks);
}

bool share_group(const Routing& r, int64_t i, int64_t j) {
  const int32_t* a = r.ids + i * r.topk;
  const int32_t* b = r.ids + j * r.topk;
  for (int x = 0; x < r.topk; ++x)
    for (int y = 0; y < r.topk; ++y)
      if (a[x] == b[y]) return true;
  return false;
}

bool visible(const AttnShape& s, const Routing& r, int64_t i, int64_t j) {
  return j <= i && (i - j < s.local_window || j < s.sinks || share_group(r, i, j));
}

// Prefetches one head's row (hd floats), one touch per 64-byte line; rows of one head are strided
// and often scattered.
template <int Write>
inline void prefetch_row(const float* p, int64_t hd) {
  constexpr int64_t kLine = 64 / sizeof(float);
  for (int64_t d = 0; d < hd; d += kLine) __builtin_prefetch(p + d, Write);
}
constexpr int kAhead = 6;  // rows prefetched ahead when gathering or scattering rows

// ---------------------------------------------------------------------------------------------
// Keys and values of one kv head copied into tiles: slot (t, c) of tile t holds one token's key
// (transposed, kt [hdp][kBk]) and value (v [kBk][hdp]); empty slots are zero.
struct KeyTiles {
  int64_t hdp = 0, n_tiles = 0;
  FloatBuffer kt, v;
  void resize(int64_t tiles, int64_t hdp_) {
    hdp = hdp_;
    n_tiles = tiles;
    kt.resize(tiles * hdp * kBk);
    v.resize(tiles * kBk * hdp);
  }
  size_t bytes() const { return kt.bytes() + v.bytes(); }
  void release() {
    kt.release();
    v.release();
    n_tiles = 0;
  }
  const float* kt_tile(int64_t t) const { return kt.data() + t * hdp * kBk; }
  const float* v_tile(int64_t t) const { return v.data() + t * kBk * hdp; }

  // Fills tile t from kv head kvh; token_of(slot) gives the token at a slot, or -1. Keys go in
  // kV slots at a time: kV rows loaded, transposed in registers, stored as kV rows of kt.
  template <class TokenOf>
  void fill_tile(int64_t t, const float* k, const float* vv, const AttnShape& s, int64_t kvh, TokenOf token_of) {
    const int64_t hd = s.head_dim, end_slot = n_tiles * kBk;
    float* kt_t = kt.data() + t * hdp * kBk;
    float* v_t = v.data() + t * kBk * hdp;
    for (int c0 = 0; c0 < kBk; c0 += kV) {
      const int64_t slot0 = t * kBk + c0;
      int64_t tok[kV];
      for (int i = 0; i < kV; ++i) {
        tok[i] = token_of(slot0 + i);
        // Rows are kv_stride apart and, in group order, scattered: fetch the next slots' rows.
        const int64_t ahead = slot0 + kV + i < end_slot ? token_of(slot0 + kV + i) : -1;
        if (ahead >= 0) {
          prefetch_row<0>(k + ahead * s.kv_stride + kvh * hd, hd);
          prefetch_row<0>(vv + ahead * s.kv_stride + kvh * hd, hd);
        }
      }
      for (int64_t d0 = 0; d0 < hdp; d0 += kV) {
        const int64_t nd = std::clamp<int64_t>(hd - d0, 0, kV);
        vf r[kV];
        for (int i = 0; i < kV; ++i) {
          r[i] = vf{};
          if (tok[i] < 0 || nd == 0) continue;
          const float* kr = k + tok[i] * s.kv_stride + kvh * hd + d0;
          if (nd == kV)
            r[i] = load(kr);
          else
            std::memcpy(&r[i], kr, nd * sizeof(float));
        }
        transpose(r);
        for (int i = 0; i < kV; ++i) store(kt_t + (d0 + i) * kBk + c0, r[i]);
      }
      for (int i = 0; i < kV; ++i) {
        float* vr = v_t + (c0 + i) * hdp;
        int64_t d = 0;
        if (tok[i] >= 0) {
          std::memcpy(vr, vv + tok[i] * s.kv_stride + kvh * hd, hd * sizeof(float));
          d = hd;
        }
        std::fill(vr + d, vr + hdp, 0.f);
      }
    }
  }
};

// The group-sorted sequence packed into key tiles: each group starts on a tile boundary.
struct PackedGroups {
  const GroupLayout* layout = nullptr;
  std::vector<int64_t> tile_off;    // [G + 1] first tile of each group
  std::vector<int64_t> first;       // [G] first in-group index whose position is >= sinks
  std::vector<int32_t> slot_token;  // [tiles * kBk] token at each slot, -1 for padding
  std::vector<int32_t> slot_tag;    // topk 2: the slot token's other group (-2 for padding)

  void build(const GroupLayout& L, const Routing& r, int64_t sinks) {
    layout = &L;
    const int64_t G = L.n_groups;
    tile_off.assign(G + 1, 0);
    first.assign(G, 0);
    for (int64_t g = 0; g < G; ++g) {
      tile_off[g + 1] = tile_off[g] + (L.size(g) + kBk - 1) / kBk;
      const auto seg = L.group(g);
      first[g] = std::lower_bound(seg.begin(), seg.end(), (int32_t)std::min<int64_t>(sinks, INT32_MAX)) - seg.begin();
    }
    slot_token.assign(tile_off[G] * kBk, -1);
    if (r.topk == 2) slot_tag.assign(tile_off[G] * kBk, -2);
    for (int64_t g = 0; g < G; ++g) {
      const auto seg = L.group(g);
      for (size_t a = 0; a < seg.size(); ++a) {
        const int64_t slot = tile_off[g] * kBk + a;
        slot_token[slot] = seg[a];
        if (r.topk == 2) {
          const int32_t* ids = r.ids + (int64_t)seg[a] * 2;
          slot_tag[slot] = ids[0] == g ? ids[1] : ids[0];
        }
      }
    }
  }
  int64_t n_tiles() const { return tile_off.back(); }
};

// One query tile taken from group g's member list (rows t*kBq ..), with what every row needs.
struct GroupTileRows {
  int rows = 0;
  int32_t token[kBq];  // token index = position, increasing with the row
  int64_t cut[kBq];    // in-group keys [first, cut) lie beyond the window (position <= p - w)
  int32_t tag[kBq];    // topk 2: the row's other group when smaller than g (pairs sharing it are
                       // counted there), else -1
  bool owner[kBq];     // whether this tile computes the row's window and sink part

  void build(const PackedGroups& P, const Routing& r, int64_t g, int64_t t, int64_t local_window) {
    const auto seg = P.layout->group(g);
    const int64_t a0 = t * kBq;
    rows = (int)std::min<int64_t>(kBq, (int64_t)seg.size() - a0);
    for (int i = 0; i < rows; ++i) {
      const int64_t a = a0 + i;
      const int32_t p = seg[a];
      token[i] = p;
      cut[i] = std::upper_bound(seg.begin(), seg.begin() + a, (int64_t)p - local_window,
                                [](int64_t x, int32_t y) { return x < y; }) -
               seg.begin();
      if (r.topk == 2) {
        const int32_t* ids = r.ids + (int64_t)p * 2;
        const int32_t other = ids[0] == g ? ids[1] : ids[0];
        tag[i] = other < g ? other : -1;
        owner[i] = ids[0] == g;
      } else {
        tag[i] = -1;
        owner[i] = true;
      }
    }
  }
};

// Window and sink part: row r (position pos[r], increasing) sees [0, min(S, lo)) u [lo, p],
// lo = max(0, p - w + 1), when owner[r]. Keys come in original order.
struct WindowRows {
  const int32_t* pos;
  const bool* owner;
  int rows;
  // Key tiles the rows need: sink tiles [0, n_sink) and band tiles [b0, b1] (b1 < b0: none).
  int64_t n_sink = 0, b0 = 0, b1 = -1;

  WindowRows(const int32_t* pos_, const bool* owner_, int rows_, int64_t w, int64_t S)
      : pos(pos_), owner(owner_), rows(rows_) {
    int64_t sink_end = 0, band_lo = std::numeric_limits<int64_t>::max(), band_hi = -1;
    for (int r = 0; r < rows; ++r) {
      if (!owner[r]) continue;
      const int64_t lo = std::max<int64_t>(0, pos[r] - w + 1);
      sink_end = std::max(sink_end, std::min(S, lo));
      band_lo = std::min(band_lo, lo);
      band_hi = std::max<int64_t>(band_hi, pos[r]);
    }
    if (band_hi < 0) return;
    n_sink = (sink_end + kBk - 1) / kBk;
    b0 = band_lo / kBk;
    b1 = band_hi / kBk;
  }
  bool needs(int64_t tt) const { return tt < n_sink || (tt >= b0 && tt <= b1); }

  // Visits key tile tt with every row that sees part of it.
  void visit_tile(QueryTile& qt, RowSpan* spans, const KeyTiles& keys, int64_t w, int64_t S, int64_t tt) const {
    auto clampc = [](int64_t x) { return (int)std::clamp<int64_t>(x, 0, kBk); };
    const int64_t j0 = tt * kBk;
    int r0 = rows, r1 = 0;
    for (int r = 0; r < rows; ++r) {
      RowSpan& sp = spans[r];
      sp = RowSpan{};
      if (!owner[r]) continue;
      const int64_t p = pos[r], lo = std::max<int64_t>(0, p - w + 1);
      sp.hi0 = clampc(std::min(S, lo) - j0);
      sp.lo1 = clampc(lo - j0);
      sp.hi1 = clampc(p + 1 - j0);
      if (!sp.empty()) r0 = std::min(r0, r), r1 = r + 1;
    }
    if (r0 < r1) qt.visit(keys.kt_tile(tt), keys.v_tile(tt), keys.hdp, r0, r1, spans, nullptr);
  }
};

// All key tiles of the window and sink part of one query tile, in increasing order.
void visit_window(QueryTile& qt, RowSpan* spans, const int32_t* pos, const bool* owner, int rows, const KeyTiles& keys,
                  int64_t w, int64_t S) {
  const WindowRows W(pos, owner, rows, w, S);
  for (int64_t tt = 0; tt < std::min(W.n_sink, W.b0); ++tt) W.visit_tile(qt, spans, keys, w, S, tt);
  for (int64_t tt = W.b0; tt <= W.b1; ++tt) W.visit_tile(qt, spans, keys, w, S, tt);
}

// Same-group part of a group query tile: row r sees in-group keys [first, cut[r]) except those
// whose tag equals the row's tag. Keys come from the packed group tiles starting at tile0.
void visit_group(QueryTile& qt, RowSpan* spans, const GroupTileRows& R, int64_t first, const KeyTiles& keys,
                 int64_t tile0, const int32_t* slot_tag) {
  int64_t cut_max = 0;
  for (int r = 0; r < R.rows; ++r) cut_max = std::max(cut_max, R.cut[r]);
  if (cut_max <= first) return;
  auto clampc = [](int64_t x) { return (int)std::clamp<int64_t>(x, 0, kBk); };
  for (int64_t lt = first / kBk; lt <= (cut_max - 1) / kBk; ++lt) {
    const int64_t b0 = lt * kBk;
    int r0 = R.rows;
    for (int r = R.rows - 1; r >= 0; --r) {  // cut grows with r: visible rows are a suffix
      RowSpan& sp = spans[r];
      sp = RowSpan{};
      sp.lo0 = clampc(first - b0);
      sp.hi0 = clampc(R.cut[r] - b0);
      sp.tag = R.tag[r];
      if (sp.lo0 < sp.hi0) r0 = r;
    }
    if (r0 < R.rows)
      qt.visit(keys.kt_tile(tile0 + lt), keys.v_tile(tile0 + lt), keys.hdp, r0, R.rows, spans,
               slot_tag ? slot_tag + (tile0 + lt) * kBk : nullptr);
  }
}

// Merges (a) and (b) into dst, row by row: dst may alias a. Pointers address head 0 of row 0;
// o rows are ostride apart (heads consecutive, head_dim each), lse is [heads][lse_n].
struct StateRef {
  float* o;
  int64_t ostride;
  float* lse;
  int64_t lse_n;
};
void merge_states(int64_t n, int64_t heads, int64_t hd, StateRef a, StateRef b, StateRef dst) {
#pragma omp for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t h = 0; h < heads; ++h) {
      const float la = a.lse[h * a.lse_n + i], lb = b.lse[h * b.lse_n + i];
      const float* oa = a.o + i * a.ostride + h * hd;
      const float* ob = b.o + i * b.ostride + h * hd;
      float* od = dst.o + i * dst.ostride + h * hd;
      const Partial parts[2] = {{la, 1.f, oa}, {lb, 1.f, ob}};  // od may be oa: partial 0
      const float l = merge_partials(2, hd, od, [&](int64_t c) { return parts[c]; });
      if (dst.lse) dst.lse[h * dst.lse_n + i] = l;
    }
  }
}

// Key tiles that query tile t of group g visits: the group's keys up to its last row, plus (fused)
// the window band of its rows.
int64_t tile_cost(const PackedGroups& P, int64_t g, int64_t t, int64_t local_window, bool with_window) {
  const auto seg = P.layout->group(g);
  const int64_t last = std::min<int64_t>(seg.size(), (t + 1) * kBq) - 1;
  int64_t cost = std::max<int64_t>(0, last - P.first[g]) / kBk + 1;
  if (with_window) cost += (seg[last] - seg[t * kBq] + local_window) / kBk + 1;
  return cost;
}
int64_t n_query_tiles(const GroupLayout& L, int64_t g) { return (L.size(g) + kBq - 1) / kBq; }

// Work item of a group pass: query tile t, for local head hl, of every group in [g0, g0 + batch)
// that has one. The group call takes one group per item. The fused pass takes kFusedBatch: tiles t
// of different groups cover about the same positions, so their window parts need the same key
// tiles, and the pass loads each of those once per item and visits it with every tile of the
// batch instead of once per group (the window band of one tile is larger than L2).
struct TileItem {
  int32_t g0, t, hl;
};
constexpr int kFusedBatch = 4;  // groups per fused item (measured best of 1, 2, 4, 8, 16 at 64K)

// The items of one kv head. Batches come one after another, the costliest first, each with its
// tiles from the last (most keys) to the first: threads that take neighbouring items stream the
// same groups' key tiles, which then stay in the shared cache, and the cheapest items come last,
// which evens out the finish.
std::vector<TileItem> tile_items(const PackedGroups& P, int64_t hpk, int64_t local_window, int batch,
                                 bool with_window) {
  const GroupLayout& L = *P.layout;
  std::vector<std::pair<int64_t, int64_t>> batch_cost;  // (total cost, first group)
  for (int64_t g0 = 0; g0 < L.n_groups; g0 += batch) {
    int64_t total = 0;
    for (int64_t g = g0; g < std::min(L.n_groups, g0 + batch); ++g)
      for (int64_t t = 0; t < n_query_tiles(L, g); ++t) total += tile_cost(P, g, t, local_window, with_window);
    if (total > 0) batch_cost.push_back({total, g0});
  }
  std::stable_sort(batch_cost.begin(), batch_cost.end(), [](const auto& x, const auto& y) { return x.first > y.first; });
  std::vector<TileItem> items;
  for (const auto& [cost, g0] : batch_cost) {
    int64_t nt = 0;
    for (int64_t g = g0; g < std::min(L.n_groups, g0 + batch); ++g) nt = std::max(nt, n_query_tiles(L, g));
    for (int64_t t = nt - 1; t >= 0; --t)
      for (int64_t hl = 0; hl < hpk; ++hl) items.push_back({(int32_t)g0, (int32_t)t, (int32_t)hl});
  }
  return items;
}

// Where the group pass writes row r of a group tile: the final output (topk 1) or one of two
// partial-state slots per token (topk 2), merged afterwards.
struct GroupSink {
  float* o;         // row = token
  int64_t ostride;  // between tokens
  float* lse;       // [local heads][n] (may be null when not needed)
  int64_t hoff;     // head offset into o (kv head's first query head, or 0 for slot buffers)
};

// Loads the query rows of a group tile for head h.
void load_rows(QueryTile& qt, const GroupTileRows& R, const float* q, const AttnShape& s, int64_t h) {
  const int64_t hd = s.head_dim;
  qt.reset(R.rows);
  for (int i = 0; i < R.rows; ++i) {
    if (i + kAhead < R.rows) prefetch_row<0>(q + (int64_t)R.token[i + kAhead] * s.q_stride + h * hd, hd);
    qt.load_row(i, q + (int64_t)R.token[i] * s.q_stride + h * hd, hd, s.scale);
  }
}

// Writes the rows of a finished group tile of local head hl: topk 1 -> sinks[0] (final); topk 2
// -> sinks[0] for the tiles of a token's first group, sinks[1] for its second.
void store_rows(const QueryTile& qt, const GroupTileRows& R, const GroupSink* sinks, const AttnShape& s,
                int64_t hl) {
  const int64_t hd = s.head_dim;
  for (int i = 0; i < R.rows; ++i) {
    const GroupSink& dst = sinks[R.owner[i] ? 0 : 1];
    if (i + kAhead < R.rows) {
      const GroupSink& nx = sinks[R.owner[i + kAhead] ? 0 : 1];
      prefetch_row<1>(nx.o + (int64_t)R.token[i + kAhead] * nx.ostride + (nx.hoff + hl) * hd, hd);
    }
    qt.store_row(i, dst.o + (int64_t)R.token[i] * dst.ostride + (dst.hoff + hl) * hd, hd,
                 dst.lse ? dst.lse + hl * s.n_q + R.token[i] : nullptr);
  }
}

// Runs the items of kv head kvh (inside a parallel region), `batch` groups per item. With okeys
// (the fused pass), first the window and sink part of all the item's tiles, key tile by key tile
// in increasing order; then the same-group part of each tile. Every row visits its key tiles in
// increasing order within each part, as a tile run alone would.
void run_tiles(const float* q, const AttnShape& s, const Routing& r, const PackedGroups& P, const KeyTiles& gkeys,
               const KeyTiles* okeys, const std::vector<TileItem>& items, int batch, int64_t kvh,
               const GroupSink* sinks) {
  const int64_t hpk = s.heads / s.kv_heads, G = P.layout->n_groups;
  std::vector<QueryTile> qts;
  qts.reserve(batch);
  for (int b = 0; b < batch; ++b) qts.emplace_back(gkeys.hdp);
  std::vector<GroupTileRows> R(batch);
  std::vector<WindowRows> W;
  W.reserve(batch);
  int64_t gb[kFusedBatch];  // callers pass batch 1 (group call) or kFusedBatch
  RowSpan spans[kBq];
  const int32_t* slot_tag = P.slot_tag.empty() ? nullptr : P.slot_tag.data();
#pragma omp for schedule(dynamic, 1)
  for (size_t it = 0; it < items.size(); ++it) {
    const int64_t t = items[it].t, hl = items[it].hl;
    int nb = 0;
    for (int64_t g = items[it].g0; g < std::min<int64_t>(G, items[it].g0 + batch); ++g)
      if (t < n_query_tiles(*P.layout, g)) gb[nb++] = g;
    W.clear();
    int64_t sink_hi = 0, band_lo = std::numeric_limits<int64_t>::max(), band_hi = -1;
    for (int b = 0; b < nb; ++b) {
      R[b].build(P, r, gb[b], t, s.local_window);
      load_rows(qts[b], R[b], q, s, kvh * hpk + hl);
      if (!okeys) continue;
      const WindowRows& w = W.emplace_back(R[b].token, R[b].owner, R[b].rows, s.local_window, s.sinks);
      if (w.b1 < w.b0) continue;
      sink_hi = std::max(sink_hi, w.n_sink);
      band_lo = std::min(band_lo, w.b0);
      band_hi = std::max(band_hi, w.b1);
    }
    for (int64_t tt = 0; tt <= std::max(sink_hi - 1, band_hi); ++tt) {
      if (tt >= sink_hi && tt < band_lo) tt = band_lo;
      for (int b = 0; b < nb; ++b)
        if (W[b].needs(tt)) W[b].visit_tile(qts[b], spans, *okeys, s.local_window, s.sinks, tt);
    }
    for (int b = 0; b < nb; ++b) {
      visit_group(qts[b], spans, R[b], P.first[gb[b]], gkeys, P.tile_off[gb[b]], slot_tag);
      store_rows(qts[b], R[b], sinks, s, hl);
    }
  }
}

// Partial states of one kv head's query heads for topk 2: slot 0 and slot 1 per token.
struct SlotBuffers {
  FloatBuffer o, lse;
  size_t bytes() const { return o.bytes() + lse.bytes(); }
  void release() {
    o.release();
    lse.release();
  }
  void resize(int64_t n, int64_t hpk, int64_t hd) {
    o.resize(2 * n * hpk * hd);
    lse.resize(2 * hpk * n);
  }
  GroupSink sink(int slot, int64_t n, int64_t hpk, int64_t hd) {
    return {o.data() + slot * n * hpk * hd, hpk * hd, lse.data() + slot * hpk * n, 0};
  }
  // Where kv head kvh's group results go: straight into (o, lse) for top-1, into the two slots
  // (merged afterwards by merge_slots) for top-2.
  void sinks_of(int64_t kvh, int topk, const AttnShape& s, float* o, float* lse, GroupSink* out) {
    const int64_t hpk = s.heads / s.kv_heads;
    if (topk == 1) {
      out[0] = {o, s.o_stride, lse ? lse + kvh * hpk * s.n_q : nullptr, kvh * hpk};
    } else {
      out[0] = sink(0, s.n_q, hpk, s.head_dim);
      out[1] = sink(1, s.n_q, hpk, s.head_dim);
    }
  }
};

// Merges the two slots of kv head kvh into the output (o, lse: full [n, heads, hd] / [heads, n]).
void merge_slots(SlotBuffers& B, const AttnShape& s, int64_t kvh, float* o, float* lse) {
  const int64_t n = s.n_q, hpk = s.heads / s.kv_heads, hd = s.head_dim;
  const StateRef a{B.o.data(), hpk * hd, B.lse.data(), n};
  const StateRef b{B.o.data() + n * hpk * hd, hpk * hd, B.lse.data() + hpk * n, n};
  const StateRef d{o + kvh * hpk * hd, s.o_stride, lse ? lse + kvh * hpk * n : nullptr, n};
  merge_states(n, hpk, hd, a, b, d);
}

// The calling thread's buffers of the kernels below. They only grow (thread_local, handed to the
// parallel team by reference), so that calls after the first (every layer of a forward pass)
// fault in no new pages; forward() trims them after each pass (focus_attention_trim_scratch).
struct Scratch {
  KeyTiles okeys, gkeys;  // tiles in original order (fused, window) and in packed group order
  SlotBuffers slots;      // top-2 partial states
  FloatBuffer lse1, o2, lse2;  // the two-call decomposition's second output
  size_t bytes() const { return okeys.bytes() + gkeys.bytes() + slots.bytes() + lse1.bytes() + o2.bytes() + lse2.bytes(); }
  void release() {
    okeys.release();
    gkeys.release();
    slots.release();
    lse1.release();
    o2.release();
    lse2.release();
  }
};
thread_local Scratch tl_scratch;

// Work-shared loops (inside a parallel region) filling the tiles of kv head kvh in original
// order and in packed group order; `nowait` skips the closing barrier.
void fill_original(KeyTiles& keys, const float* k, const float* v, const AttnShape& s, int64_t kvh, bool nowait) {
  auto token_of = [n = s.n_q](int64_t slot) { return slot < n ? slot : int64_t{-1}; };
  if (nowait) {
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < keys.n_tiles; ++t) keys.fill_tile(t, k, v, s, kvh, token_of);
  } else {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < keys.n_tiles; ++t) keys.fill_tile(t, k, v, s, kvh, token_of);
  }
}
void fill_packed(KeyTiles& keys, const PackedGroups& P, const float* k, const float* v, const AttnShape& s,
                 int64_t kvh) {
  const int32_t* tok = P.slot_token.data();
  auto token_of = [tok](int64_t slot) { return (int64_t)tok[slot]; };
#pragma omp for schedule(static)
  for (int64_t t = 0; t < keys.n_tiles; ++t) keys.fill_tile(t, k, v, s, kvh, token_of);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
int64_t focus_pair_count(const Routing& r, int64_t n, int64_t w, int64_t S) {
  check_routing(r, n);
  FOCUS_CHECK(w >= 1 && S >= 0, "focus_pair_count: need local_window >= 1 and sinks >= 0");
  // Window and sinks: min(i + 1, w) + min(S, max(0, i - w + 1)). Groups: keys S <= j <= i - w
  // sharing a group, counted with running per-group (and per-group-pair) counts.
  std::vector<int64_t> cnt(r.n_groups, 0);
  std::unordered_map<int64_t, int64_t> pair_cnt;
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    total += std::min(i + 1, w) + std::min(S, std::max<int64_t>(0, i - w + 1));
    const int64_t j = i - w;  // becomes a beyond-window key for rows >= i
    if (j >= S) {
      const int32_t* g = r.ids + j * r.topk;
      for (int t = 0; t < r.topk; ++t) ++cnt[g[t]];
      if (r.topk == 2) ++pair_cnt[(int64_t)g[0] * r.n_groups + g[1]];
    }
    const int32_t* g = r.ids + i * r.topk;
    if (r.topk == 1) {
      total += cnt[g[0]];
    } else {
      const auto f = pair_cnt.find((int64_t)g[0] * r.n_groups + g[1]);
      total += cnt[g[0]] + cnt[g[1]] - (f == pair_cnt.end() ? 0 : f->second);
    }
  }
  return total;
}

namespace {

// Visible keys of row i, increasing.
std::vector<int64_t> visible_keys(const AttnShape& s, const Routing& r, int64_t i) {
  std::vector<int64_t> keys;
  for (int64_t j = 0; j <= i; ++j)
    if (visible(s, r, i, j)) keys.push_back(j);
  return keys;
}

// Softmax attention of query (i, h) over the given keys in double; returns the lse.
float reference_row(const float* q, const float* k, const float* v, float* o, const AttnShape& s, int64_t i,
                    int64_t h, const std::vector<int64_t>& keys) {
  const int64_t hd = s.head_dim, kvh = h / (s.heads / s.kv_heads);
  const float* qr = q + i * s.q_stride + h * hd;
  std::vector<double> sc(keys.size()), acc(hd, 0.0);
  double mx = -INFINITY;
  for (size_t x = 0; x < keys.size(); ++x) {
    const float* kr = k + keys[x] * s.kv_stride + kvh * hd;
    double part[8] = {};  // eight running sums, so the loop vectorises
    for (int64_t y = 0; y < hd; ++y) part[y % 8] += (double)qr[y] * kr[y];
    double d = 0;
    for (double p : part) d += p;
    sc[x] = d * s.scale;
    mx = std::max(mx, sc[x]);
  }
  double sum = 0;
  for (size_t x = 0; x < keys.size(); ++x) {
    const double e = std::exp(sc[x] - mx);
    sum += e;
    const float* vr = v + keys[x] * s.kv_stride + kvh * hd;
    for (int64_t y = 0; y < hd; ++y) acc[y] += e * vr[y];
  }
  for (int64_t y = 0; y < hd; ++y) o[y] = (float)(acc[y] / sum);  // sum >= 1: key i is visible
  return (float)(mx + std::log(sum));
}

}  // namespace

float focus_attention_reference_row(const float* q, const float* k, const float* v, float* o,
                                    const AttnShape& s, const Routing& r, int64_t i, int64_t h) {
  return reference_row(q, k, v, o, s, i, h, visible_keys(s, r, i));
}

void focus_attention_reference(const float* q, const float* k, const float* v, float* o, float* lse,
                               const AttnShape& s, const Routing& r) {
  check_shape(s);
  check_routing(r, s.n_q);
#pragma omp parallel for schedule(dynamic, 16)
  for (int64_t i = 0; i < s.n_q; ++i) {
    const std::vector<int64_t> keys = visible_keys(s, r, i);
    for (int64_t h = 0; h < s.heads; ++h) {
      const float l = reference_row(q, k, v, o + i * s.o_stride + h * s.head_dim, s, i, h, keys);
      if (lse) lse[h * s.n_q + i] = l;
    }
  }
}

void merge_attention_states(float* o, float* lse, int64_t o_stride, const float* o2, const float* lse2,
                            int64_t o2_stride, int64_t n, int64_t heads, int64_t head_dim) {
  const StateRef a{o, o_stride, lse, n}, b{const_cast<float*>(o2), o2_stride, const_cast<float*>(lse2), n};
#pragma omp parallel
  merge_states(n, heads, head_dim, a, b, a);
}

void focus_attention_fused(const float* q, const float* k, const float* v, float* o, float* lse,
                           const AttnShape& s, const Routing& r) {
  check_shape(s);
  const GroupLayout L = build_group_layout(r, s.n_q);
  if (s.n_q == 0) return;
  const int64_t hd = s.head_dim, hdp = padded_dim(hd), hpk = s.heads / s.kv_heads;
  PackedGroups P;
  P.build(L, r, s.sinks);
  KeyTiles &okeys = tl_scratch.okeys, &gkeys = tl_scratch.gkeys;  // the calling thread's, shared by the team
  okeys.resize((s.n_q + kBk - 1) / kBk, hdp);
  gkeys.resize(P.n_tiles(), hdp);
  const std::vector<TileItem> items = tile_items(P, hpk, s.local_window, kFusedBatch, true);
  SlotBuffers& B = tl_scratch.slots;
  if (r.topk == 2) B.resize(s.n_q, hpk, hd);
  for (int64_t kvh = 0; kvh < s.kv_heads; ++kvh) {
    GroupSink sinks[2];
    B.sinks_of(kvh, r.topk, s, o, lse, sinks);
#pragma omp parallel
    {
      fill_original(okeys, k, v, s, kvh, /*nowait=*/true);
      fill_packed(gkeys, P, k, v, s, kvh);
      run_tiles(q, s, r, P, gkeys, &okeys, items, kFusedBatch, kvh, sinks);
      if (r.topk == 2) merge_slots(B, s, kvh, o, lse);
    }
  }
}

void focus_window_attention(const float* q, const float* k, const float* v, float* o, float* lse,
                            const AttnShape& s) {
  check_shape(s);
  if (s.n_q == 0) return;
  const int64_t hd = s.head_dim, hdp = padded_dim(hd), hpk = s.heads / s.kv_heads;
  const int64_t n_qt = (s.n_q + kBq - 1) / kBq;
  KeyTiles& keys = tl_scratch.okeys;
  keys.resize((s.n_q + kBk - 1) / kBk, hdp);
  for (int64_t kvh = 0; kvh < s.kv_heads; ++kvh) {
#pragma omp parallel
    {
      fill_original(keys, k, v, s, kvh, /*nowait=*/false);
      QueryTile qt(hdp);
      RowSpan spans[kBq];
      int32_t pos[kBq];
      bool owner[kBq];
      std::fill(owner, owner + kBq, true);
#pragma omp for collapse(2) schedule(dynamic, 1)
      for (int64_t qb = n_qt - 1; qb >= 0; --qb) {
        for (int64_t hl = 0; hl < hpk; ++hl) {
          const int64_t h = kvh * hpk + hl, t0 = qb * kBq;
          const int rows = (int)std::min<int64_t>(kBq, s.n_q - t0);
          qt.reset(rows);
          for (int i = 0; i < rows; ++i) {
            pos[i] = (int32_t)(t0 + i);
            if (i + kAhead < rows) prefetch_row<0>(q + (t0 + i + kAhead) * s.q_stride + h * hd, hd);
            qt.load_row(i, q + (t0 + i) * s.q_stride + h * hd, hd, s.scale);
          }
          visit_window(qt, spans, pos, owner, rows, keys, s.local_window, s.sinks);
          for (int i = 0; i < rows; ++i) {
            if (i + kAhead < rows) prefetch_row<1>(o + (t0 + i + kAhead) * s.o_stride + h * hd, hd);
            qt.store_row(i, o + (t0 + i) * s.o_stride + h * hd, hd, lse ? lse + h * s.n_q + t0 + i : nullptr);
          }
        }
      }
    }
  }
}

void focus_group_attention(const float* q, const float* k, const float* v, float* o, float* lse,
                           const AttnShape& s, const Routing& r) {
  check_shape(s);
  const GroupLayout L = build_group_layout(r, s.n_q);
  if (s.n_q == 0) return;
  const int64_t hd = s.head_dim, hdp = padded_dim(hd), hpk = s.heads / s.kv_heads;
  PackedGroups P;
  P.build(L, r, s.sinks);
  KeyTiles& gkeys = tl_scratch.gkeys;
  gkeys.resize(P.n_tiles(), hdp);
  const std::vector<TileItem> items = tile_items(P, hpk, s.local_window, 1, false);
  SlotBuffers& B = tl_scratch.slots;
  if (r.topk == 2) B.resize(s.n_q, hpk, hd);
  for (int64_t kvh = 0; kvh < s.kv_heads; ++kvh) {
    GroupSink sinks[2];
    B.sinks_of(kvh, r.topk, s, o, lse, sinks);
#pragma omp parallel
    {
      fill_packed(gkeys, P, k, v, s, kvh);
      run_tiles(q, s, r, P, gkeys, nullptr, items, 1, kvh, sinks);
      if (r.topk == 2) merge_slots(B, s, kvh, o, lse);
    }
  }
}

void focus_attention_two_call(const float* q, const float* k, const float* v, float* o, float* lse,
                              const AttnShape& s, const Routing& r) {
  check_shape(s);
  check_routing(r, s.n_q);
  if (s.n_q == 0) return;
  const int64_t row = s.heads * s.head_dim;
  FloatBuffer &lse1 = tl_scratch.lse1, &o2 = tl_scratch.o2, &lse2 = tl_scratch.lse2;
  lse1.resize(s.heads * s.n_q);
  o2.resize(s.n_q * row);
  lse2.resize(s.heads * s.n_q);
  focus_window_attention(q, k, v, o, lse1.data(), s);
  AttnShape s2 = s;
  s2.o_stride = row;
  focus_group_attention(q, k, v, o2.data(), lse2.data(), s2, r);
  merge_attention_states(o, lse1.data(), s.o_stride, o2.data(), lse2.data(), row, s.n_q, s.heads, s.head_dim);
  if (lse) std::copy(lse1.data(), lse1.data() + s.heads * s.n_q, lse);
}

size_t focus_attention_scratch_bytes() { return tl_scratch.bytes(); }

void focus_attention_trim_scratch(size_t max_bytes) {
  if (tl_scratch.bytes() > max_bytes) tl_scratch.release();
}

}  // namespace focus::cpu
