// Vectorised building blocks of flash-style attention on the CPU: a tile of up to kBq queries
// visits tiles of kBk keys, keeping an online softmax (running max m, running sum l, unnormalised
// output o) per query row. 16-float vectors via GCC vector extensions (one AVX-512 register, or two AVX2 registers).
//
// Layouts inside a tile (hdp = head_dim rounded up to 16, padding zero):
//   q  [kBq][hdp]   queries, already multiplied by the softmax scale
//   kt [hdp][kBk]   keys transposed, so a row of kt holds one dimension of kBk keys
//   v  [kBk][ldv]   values, ldv >= hdp
//   s  [kBq][kBk]   scores, then probabilities
//   o  [kBq][hdp]   unnormalised output
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <vector>

namespace focus::cpu::tiles {

constexpr int kV = 16;    // floats per vector
constexpr int kBq = 64;   // query rows per tile
constexpr int kBk = 64;   // keys per tile
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));

// 64-byte aligned storage: a vector load that straddles two cache lines costs twice as much.
template <class T>
struct AlignedAllocator {
  using value_type = T;
  AlignedAllocator() = default;
  template <class U>
  AlignedAllocator(const AlignedAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <class U>
  bool operator==(const AlignedAllocator<U>&) const { return true; }
};
using AlignedFloats = std::vector<float, AlignedAllocator<float>>;

inline int64_t padded_dim(int64_t hd) { return (hd + kV - 1) / kV * kV; }

inline v16 bcast(float x) { return v16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
inline v16 load(const float* p) {
  v16 r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
inline void store(float* p, v16 x) { std::memcpy(p, &x, sizeof(x)); }
// A load kept in a register: stops the compiler from folding it into every FMA that uses it,
// which would turn one load per micro-kernel step into one per row.
inline v16 load_reg(const float* p) {
#if defined(__x86_64__) && defined(__AVX512F__)
  v16 r = load(p);
  asm("" : "+v"(r));
  return r;
#elif defined(__x86_64__) && defined(__AVX__)
  // Without AVX-512 a 16-float vector is two 8-float registers: pin each half.
  typedef float v8 __attribute__((vector_size(32)));
  v8 lo, hi;
  std::memcpy(&lo, p, sizeof(lo));
  std::memcpy(&hi, p + 8, sizeof(hi));
  asm("" : "+x"(lo), "+x"(hi));
  v16 r;
  std::memcpy(&r, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&r) + sizeof(lo), &hi, sizeof(hi));
  return r;
#else
  return load(p);
#endif
}
inline v16 vmax(v16 a, v16 b) { return a > b ? a : b; }
inline v16 select(vi16 mask, v16 a, v16 b) { return (v16)((mask & (vi16)a) | (~mask & (vi16)b)); }

inline float hmax(v16 x) {
  x = vmax(x, __builtin_shuffle(x, vi16{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
  x = vmax(x, __builtin_shuffle(x, vi16{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));
  x = vmax(x, __builtin_shuffle(x, vi16{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));
  x = vmax(x, __builtin_shuffle(x, vi16{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}));
  return x[0];
}
inline float hsum(v16 x) {
  x += __builtin_shuffle(x, vi16{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  x += __builtin_shuffle(x, vi16{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  x += __builtin_shuffle(x, vi16{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  x += __builtin_shuffle(x, vi16{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
  return x[0];
}

// e^x for x <= 0 as 2^n 2^f: n = round(x log2 e), f in [-1/2, 1/2], 2^f by a degree-5 minimax
// polynomial (relative error about 2e-7). Inputs below -87 give e^-87 (about 1e-38), not 0.
inline v16 vexp_clamped(v16 x) {
  const v16 magic = bcast(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  const v16 t = vmax(x, bcast(-87.f)) * 1.44269504088896341f;
  const v16 tn = t + magic;
  const v16 f = t - (tn - magic);
  v16 p = bcast(1.3264722656e-3f);
  p = p * f + 9.6715129912e-3f;
  p = p * f + 5.5507335812e-2f;
  p = p * f + 2.4022242427e-1f;
  p = p * f + 6.9314700365e-1f;
  p = p * f + 1.f;
  const vi16 e = ((vi16)tn - ((vi16)magic - 127)) << 23;  // 2^n in the exponent field
  return p * (v16)e;
}
// The same, but exactly 0 below -87 (and for -inf, the masked scores).
inline v16 vexp(v16 x) { return select(x >= -87.f, vexp_clamped(x), v16{}); }

// S[i, c] = sum_d Q[i, d] Kt[d, c] for R rows and NV column vectors.
template <int R, int NV>
inline void scores_block(const float* q, int64_t hdp, const float* kt, float* s) {
  v16 a[R][NV] = {};
  for (int64_t d = 0; d < hdp; ++d) {
    v16 kv[NV];
    for (int c = 0; c < NV; ++c) kv[c] = load_reg(kt + d * kBk + c * kV);
    for (int i = 0; i < R; ++i) {
      const v16 qv = bcast(q[i * hdp + d]);
      for (int c = 0; c < NV; ++c) a[i][c] += qv * kv[c];
    }
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < NV; ++c) store(s + i * kBk + c * kV, a[i][c]);
}

template <int NV>
inline void scores_rows(const float* q, int64_t hdp, int rows, const float* kt, float* s) {
  int r = 0;
  for (; r + 4 <= rows; r += 4) scores_block<4, NV>(q + r * hdp, hdp, kt, s + r * kBk);
  switch (rows - r) {
    case 3: scores_block<3, NV>(q + r * hdp, hdp, kt, s + r * kBk); break;
    case 2: scores_block<2, NV>(q + r * hdp, hdp, kt, s + r * kBk); break;
    case 1: scores_block<1, NV>(q + r * hdp, hdp, kt, s + r * kBk); break;
    default: break;
  }
}

// Scores of `rows` query rows against nv (1..4) column vectors; kt and s point at the first
// column vector wanted (row strides stay kBk).
inline void tile_scores(const float* q, int64_t hdp, int rows, const float* kt, float* s, int nv) {
  switch (nv) {
    case 1: scores_rows<1>(q, hdp, rows, kt, s); break;
    case 2: scores_rows<2>(q, hdp, rows, kt, s); break;
    case 3: scores_rows<3>(q, hdp, rows, kt, s); break;
    default: scores_rows<4>(q, hdp, rows, kt, s); break;
  }
}

// O[i, 0:16 ND] += sum_{c < cols} P[i, c] V[c, 0:16 ND] for R rows.
template <int R, int ND>
inline void pv_block(const float* p, const float* v, int64_t ldv, int cols, float* o, int64_t hdp) {
  v16 a[R][ND];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < ND; ++c) a[i][c] = load(o + i * hdp + c * kV);
  for (int j = 0; j < cols; ++j) {
    v16 vv[ND];
    for (int c = 0; c < ND; ++c) vv[c] = load_reg(v + j * ldv + c * kV);
    for (int i = 0; i < R; ++i) {
      const v16 pv = bcast(p[i * kBk + j]);
      for (int c = 0; c < ND; ++c) a[i][c] += pv * vv[c];
    }
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < ND; ++c) store(o + i * hdp + c * kV, a[i][c]);
}

template <int ND>
inline void pv_rows(const float* p, const float* v, int64_t ldv, int rows, int cols, float* o, int64_t hdp) {
  int r = 0;
  for (; r + 4 <= rows; r += 4) pv_block<4, ND>(p + r * kBk, v, ldv, cols, o + r * hdp, hdp);
  switch (rows - r) {
    case 3: pv_block<3, ND>(p + r * kBk, v, ldv, cols, o + r * hdp, hdp); break;
    case 2: pv_block<2, ND>(p + r * kBk, v, ldv, cols, o + r * hdp, hdp); break;
    case 1: pv_block<1, ND>(p + r * kBk, v, ldv, cols, o + r * hdp, hdp); break;
    default: break;
  }
}

// O[r, :] += P[r, 0:cols] V[0:cols, :] for `rows` rows; p points at column 0 of row 0.
inline void tile_pv(const float* p, const float* v, int64_t ldv, int rows, int cols, float* o, int64_t hdp) {
  for (int64_t d0 = 0; d0 < hdp; d0 += 4 * kV) {
    switch ((int)std::min<int64_t>(4, (hdp - d0) / kV)) {
      case 1: pv_rows<1>(p, v + d0, ldv, rows, cols, o + d0, hdp); break;
      case 2: pv_rows<2>(p, v + d0, ldv, rows, cols, o + d0, hdp); break;
      case 3: pv_rows<3>(p, v + d0, ldv, rows, cols, o + d0, hdp); break;
      default: pv_rows<4>(p, v + d0, ldv, rows, cols, o + d0, hdp); break;
    }
  }
}

// The columns of one key tile that one query row sees: [lo0, hi0) u [lo1, hi1), tile-local,
// minus the columns whose key tag equals `tag` (when the tile has tags; tag -1 excludes none).
struct RowSpan {
  int lo0 = 0, hi0 = 0, lo1 = 0, hi1 = 0;
  int32_t tag = -1;
  bool empty() const { return lo0 >= hi0 && lo1 >= hi1; }
  // Whether every column in [c0, c1) is inside the intervals (tags aside); interval 0 lies
  // before interval 1.
  bool covers(int c0, int c1) const {
    const bool in0 = lo0 <= c0 && hi0 >= c1, in1 = lo1 <= c0 && hi1 >= c1;
    return in0 || in1 || (lo0 < hi0 && lo0 <= c0 && hi0 >= lo1 && hi1 >= c1);
  }
};

// Online-softmax state of one query tile, with its scratch.
struct QueryTile {
  int64_t hdp = 0;
  AlignedFloats q, o, s;
  AlignedFloats l;       // [kBq][kV] running sums, kept per lane (reduced once, at the end)
  std::vector<float> m;  // [kBq] running maxima
  explicit QueryTile(int64_t hdp_)
      : hdp(hdp_), q(kBq * hdp_), o(kBq * hdp_), s(kBq * kBk), l(kBq * kV), m(kBq) {}
  // Starts a tile of n rows: empty softmax state (q must be loaded separately).
  void reset(int n) {
    std::fill(o.begin(), o.begin() + n * hdp, 0.f);
    std::fill(l.begin(), l.begin() + n * kV, 0.f);
    std::fill(m.begin(), m.begin() + n, -std::numeric_limits<float>::infinity());
  }
  // Loads row r from src (head_dim floats), multiplied by scale, zero-padded.
  void load_row(int r, const float* src, int64_t hd, float scale) {
    float* dst = q.data() + r * hdp;
    for (int64_t d = 0; d < hd; ++d) dst[d] = src[d] * scale;
    for (int64_t d = hd; d < hdp; ++d) dst[d] = 0.f;
  }
  // Writes row r normalised (hd floats) and its log-sum-exp (-inf and zeros for an empty row).
  void store_row(int r, float* dst, int64_t hd, float* lse) const {
    const float* src = o.data() + r * hdp;
    const float sum = hsum(load(l.data() + r * kV));
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int64_t d = 0; d < hd; ++d) dst[d] = src[d] * inv;
    if (lse) *lse = sum > 0.f ? m[r] + std::log(sum) : -std::numeric_limits<float>::infinity();
  }

  // Visits one key tile (kt [hdp][kBk], v rows with stride ldv) for rows [r0, r1) with the given
  // spans (indexed by row). key_tag (kBk entries, or null) drives the tag exclusion. Works in
  // blocks of 4 rows, each restricted to the 16-column vectors its rows see, so ragged tile edges
  // (causal diagonal, window edge) cost little, and a block's scores stay in L1 for its P.V.
  void visit(const float* kt, const float* v, int64_t ldv, int r0, int r1, const RowSpan* spans,
             const int32_t* key_tag) {
    for (int rb = r0; rb < r1; rb += 4) {
      const int nr = std::min(4, r1 - rb);
      int clo = kBk, chi = 0;
      for (int r = rb; r < rb + nr; ++r) {
        const RowSpan& sp = spans[r];
        if (sp.lo0 < sp.hi0) clo = std::min(clo, sp.lo0), chi = std::max(chi, sp.hi0);
        if (sp.lo1 < sp.hi1) clo = std::min(clo, sp.lo1), chi = std::max(chi, sp.hi1);
      }
      if (clo >= chi) continue;
      const int cv0 = clo / kV, cv1 = (chi + kV - 1) / kV;
      float* sb = s.data() + rb * kBk;
      tile_scores(q.data() + rb * hdp, hdp, nr, kt + cv0 * kV, sb + cv0 * kV, cv1 - cv0);
      softmax_block(rb, nr, spans, cv0, cv1, key_tag);
      tile_pv(sb + clo, v + clo * ldv, ldv, nr, chi - clo, o.data() + rb * hdp, hdp);
    }
  }

 private:
  // Turns the scores of rows [rb, rb + nr) in column vectors [cv0, cv1) into probabilities
  // (0 where not visible) and updates m, l and the output rows.
  void softmax_block(int rb, int nr, const RowSpan* spans, int cv0, int cv1, const int32_t* key_tag) {
    const float ninf = -std::numeric_limits<float>::infinity();
    const vi16 iota{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    float mx[4];
    bool live[4], full[4];
    // Pass 1: mask (invisible scores become -inf) and the new row maxima.
    for (int i = 0; i < nr; ++i) {
      const int r = rb + i;
      const RowSpan& sp = spans[r];
      float* sr = s.data() + r * kBk;
      live[i] = full[i] = false;
      if (!sp.empty()) {
        full[i] = sp.covers(cv0 * kV, cv1 * kV) && (!key_tag || sp.tag < 0);
        v16 vm = bcast(ninf);
        for (int c = cv0; c < cv1; ++c) {
          v16 x = load(sr + c * kV);
          if (!full[i]) {
            const vi16 col = iota + c * kV;
            vi16 mk = ((col >= sp.lo0) & (col < sp.hi0)) | ((col >= sp.lo1) & (col < sp.hi1));
            if (key_tag && sp.tag >= 0) {
              vi16 kt;
              std::memcpy(&kt, key_tag + c * kV, sizeof(kt));
              mk &= (kt != sp.tag);
            }
            x = select(mk, x, bcast(ninf));
            store(sr + c * kV, x);
          }
          vm = vmax(vm, x);
        }
        mx[i] = std::max(m[r], hmax(vm));
        live[i] = mx[i] != ninf;
      }
      if (!live[i])  // nothing visible here and nothing before: contributes zeros
        for (int c = cv0 * kV; c < cv1 * kV; ++c) sr[c] = 0.f;
    }
    // Rescale factors of all rows with one vector exp (m = -inf gives ~0; l and o are 0 then).
    v16 diff{};
    for (int i = 0; i < nr; ++i)
      if (live[i]) diff[i] = m[rb + i] - mx[i];
    const v16 alpha = vexp(diff);
    // Pass 2: probabilities, sums, output rescale.
    for (int i = 0; i < nr; ++i) {
      if (!live[i]) continue;
      const int r = rb + i;
      float* sr = s.data() + r * kBk;
      v16 sum{};
      if (full[i]) {
        for (int c = cv0; c < cv1; ++c) {
          const v16 e = vexp_clamped(load(sr + c * kV) - mx[i]);
          store(sr + c * kV, e);
          sum += e;
        }
      } else {
        for (int c = cv0; c < cv1; ++c) {
          const v16 e = vexp(load(sr + c * kV) - mx[i]);  // exactly 0 for masked (-inf) scores
          store(sr + c * kV, e);
          sum += e;
        }
      }
      const float a = alpha[i];
      store(l.data() + r * kV, load(l.data() + r * kV) * a + sum);
      m[r] = mx[i];
      if (a != 1.f) {
        float* orow = o.data() + r * hdp;
        for (int64_t d = 0; d < hdp; d += kV) store(orow + d, load(orow + d) * a);
      }
    }
  }
};

}  // namespace focus::cpu::tiles
