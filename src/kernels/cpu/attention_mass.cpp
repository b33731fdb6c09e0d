#include "kernels/cpu/attention_mass.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/simd.h"
#include "kernels/cpu/tile_engine.h"

namespace focus::cpu {
namespace {

using namespace tiles;

// The backward swaps the roles of the two tile kinds (key rows against transposed query tiles),
// so both must have the same size.
static_assert(kBq == kBk, "query and key tiles must be the same size");
constexpr int kB = kBk;

struct Dims {
  int64_t n, H, KVH, gs, hd, hdp, qs, ks, C, Cp, nb, npad;
  int64_t R;    // output rows per token: 1 (Mean) or KVH
  int64_t hpr;  // heads averaged into one output row: output row r holds heads [r * hpr, (r + 1) * hpr)
  float inv;    // 1 / hpr
};

inline int tile_len(int64_t n, int64_t b) { return (int)std::min<int64_t>(kB, n - b * kB); }

Dims make_dims(const AttnShape& s, int64_t C, MassHeads heads) {
  Dims d;
  d.n = s.n_q;
  d.H = s.heads;
  d.KVH = s.kv_heads;
  d.gs = s.heads / s.kv_heads;
  d.hd = s.head_dim;
  d.hdp = padded_dim(s.head_dim);
  d.qs = s.q_stride ? s.q_stride : s.heads * s.head_dim;
  d.ks = s.kv_stride ? s.kv_stride : s.kv_heads * s.head_dim;
  d.C = C;
  d.Cp = round_up(std::max<int64_t>(C, 1));
  d.nb = (d.n + kB - 1) / kB;
  d.npad = d.nb * kB;
  d.R = heads == MassHeads::Mean ? 1 : d.KVH;
  d.hpr = d.H / d.R;
  d.inv = 1.f / (float)d.hpr;
  return d;
}

void check(const char* who, const AttnShape& s, const float* q, const float* k, const float* lse) {
  FOCUS_CHECK(s.n_q >= 0, who, ": negative token count ", s.n_q);
  FOCUS_CHECK(s.n_kv == s.n_q && s.q_pos0 == 0, who, ": self-attention needs n_kv == n_q (", s.n_kv, " vs ", s.n_q,
              ") and q_pos0 == 0 (got ", s.q_pos0, ")");
  FOCUS_CHECK(s.heads >= 1 && s.kv_heads >= 1 && s.heads % s.kv_heads == 0, who, ": heads (", s.heads,
              ") must be a positive multiple of kv_heads (", s.kv_heads, ")");
  FOCUS_CHECK(s.head_dim >= 1, who, ": head_dim must be >= 1, got ", s.head_dim);
  FOCUS_CHECK((s.q_stride == 0 || s.q_stride >= s.heads * s.head_dim) &&
                  (s.kv_stride == 0 || s.kv_stride >= s.kv_heads * s.head_dim),
              who, ": row strides must be 0 (contiguous) or at least the row width");
  FOCUS_CHECK(s.sliding_window == 0, who, ": sliding-window layers are not supported (sliding_window ",
              s.sliding_window, ")");
  FOCUS_CHECK(s.local_window >= 1 && s.sinks >= 0, who, ": needs local_window >= 1 and sinks >= 0 (got ",
              s.local_window, ", ", s.sinks, ")");
  FOCUS_CHECK(std::isfinite(s.scale), who, ": scale must be finite");
  if (s.n_q == 0) return;
  FOCUS_CHECK(q && k && lse, who, ": null q, k or lse");
  // Every row sees its own key, so a valid lse is finite; -inf or NaN would turn masked-out
  // probabilities into NaN or inf.
  for (int64_t x = 0; x < s.heads * s.n_q; ++x)
    FOCUS_CHECK(std::isfinite(lse[x]), who, ": lse[", x / s.n_q, ", ", x % s.n_q, "] = ", lse[x], " is not finite");
}

void check_exclusion(const char* who, const AttnShape& s, const MassExclusion* ex, bool backward) {
  if (!ex || s.n_q == 0) return;
  static_assert(kB == 64, "one exclusion word per tile");
  FOCUS_CHECK(ex->words == (s.n_q + 63) / 64, who, ": exclusion of ", ex->words, " words per row, ", s.n_q,
              " tokens need ", (s.n_q + 63) / 64);
  FOCUS_CHECK(backward ? ex->by_key != nullptr : ex->by_row != nullptr, who, ": exclusion without its ",
              backward ? "by_key" : "by_row", " bits");
}

// Zeroes the lanes of e whose bit (from bit 0 of bits, lane order) is set.
inline void clear_lanes(vf& e, uint64_t bits) {
  for (int l = 0; l < kV; ++l)
    if ((bits >> l) & 1) e[l] = 0.f;
}

// ---- packing (zero padding past n and past head_dim).
// src rows `stride` apart, `heads` blocks of hd floats -> [nb][heads][kB][hdp], times scale.
void pack_rows(const float* src, int64_t stride, const Dims& d, int64_t heads, float scale, float* dst) {
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < d.nb * heads; ++bh) {
    const int64_t b = bh / heads, h = bh % heads;
    const int rows = tile_len(d.n, b);
    float* t = dst + bh * kB * d.hdp;
    std::fill(t, t + kB * d.hdp, 0.f);
    for (int r = 0; r < rows; ++r) {
      const float* x = src + (b * kB + r) * stride + h * d.hd;
      for (int64_t e = 0; e < d.hd; ++e) t[r * d.hdp + e] = x[e] * scale;
    }
  }
}

// The same, transposed: [nb][heads][hdp][kB] (what tile_scores takes as its second operand).
void pack_cols(const float* src, int64_t stride, const Dims& d, int64_t heads, float scale, float* dst) {
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < d.nb * heads; ++bh) {
    const int64_t b = bh / heads, h = bh % heads;
    const int cols = tile_len(d.n, b);
    float* t = dst + bh * d.hdp * kB;
    std::fill(t, t + d.hdp * kB, 0.f);
    for (int c = 0; c < cols; ++c) {
      const float* x = src + (b * kB + c) * stride + h * d.hd;
      for (int64_t e = 0; e < d.hd; ++e) t[e * kB + c] = x[e] * scale;
    }
  }
}

// src [n, R, C] -> [R][npad][Cp]: the rows of one output row r are contiguous and whole vectors,
// as tile_pv reads them.
void pack_groups(const float* src, const Dims& d, int64_t R, float* dst) {
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < d.nb; ++b)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t i = b * kB; i < (b + 1) * kB; ++i) {
        float* t = dst + (r * d.npad + i) * d.Cp;
        const int64_t c = i < d.n ? d.C : 0;
        for (int64_t g = 0; g < c; ++g) t[g] = src[(i * R + r) * d.C + g];
        std::fill(t + c, t + d.Cp, 0.f);
      }
}

}  // namespace

// Forward. A query tile visits the key tiles that hold a far pair of any of its rows: keys
// [S, last], last = (last row of the tile) - w. Row r of a tile at t0 sees the tile-local columns
// [lo, hi_r) with lo = S - j0 and hi_r = t0 + r - w - j0 + 1 (both clamped to the tile); hi_r
// grows with r, so the tile needs no mask when its first row already sees every column.
void attention_mass_forward(const float* q, const float* k, const float* lse, const float* X, int64_t C,
                            const AttnShape& s, MassHeads heads, float* M, float* far, const MassExclusion* ex) {
  check("attention_mass_forward", s, q, k, lse);
  check_exclusion("attention_mass_forward", s, ex, false);
  FOCUS_CHECK(!M || (X && C >= 1), "attention_mass_forward: M needs X and C >= 1 (C = ", C, ")");
  if (s.n_q == 0 || (!M && !far)) return;
  const Dims d = make_dims(s, M ? C : 1, heads);
  const int64_t hdp = d.hdp, Cp = d.Cp, R = d.R, w = s.local_window, S = s.sinks;

  std::vector<float> qp(d.nb * d.H * kB * hdp), ktp(d.nb * d.KVH * hdp * kB), xp(M ? d.npad * Cp : 0);
  pack_rows(q, d.qs, d, d.H, s.scale, qp.data());
  pack_cols(k, d.ks, d, d.KVH, 1.f, ktp.data());
  if (M) pack_groups(X, d, 1, xp.data());

#pragma omp parallel
  {
    AlignedFloats sc(kB * kB), ps(kB * kB), macc(R * kB * Cp), facc(R * kB * kV);
    int hi[kB];
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < d.nb; ++it) {
      const int64_t qb = d.nb - 1 - it;  // heavy (late) query tiles first
      const int64_t t0 = qb * kB;
      const int nr = tile_len(d.n, qb);
      const int64_t last = t0 + nr - 1 - w;
      std::fill(macc.begin(), macc.end(), 0.f);
      std::fill(facc.begin(), facc.end(), 0.f);
      for (int64_t kb = S / kB; last >= S && kb <= last / kB; ++kb) {
        const int64_t j0 = kb * kB;
        const int cols = tile_len(d.n, kb);
        const int lo = (int)std::clamp<int64_t>(S - j0, 0, cols);
        for (int r = 0; r < nr; ++r) hi[r] = (int)std::clamp<int64_t>(t0 + r - w - j0 + 1, 0, cols);
        const int chi = hi[nr - 1];
        if (chi <= lo) continue;
        const bool full = lo == 0 && hi[0] == kB;
        const int cv0 = lo / kV, cv1 = (chi + kV - 1) / kV;
        for (int64_t ro = 0; ro < R; ++ro) {
          // ps = mean over the heads of output row ro of the far probabilities.
          for (int64_t h = ro * d.hpr; h < (ro + 1) * d.hpr; ++h) {
            const float* kt = ktp.data() + (kb * d.KVH + h / d.gs) * hdp * kB;
            tile_scores(qp.data() + (qb * d.H + h) * kB * hdp, hdp, nr, kt + cv0 * kV, sc.data() + cv0 * kV,
                        cv1 - cv0);
            const bool first = h == ro * d.hpr;
            for (int r = 0; r < nr; ++r) {
              const vf l = bcast(lse[h * d.n + t0 + r]);
              float* sr = sc.data() + r * kB;
              float* pr = ps.data() + r * kB;
              const uint64_t out = ex ? ex->by_row[(h * d.n + t0 + r) * ex->words + kb] : 0;
              for (int c = cv0; c < cv1; ++c) {
                vf e = vexp(load(sr + c * kV) - l);
                if (!full) {
                  const vi col = iota + c * kV;
                  e = select((col >= lo) & (col < hi[r]), e, vf{});
                }
                if (out) clear_lanes(e, out >> (c * kV));
                store(pr + c * kV, first ? e : load(pr + c * kV) + e);
              }
            }
          }
          for (int r = 0; r < nr; ++r) {
            float* pr = ps.data() + r * kB;
            vf f = load(facc.data() + (ro * kB + r) * kV);
            for (int c = cv0; c < cv1; ++c) {
              const vf x = load(pr + c * kV) * d.inv;
              store(pr + c * kV, x);
              f += x;
            }
            store(facc.data() + (ro * kB + r) * kV, f);
          }
          if (M) tile_pv(ps.data() + lo, xp.data() + (j0 + lo) * Cp, Cp, nr, chi - lo, macc.data() + ro * kB * Cp, Cp);
        }
      }
      for (int r = 0; r < nr; ++r)
        for (int64_t ro = 0; ro < R; ++ro) {
          const int64_t row = (t0 + r) * R + ro;
          if (M) std::copy_n(macc.data() + (ro * kB + r) * Cp, d.C, M + row * d.C);
          if (far) far[row] = hsum(load(facc.data() + (ro * kB + r) * kV));
        }
    }
  }
}

// Backward. The same probabilities, computed transposed: a key tile's rows (keys j) against the
// transposed query tiles, so the product with dM is again a tile_pv and each key tile owns its
// rows of dX. Key row c (j = j0 + c >= S) sees the tile-local query columns [lo_c, nr) with
// lo_c = j + w - t0 (clamped); lo_c grows with c, so the rows with any far pair are [c0, c1).
void attention_mass_backward(const float* q, const float* k, const float* lse, const float* dM, int64_t C,
                             const AttnShape& s, MassHeads heads, float* dX, const MassExclusion* ex) {
  check("attention_mass_backward", s, q, k, lse);
  check_exclusion("attention_mass_backward", s, ex, true);
  if (s.n_q == 0) return;
  FOCUS_CHECK(dM && dX && C >= 1, "attention_mass_backward: needs dM, dX and C >= 1 (C = ", C, ")");
  const Dims d = make_dims(s, C, heads);
  const int64_t hdp = d.hdp, Cp = d.Cp, R = d.R, w = s.local_window, S = s.sinks;

  std::vector<float> qtp(d.nb * d.H * hdp * kB), kp(d.nb * d.KVH * kB * hdp), dmp(R * d.npad * Cp);
  std::vector<float> lsep(d.H * d.npad, 0.f);  // padding 0: finite, and masked out anyway
  pack_cols(q, d.qs, d, d.H, s.scale, qtp.data());
  pack_rows(k, d.ks, d, d.KVH, 1.f, kp.data());
  pack_groups(dM, d, R, dmp.data());
  for (int64_t h = 0; h < d.H; ++h) std::copy_n(lse + h * d.n, d.n, lsep.data() + h * d.npad);

#pragma omp parallel
  {
    AlignedFloats sc(kB * kB), ps(kB * kB), dacc(kB * Cp);
    int lo[kB];
#pragma omp for schedule(dynamic, 1)
    for (int64_t kb = 0; kb < d.nb; ++kb) {  // heavy (early) key tiles first
      const int64_t j0 = kb * kB;
      const int cols = tile_len(d.n, kb);
      const int c0 = (int)std::clamp<int64_t>(S - j0, 0, cols);
      if (c0 >= cols || j0 + c0 + w >= d.n) continue;
      std::fill(dacc.begin(), dacc.end(), 0.f);
      for (int64_t qb = (j0 + c0 + w) / kB; qb < d.nb; ++qb) {
        const int64_t t0 = qb * kB;
        const int nr = tile_len(d.n, qb);
        const int c1 = (int)std::clamp<int64_t>(t0 + nr - w - j0, 0, cols);
        if (c1 <= c0) continue;
        for (int c = c0; c < c1; ++c) lo[c] = (int)std::clamp<int64_t>(j0 + c + w - t0, 0, nr);
        const bool full = lo[c1 - 1] == 0 && nr == kB;
        const int cv0 = lo[c0] / kV, cv1 = (nr + kV - 1) / kV;
        for (int64_t ro = 0; ro < R; ++ro) {
          for (int64_t h = ro * d.hpr; h < (ro + 1) * d.hpr; ++h) {
            const float* krows = kp.data() + ((kb * d.KVH + h / d.gs) * kB + c0) * hdp;
            const float* qt = qtp.data() + (qb * d.H + h) * hdp * kB;
            tile_scores(krows, hdp, c1 - c0, qt + cv0 * kV, sc.data() + c0 * kB + cv0 * kV, cv1 - cv0);
            const bool first = h == ro * d.hpr;
            const float* lh = lsep.data() + h * d.npad + t0;
            for (int c = c0; c < c1; ++c) {
              float* sr = sc.data() + c * kB;
              float* pr = ps.data() + c * kB;
              const uint64_t out = ex ? ex->by_key[(h * d.n + j0 + c) * ex->words + qb] : 0;
              for (int v = cv0; v < cv1; ++v) {
                vf e = vexp(load(sr + v * kV) - load(lh + v * kV));
                if (!full) {
                  const vi row = iota + v * kV;
                  e = select((row >= lo[c]) & (row < nr), e, vf{});
                }
                if (out) clear_lanes(e, out >> (v * kV));
                store(pr + v * kV, first ? e : load(pr + v * kV) + e);
              }
            }
          }
          for (int c = c0; c < c1; ++c)
            for (int v = cv0; v < cv1; ++v) store(ps.data() + c * kB + v * kV, load(ps.data() + c * kB + v * kV) * d.inv);
          const int clo = lo[c0];
          tile_pv(ps.data() + c0 * kB + clo, dmp.data() + (ro * d.npad + t0 + clo) * Cp, Cp, c1 - c0, nr - clo,
                  dacc.data() + c0 * Cp, Cp);
        }
      }
      for (int c = c0; c < cols; ++c)  // this key tile's rows are ours alone
        for (int64_t g = 0; g < d.C; ++g) dX[(j0 + c) * d.C + g] += dacc[c * Cp + g];
    }
  }
}

}  // namespace focus::cpu
