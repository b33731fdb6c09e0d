#include "kernels/cpu/attention.h"

#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/kv_simd.h"
#include "kernels/cpu/tile_engine.h"

namespace focus::cpu {
namespace {

using namespace tiles;

// First key position visible from query position p (the last one is p itself).
inline int64_t key_lo(int64_t p, int64_t sliding_window) {
  return sliding_window > 0 ? std::max<int64_t>(0, p - sliding_window + 1) : 0;
}

// ---------------------------------------------------------------------------------------------
// Key and value tiles. A key tile is stored transposed, kt [hdp][kBk]; a value tile as rows,
// v [kBk][hdp]. Slots past the last key and dimensions past head_dim are zero.

// kt[d][c] = k[c * stride + d] for c < cols, d < hd; zero elsewhere. kV x kV blocks at a time.
// E: the cached element type (float, Half, BHalf), widened to float here.
template <class E>
void pack_keys(const E* k, int64_t stride, int cols, int64_t hd, int64_t hdp, float* kt) {
  for (int c0 = 0; c0 < kBk; c0 += kV) {
    const int nc = std::clamp(cols - c0, 0, kV);
    for (int64_t d0 = 0; d0 < hdp; d0 += kV) {
      const int nd = (int)std::clamp<int64_t>(hd - d0, 0, kV);
      vf r[kV];
      if (nc == kV && nd == kV) {
        for (int i = 0; i < kV; ++i) r[i] = kv_load_vec(k + (c0 + i) * stride + d0);
      } else {
        for (int i = 0; i < kV; ++i) {
          r[i] = vf{};
          if (i < nc)
            for (int d = 0; d < nd; ++d) r[i][d] = kv_load(k + (c0 + i) * stride + d0 + d);
        }
      }
      transpose(r);
      for (int i = 0; i < kV; ++i) store(kt + (d0 + i) * kBk + c0, r[i]);
    }
  }
}

// vt[c][d] = v[c * stride + d] for c < cols, d < hd; zero elsewhere.
template <class E>
void pack_values(const E* v, int64_t stride, int cols, int64_t hd, int64_t hdp, float* vt) {
  for (int c = 0; c < kBk; ++c) {
    float* dst = vt + c * hdp;
    int64_t d = 0;
    if (c < cols) {
      const E* src = v + c * stride;
      for (; d + kV <= hd; d += kV) store(dst + d, kv_load_vec(src + d));
      for (; d < hd; ++d) dst[d] = kv_load(src + d);
    }
    std::fill(dst + d, dst + hdp, 0.f);
  }
}

// Query tile qb (rows qb * kBq ..) of heads h0 .. h0 + g - 1 (one kv head), with t[0 .. g - 1]:
// load, visit every key tile the rows see in increasing order, store. tile_of(tt) returns key
// tile tt (keys tt * kBk ..), called once per tile. The key tiles sit at fixed multiples of kBk
// and each (row, head) is computed the same way whatever else its tile holds, so a row's result
// does not depend on how rows are batched, nor on the heads per item or the threads.
struct TileRef {
  const float* kt;
  const float* v;
  int64_t ldv;
};
template <class TileOf>
void run_query_tile(QueryTile* t, int64_t g, const float* q, float* o, float* lse, const AttnShape& s, int64_t qb,
                    int64_t h0, TileOf&& tile_of) {
  const int64_t hd = s.head_dim, t0 = qb * kBq;
  const int rows = (int)std::min<int64_t>(kBq, s.n_q - t0);
  const int64_t p_first = s.q_pos0 + t0, p_last = p_first + rows - 1;
  for (int64_t x = 0; x < g; ++x) {
    t[x].reset(rows);
    for (int r = 0; r < rows; ++r) t[x].load_row(r, q + (t0 + r) * s.q_stride + (h0 + x) * hd, hd, s.scale);
  }
  const int64_t j_first = key_lo(p_first, s.sliding_window), j_last = std::min(p_last, s.n_kv - 1);
  RowSpan sp[kBq];  // one interval per row, both ends nondecreasing in the row
  for (int64_t tt = j_first / kBk; j_first <= j_last && tt <= j_last / kBk; ++tt) {
    const int64_t j0 = tt * kBk;
    int r0 = rows, r1 = 0;
    for (int r = 0; r < rows; ++r) {
      const int64_t p = p_first + r;
      sp[r].lo0 = (int)std::clamp<int64_t>(key_lo(p, s.sliding_window) - j0, 0, kBk);
      sp[r].hi0 = (int)std::clamp<int64_t>(std::min(p, s.n_kv - 1) + 1 - j0, 0, kBk);
      if (sp[r].lo0 < sp[r].hi0) r0 = std::min(r0, r), r1 = r + 1;
    }
    if (r0 >= r1) continue;
    const TileRef ref = tile_of(tt);
    // Always the exact exponential, so a row's bits do not depend on the rows it is blocked with.
    for (int64_t x = 0; x < g; ++x) t[x].visit<ExpMode::Exact>(ref.kt, ref.v, ref.ldv, r0, r1, sp, nullptr);
  }
  for (int64_t x = 0; x < g; ++x)
    for (int r = 0; r < rows; ++r) {
      const int64_t h = h0 + x;
      t[x].store_row(r, o + (t0 + r) * s.o_stride + h * hd, hd, lse ? lse + h * s.n_q + t0 + r : nullptr);
    }
}

// Prefill: many query tiles share every key tile. Each kv head's key tiles [tile0, tile0 +
// n_tiles) are packed once, into one buffer for as many kv heads as fit in kPackBudget floats
// (at least one), then every (query tile, head) of those kv heads is a work item, heaviest
// (latest) query tiles first. Buffers up to the budget are kept by the calling thread for its
// next call (no page faults again); larger ones are freed on return.
constexpr int64_t kPackBudget = int64_t{4} << 20;

template <class E>
void attention_packed(const float* q, const E* k, const E* v, float* o, float* lse, const AttnShape& s,
                      int64_t tile0, int64_t n_tiles) {
  const int64_t hd = s.head_dim, hdp = padded_dim(hd), hpk = s.heads / s.kv_heads;
  const int64_t n_qt = (s.n_q + kBq - 1) / kBq, tile_floats = hdp * kBk;
  const int64_t head_floats = 2 * n_tiles * tile_floats;  // keys, then values
  const int64_t chunk = std::clamp<int64_t>(kPackBudget / head_floats, 1, s.kv_heads);
  static thread_local FloatBuffer kept;
  FloatBuffer once;
  FloatBuffer& buf = chunk * head_floats <= kPackBudget ? kept : once;
  buf.resize(chunk * head_floats);
  float* packed = buf.data();
#pragma omp parallel
  {
    QueryTile t(hdp);
    for (int64_t kv0 = 0; kv0 < s.kv_heads; kv0 += chunk) {
      const int64_t nkv = std::min(chunk, s.kv_heads - kv0);
#pragma omp for schedule(static)
      for (int64_t i = 0; i < nkv * n_tiles; ++i) {
        const int64_t kvh = kv0 + i / n_tiles, j0 = (tile0 + i % n_tiles) * kBk;
        const int cols = (int)std::min<int64_t>(kBk, s.n_kv - j0);
        float* kt = packed + (i / n_tiles) * head_floats + (i % n_tiles) * tile_floats;
        pack_keys(k + j0 * s.kv_stride + kvh * hd, s.kv_stride, cols, hd, hdp, kt);
        pack_values(v + j0 * s.kv_stride + kvh * hd, s.kv_stride, cols, hd, hdp, kt + n_tiles * tile_floats);
      }
      const int64_t heads = nkv * hpk;  // query heads kv0 * hpk ..
#pragma omp for schedule(dynamic, 1)
      for (int64_t it = 0; it < n_qt * heads; ++it) {
        const int64_t h = kv0 * hpk + it % heads;
        const float* kt_head = packed + (h / hpk - kv0) * head_floats;
        auto tile_of = [&](int64_t tt) {
          const float* kt = kt_head + (tt - tile0) * tile_floats;
          return TileRef{kt, kt + n_tiles * tile_floats, hdp};
        };
        run_query_tile(&t, 1, q, o, lse, s, n_qt - 1 - it / heads, h, tile_of);
      }
    }
  }
}

// Decode and short chunks: few query rows per key tile. A work item is (query tile, g query
// heads of one kv head) and packs each key tile it visits into its own scratch, once for its g
// heads; g is the largest divisor of the group size that still leaves two items per thread.
// Values are read in place when their rows need no padding.
template <class E>
void attention_streamed(const float* q, const E* k, const E* v, float* o, float* lse, const AttnShape& s) {
  const int64_t hd = s.head_dim, hdp = padded_dim(hd), hpk = s.heads / s.kv_heads;
  const int64_t n_qt = (s.n_q + kBq - 1) / kBq, tile_floats = hdp * kBk;
  const int64_t want = 2 * omp_get_max_threads();
  int64_t g = hpk;
  while (g > 1 && (hpk % g != 0 || n_qt * s.kv_heads * (hpk / g) < want)) --g;
  const int64_t splits = hpk / g, items = n_qt * s.kv_heads * splits;
  const bool v_in_place = hd == hdp && std::is_same_v<E, float>;
#pragma omp parallel
  {
    std::vector<QueryTile> t(g, QueryTile(hdp));
    AlignedFloats kt(tile_floats), vt(v_in_place ? 0 : tile_floats);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t part = it % (s.kv_heads * splits), kvh = part / splits;
      auto tile_of = [&](int64_t tt) {
        const int64_t j0 = tt * kBk;
        const int cols = (int)std::min<int64_t>(kBk, s.n_kv - j0);
        const E* kr = k + j0 * s.kv_stride + kvh * hd;
        const E* vr = v + j0 * s.kv_stride + kvh * hd;
        pack_keys(kr, s.kv_stride, cols, hd, hdp, kt.data());
        if constexpr (std::is_same_v<E, float>)
          if (v_in_place) return TileRef{kt.data(), vr, s.kv_stride};
        pack_values(vr, s.kv_stride, cols, hd, hdp, vt.data());
        return TileRef{kt.data(), vt.data(), hdp};
      };
      run_query_tile(t.data(), g, q, o, lse, s, n_qt - 1 - it / (s.kv_heads * splits), part * g, tile_of);
    }
  }
}

}  // namespace

void flash_attention(const float* q, const float* k, const float* v, float* o, float* lse, const AttnShape& s) {
  flash_attention(q, KvView(k), KvView(v), o, lse, s);
}

void flash_attention(const float* q, KvView k, KvView v, float* o, float* lse, const AttnShape& s) {
  if (s.n_q <= 0) return;
  FOCUS_CHECK(k.type == v.type, "flash_attention: keys and values of different types");
  // Key tiles any row sees: from the first row's first key to the last row's last key.
  const int64_t j_first = key_lo(s.q_pos0, s.sliding_window), j_last = std::min(s.q_pos0 + s.n_q - 1, s.n_kv - 1);
  const int64_t tile0 = j_first / kBk, n_tiles = j_first <= j_last ? j_last / kBk - tile0 + 1 : 0;
  // Both paths give the same bits; packing once pays off from a few query tiles on.
  with_kv_type(k.type, [&](auto tag) {
    using E = decltype(tag);
    if (s.n_q > kBq && n_tiles > 0)
      attention_packed(q, k.as<E>(), v.as<E>(), o, lse, s, tile0, n_tiles);
    else
      attention_streamed(q, k.as<E>(), v.as<E>(), o, lse, s);
  });
}

void attention_reference(const float* q, const float* k, const float* v, float* o, float* lse, const AttnShape& s) {
  const int64_t hd = s.head_dim, group = s.heads / s.kv_heads;
  std::vector<double> sc(s.n_kv);
  for (int64_t t = 0; t < s.n_q; ++t) {
    const int64_t p = s.q_pos0 + t;
    for (int64_t h = 0; h < s.heads; ++h) {
      const float* qr = q + t * s.q_stride + h * hd;
      const int64_t kvh = h / group;
      double mx = -INFINITY;
      const int64_t lo = key_lo(p, s.sliding_window), hi = std::min<int64_t>(p, s.n_kv - 1);
      for (int64_t j = lo; j <= hi; ++j) {
        const float* kr = k + j * s.kv_stride + kvh * hd;
        double d = 0;
        for (int64_t i = 0; i < hd; ++i) d += (double)qr[i] * kr[i];
        sc[j] = d * s.scale;
        mx = std::max(mx, sc[j]);
      }
      double sum = 0;
      for (int64_t j = lo; j <= hi; ++j) sum += std::exp(sc[j] - mx);
      float* orow = o + t * s.o_stride + h * hd;
      for (int64_t i = 0; i < hd; ++i) {
        double acc = 0;
        for (int64_t j = lo; j <= hi; ++j) acc += std::exp(sc[j] - mx) * v[j * s.kv_stride + kvh * hd + i];
        orow[i] = lo <= hi ? (float)(acc / sum) : 0.f;
      }
      if (lse) lse[h * s.n_q + t] = lo <= hi ? (float)(mx + std::log(sum)) : -INFINITY;
    }
  }
}

}  // namespace focus::cpu
