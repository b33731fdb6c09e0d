#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace focus::cpu {
namespace {

constexpr int kBq = 64;   // query rows per tile
constexpr int kBk = 64;   // keys per tile
constexpr int kV = 16;    // floats per vector
typedef float v16 __attribute__((vector_size(64)));

inline v16 bcast(float x) { return v16{} + x; }
inline v16 load(const float* p) {
  v16 r;
  __builtin_memcpy(&r, p, sizeof(r));
  return r;
}
inline void store(float* p, v16 x) { __builtin_memcpy(p, &x, sizeof(x)); }

// First and last (inclusive) key positions visible from query position p.
inline int64_t key_lo(int64_t p, int64_t window) { return window > 0 ? std::max<int64_t>(0, p - window + 1) : 0; }

struct Scratch {
  std::vector<float> qt, kt, vt, ot, s;
  std::vector<float> m, l;
  void init(int64_t hdp) {
    qt.assign(kBq * hdp, 0.f);
    kt.assign(hdp * kBk, 0.f);
    vt.assign(kBk * hdp, 0.f);
    ot.assign(kBq * hdp, 0.f);
    s.assign(kBq * kBk, 0.f);
    m.assign(kBq, 0.f);
    l.assign(kBq, 0.f);
  }
};

// S[r, 0:64] = sum_d Q[r, d] * Kt[d, 0:64] for 4 rows at a time.
void tile_scores(const float* qt, const float* kt, float* s, int rows, int64_t hdp) {
  int r = 0;
  for (; r + 4 <= rows; r += 4) {
    v16 a[4][4] = {};
    for (int64_t d = 0; d < hdp; ++d) {
      const v16 k0 = load(kt + d * kBk), k1 = load(kt + d * kBk + 16), k2 = load(kt + d * kBk + 32),
                k3 = load(kt + d * kBk + 48);
      for (int i = 0; i < 4; ++i) {
        const v16 qv = bcast(qt[(r + i) * hdp + d]);
        a[i][0] += qv * k0;
        a[i][1] += qv * k1;
        a[i][2] += qv * k2;
        a[i][3] += qv * k3;
      }
    }
    for (int i = 0; i < 4; ++i)
      for (int c = 0; c < 4; ++c) store(s + (r + i) * kBk + c * kV, a[i][c]);
  }
  for (; r < rows; ++r) {
    v16 a[4] = {};
    for (int64_t d = 0; d < hdp; ++d) {
      const v16 qv = bcast(qt[r * hdp + d]);
      for (int c = 0; c < 4; ++c) a[c] += qv * load(kt + d * kBk + c * kV);
    }
    for (int c = 0; c < 4; ++c) store(s + r * kBk + c * kV, a[c]);
  }
}

// O[r, :] += sum_c P[r, c] * V[c, :] for 4 rows at a time, 64 output dims per pass.
void tile_pv(const float* p, const float* vt, float* ot, int rows, int cols, int64_t hdp) {
  for (int64_t d0 = 0; d0 < hdp; d0 += 64) {
    const int nd = (int)std::min<int64_t>(4, (hdp - d0) / kV);
    int r = 0;
    for (; r + 4 <= rows; r += 4) {
      v16 a[4][4];
      for (int i = 0; i < 4; ++i)
        for (int c = 0; c < nd; ++c) a[i][c] = load(ot + (r + i) * hdp + d0 + c * kV);
      for (int j = 0; j < cols; ++j) {
        v16 vv[4];
        for (int c = 0; c < nd; ++c) vv[c] = load(vt + j * hdp + d0 + c * kV);
        for (int i = 0; i < 4; ++i) {
          const v16 pv = bcast(p[(r + i) * kBk + j]);
          for (int c = 0; c < nd; ++c) a[i][c] += pv * vv[c];
        }
      }
      for (int i = 0; i < 4; ++i)
        for (int c = 0; c < nd; ++c) store(ot + (r + i) * hdp + d0 + c * kV, a[i][c]);
    }
    for (; r < rows; ++r) {
      v16 a[4];
      for (int c = 0; c < nd; ++c) a[c] = load(ot + r * hdp + d0 + c * kV);
      for (int j = 0; j < cols; ++j) {
        const v16 pv = bcast(p[r * kBk + j]);
        for (int c = 0; c < nd; ++c) a[c] += pv * load(vt + j * hdp + d0 + c * kV);
      }
      for (int c = 0; c < nd; ++c) store(ot + r * hdp + d0 + c * kV, a[c]);
    }
  }
}

}  // namespace

void flash_attention(const float* q, const float* k, const float* v, float* o, float* lse, const AttnShape& s) {
  const int64_t hd = s.head_dim, hdp = (hd + kV - 1) / kV * kV;
  const int64_t group = s.heads / s.kv_heads;
  const int64_t n_qb = (s.n_q + kBq - 1) / kBq;
  const float ninf = -std::numeric_limits<float>::infinity();

#pragma omp parallel
  {
    Scratch w;
    w.init(hdp);
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t qb = n_qb - 1; qb >= 0; --qb) {  // heavy (late) query tiles first
      for (int64_t h = 0; h < s.heads; ++h) {
        const int64_t kvh = h / group;
        const int64_t t0 = qb * kBq;
        const int rows = (int)std::min<int64_t>(kBq, s.n_q - t0);
        const int64_t p_first = s.q_pos0 + t0, p_last = p_first + rows - 1;
        // Load the query tile, pre-scaled, zero-padded to hdp.
        for (int r = 0; r < rows; ++r) {
          const float* src = q + (t0 + r) * s.q_stride + h * hd;
          float* dst = w.qt.data() + r * hdp;
          for (int64_t d = 0; d < hd; ++d) dst[d] = src[d] * s.scale;
        }
        std::fill(w.ot.begin(), w.ot.end(), 0.f);
        std::fill(w.m.begin(), w.m.end(), ninf);
        std::fill(w.l.begin(), w.l.end(), 0.f);

        const int64_t j_begin = key_lo(p_first, s.window);
        const int64_t j_end = std::min<int64_t>(p_last + 1, s.n_kv);  // exclusive
        for (int64_t j0 = j_begin; j0 < j_end; j0 += kBk) {
          const int cols = (int)std::min<int64_t>(kBk, j_end - j0);
          // K tile transposed to [hdp, kBk] and V tile [kBk, hdp]; padding stays zero.
          for (int c = 0; c < cols; ++c) {
            const float* kr = k + (j0 + c) * s.kv_stride + kvh * hd;
            const float* vr = v + (j0 + c) * s.kv_stride + kvh * hd;
            for (int64_t d = 0; d < hd; ++d) w.kt[d * kBk + c] = kr[d];
            std::copy(vr, vr + hd, w.vt.data() + c * hdp);
          }
          for (int c = cols; c < kBk; ++c)
            for (int64_t d = 0; d < hd; ++d) w.kt[d * kBk + c] = 0.f;
          tile_scores(w.qt.data(), w.kt.data(), w.s.data(), rows, hdp);
          // Mask only where the tile crosses the causal diagonal or the window edge.
          const bool full = (j0 + cols - 1 <= p_first) && (s.window == 0 || j0 >= p_last - s.window + 1);
          for (int r = 0; r < rows; ++r) {
            float* sr = w.s.data() + r * kBk;
            const int64_t p = p_first + r;
            int c_lo = 0, c_hi = cols;  // visible columns [c_lo, c_hi)
            if (!full) {
              c_hi = (int)std::clamp<int64_t>(p - j0 + 1, 0, cols);
              c_lo = (int)std::clamp<int64_t>(key_lo(p, s.window) - j0, 0, cols);
            }
            if (c_lo >= c_hi) {
              std::fill(sr, sr + kBk, 0.f);
              continue;
            }
            float mx = w.m[r];
            for (int c = c_lo; c < c_hi; ++c) mx = std::max(mx, sr[c]);
            const float alpha = std::exp(w.m[r] - mx);  // exp(-inf) = 0 on the first visit
            float sum = 0.f;
            for (int c = 0; c < c_lo; ++c) sr[c] = 0.f;
            for (int c = c_lo; c < c_hi; ++c) {
              const float e = std::exp(sr[c] - mx);
              sr[c] = e;
              sum += e;
            }
            for (int c = c_hi; c < kBk; ++c) sr[c] = 0.f;
            w.l[r] = w.l[r] * alpha + sum;
            w.m[r] = mx;
            if (alpha != 1.f) {
              float* orow = w.ot.data() + r * hdp;
              for (int64_t d = 0; d < hdp; ++d) orow[d] *= alpha;
            }
          }
          tile_pv(w.s.data(), w.vt.data(), w.ot.data(), rows, cols, hdp);
        }
        for (int r = 0; r < rows; ++r) {
          float* dst = o + (t0 + r) * s.o_stride + h * hd;
          const float* src = w.ot.data() + r * hdp;
          const float inv = w.l[r] > 0.f ? 1.f / w.l[r] : 0.f;
          for (int64_t d = 0; d < hd; ++d) dst[d] = src[d] * inv;
          if (lse) lse[h * s.n_q + t0 + r] = w.l[r] > 0.f ? w.m[r] + std::log(w.l[r]) : ninf;
        }
      }
    }
  }
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
      const int64_t lo = key_lo(p, s.window), hi = std::min<int64_t>(p, s.n_kv - 1);
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
