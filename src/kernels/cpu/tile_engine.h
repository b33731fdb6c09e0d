// The attention tile engine on the CPU, shared by the dense (attention.cpp), sparse
// (sparse_attention.cpp), soft (soft_attention.cpp) and cached (cached_attention.cpp) kernels: a
// tile of up to kBq queries visits tiles of kBk keys, keeping an online softmax (running max m,
// running sum l, unnormalised output o) per query row, and partial states over disjoint key sets
// are merged exactly (merge_partials, merge_states). Vectors of kV floats, one native register
// (simd.h).
//
// What differs between the clients is a parameter: ExpMode (the dense kernel always takes the
// exact exponential, so a row's bits do not depend on the rows it is blocked with), key tags (the
// sparse kernels' pairs counted in another group) and an additive bias tile (soft mode's
// log-bias and mask, QueryTile::visit with kBiased).
//
// Layouts inside a tile (hdp = head_dim rounded up to a whole number of vectors, padding zero):
//   q  [kBq][hdp]   queries, already multiplied by the softmax scale
//   kt [hdp][kBk]   keys transposed, so a row of kt holds one dimension of kBk keys
//   v  [kBk][ldv]   values, ldv >= hdp
//   s  [kBq][kBk]   scores, then probabilities
//   o  [kBq][hdp]   unnormalised output
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <vector>

#include "core/memory.h"
#include "kernels/cpu/simd.h"

namespace focus::cpu::tiles {

using namespace simd;

// The exponential of a visit: Exact is exactly 0 below e^-87 everywhere; FastWhenFull takes the
// clamped form on blocks where every column is visible (no -inf to flush), which rounds a block
// the same way only when its rows are blocked the same way.
enum class ExpMode { Exact, FastWhenFull };

constexpr int kBq = 64;  // query rows per tile
constexpr int kBk = 64;  // keys per tile
static_assert(kBk % kV == 0 && kBq % 4 == 0, "a tile is whole vectors and whole 4-row blocks");

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

// Uninitialised 64-byte aligned floats (every user writes before reading) that only grow, for
// scratch a kernel keeps between calls so that later calls fault in no new pages. Buffers of
// 2 MiB and more are on transparent huge pages (core/memory.h huge_page_alloc): fewer page
// faults and TLB misses.
class FloatBuffer {
 public:
  void resize(size_t n) {
    if (n <= n_) return;
    p_.reset(static_cast<float*>(huge_page_alloc(n * sizeof(float))));
    n_ = n;
  }
  float* data() { return p_.get(); }
  const float* data() const { return p_.get(); }
  size_t bytes() const { return n_ * sizeof(float); }
  void release() {
    p_.reset();
    n_ = 0;
  }

 private:
  struct Free {
    void operator()(float* p) const { huge_page_free(p); }
  };
  std::unique_ptr<float, Free> p_;
  size_t n_ = 0;
};

inline int64_t padded_dim(int64_t hd) { return round_up(hd); }

// S[i, c] = sum_d Q[i, d] Kt[d, c] for R rows and NV column vectors.
template <int R, int NV>
inline void scores_block(const float* q, int64_t hdp, const float* kt, float* s) {
  vf a[R][NV] = {};
  for (int64_t d = 0; d < hdp; ++d) {
    vf kv[NV];
    for (int c = 0; c < NV; ++c) kv[c] = load_reg(kt + d * kBk + c * kV);
    for (int i = 0; i < R; ++i) {
      const vf qv = bcast(q[i * hdp + d]);
      for (int c = 0; c < NV; ++c) a[i][c] = vfma(qv, kv[c], a[i][c]);
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

// Scores of `rows` query rows against nv column vectors; kt and s point at the first column
// vector wanted (row strides stay kBk). Blocks of at most kScoreVecs vectors.
inline void tile_scores(const float* q, int64_t hdp, int rows, const float* kt, float* s, int nv) {
  for_chunks<kScoreVecs>(nv, [&]<int NV>(int c0) { scores_rows<NV>(q, hdp, rows, kt + c0 * kV, s + c0 * kV); });
}

// Where a tile's value rows lie: rows ldv floats apart (StridedRows), or anywhere, one pointer per
// key column (GatheredRows: keys gathered from scattered runs, read where they are instead of being
// copied into a tile). at(j) is column j's row; shifted(j0, d0) the view from column j0 and float d0.
struct StridedRows {
  const float* v;
  int64_t ldv;
  const float* at(int j) const { return v + j * ldv; }
  StridedRows shifted(int j0, int64_t d0) const { return {v + j0 * ldv + d0, ldv}; }
};
struct GatheredRows {
  const float* const* rows;
  int64_t d0 = 0;
  const float* at(int j) const { return rows[j] + d0; }
  GatheredRows shifted(int j0, int64_t d) const { return {rows + j0, d0 + d}; }
};

// O[i, 0:kV ND] += sum_{c < cols} P[i, c] V[c, 0:kV ND] for R rows.
template <int R, int ND, class V>
inline void pv_block(const float* p, const V& v, int cols, float* o, int64_t hdp) {
  vf a[R][ND];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < ND; ++c) a[i][c] = load(o + i * hdp + c * kV);
  for (int j = 0; j < cols; ++j) {
    vf vv[ND];
    const float* vj = v.at(j);
    for (int c = 0; c < ND; ++c) vv[c] = load_reg(vj + c * kV);
    for (int i = 0; i < R; ++i) {
      const vf pv = bcast(p[i * kBk + j]);
      for (int c = 0; c < ND; ++c) a[i][c] = vfma(pv, vv[c], a[i][c]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < ND; ++c) store(o + i * hdp + c * kV, a[i][c]);
}

template <int ND, class V>
inline void pv_rows(const float* p, const V& v, int rows, int cols, float* o, int64_t hdp) {
  int r = 0;
  for (; r + 4 <= rows; r += 4) pv_block<4, ND>(p + r * kBk, v, cols, o + r * hdp, hdp);
  switch (rows - r) {
    case 3: pv_block<3, ND>(p + r * kBk, v, cols, o + r * hdp, hdp); break;
    case 2: pv_block<2, ND>(p + r * kBk, v, cols, o + r * hdp, hdp); break;
    case 1: pv_block<1, ND>(p + r * kBk, v, cols, o + r * hdp, hdp); break;
    default: break;
  }
}

// O[r, :] += P[r, 0:cols] V[0:cols, :] for `rows` rows; p points at column 0 of row 0, v at the
// row of column 0. Blocks of at most kPvVecs output vectors.
template <class V>
inline void tile_pv(const float* p, const V& v, int rows, int cols, float* o, int64_t hdp) {
  for_chunks<kPvVecs>((int)(hdp / kV), [&]<int ND>(int d0) {
    pv_rows<ND>(p, v.shifted(0, d0 * kV), rows, cols, o + d0 * kV, hdp);
  });
}
inline void tile_pv(const float* p, const float* v, int64_t ldv, int rows, int cols, float* o, int64_t hdp) {
  tile_pv(p, StridedRows{v, ldv}, rows, cols, o, hdp);
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
  // blocks of 4 rows, each restricted to the column vectors its rows see, so ragged tile edges
  // (causal diagonal, window edge) cost little, and a block's scores stay in L1 for its P.V.
  //
  // With kBiased, add [kBq][kBk] (row r, column c) is added to the scores before the softmax (an
  // additive bias such as Focus soft mode's log(sum_g p_ig p_jg + eps); finite inside the spans).
  template <ExpMode E = ExpMode::FastWhenFull, bool kBiased = false>
  void visit(const float* kt, const float* v, int64_t ldv, int r0, int r1, const RowSpan* spans,
             const int32_t* key_tag, const float* add = nullptr) {
    visit<E, kBiased>(kt, StridedRows{v, ldv}, r0, r1, spans, key_tag, add);
  }
  // The same with the value rows where vs says (StridedRows or GatheredRows).
  template <ExpMode E = ExpMode::FastWhenFull, bool kBiased = false, class V>
  void visit(const float* kt, const V& vs, int r0, int r1, const RowSpan* spans, const int32_t* key_tag,
             const float* add = nullptr) {
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
      softmax_block<E, kBiased>(rb, nr, spans, cv0, cv1, key_tag, add);
      tile_pv(sb + clo, vs.shifted(clo, 0), nr, chi - clo, o.data() + rb * hdp, hdp);
    }
  }

 private:
  // Turns the scores of rows [rb, rb + nr) in column vectors [cv0, cv1) into probabilities
  // (0 where not visible) and updates m, l and the output rows.
  template <ExpMode E, bool kBiased>
  void softmax_block(int rb, int nr, const RowSpan* spans, int cv0, int cv1, const int32_t* key_tag,
                     const float* add) {
    const float ninf = -std::numeric_limits<float>::infinity();
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
        vf vm = bcast(ninf);
        for (int c = cv0; c < cv1; ++c) {
          vf x = load(sr + c * kV);
          if constexpr (kBiased) x = x + load(add + r * kBk + c * kV);
          if (!full[i]) {
            const vi col = iota + c * kV;
            vi mk = ((col >= sp.lo0) & (col < sp.hi0)) | ((col >= sp.lo1) & (col < sp.hi1));
            if (key_tag && sp.tag >= 0) mk &= (loadi(key_tag + c * kV) != sp.tag);
            x = select(mk, x, bcast(ninf));
          }
          if (kBiased || !full[i]) store(sr + c * kV, x);
          vm = vmax(vm, x);
        }
        mx[i] = std::max(m[r], hmax(vm));
        live[i] = mx[i] != ninf;
      }
      if (!live[i])  // nothing visible here and nothing before: contributes zeros
        for (int c = cv0 * kV; c < cv1 * kV; ++c) sr[c] = 0.f;
    }
    // Rescale factors of all rows with one vector exp (m = -inf gives ~0; l and o are 0 then).
    vf diff{};
    for (int i = 0; i < nr; ++i)
      if (live[i]) diff[i] = m[rb + i] - mx[i];
    const vf alpha = vexp(diff);
    // Pass 2: probabilities, sums, output rescale.
    for (int i = 0; i < nr; ++i) {
      if (!live[i]) continue;
      const int r = rb + i;
      float* sr = s.data() + r * kBk;
      vf sum{};
      if (E == ExpMode::FastWhenFull && full[i]) {
        for (int c = cv0; c < cv1; ++c) {
          const vf e = vexp_clamped(load(sr + c * kV) - mx[i]);
          store(sr + c * kV, e);
          sum += e;
        }
      } else {
        for (int c = cv0; c < cv1; ++c) {
          const vf e = vexp(load(sr + c * kV) - mx[i]);  // exactly 0 for masked (-inf) scores
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

// ---------------------------------------------------------------------------------------------
// Partial states of one row over disjoint key sets: m (the largest score), l (sum of e^(s - m))
// and o (sum of e^(s - m) v, hd floats, unnormalised). A normalised output with its log-sum-exp
// is the partial state (lse, 1, o).
struct Partial {
  float m, l;
  const float* o;
};

// Merges partials 0 .. count-1 (get(c) returns partial c) in that order into the normalised
// output out (hd floats); returns the log-sum-exp (-inf and zeros when every partial is empty,
// m = -inf). The order is fixed, so the result does not depend on who computed the partials.
// out may be partial 0's o.
template <class Get>
inline float merge_partials(int64_t count, int64_t hd, float* out, Get&& get) {
  const float ninf = -std::numeric_limits<float>::infinity();
  float mx = ninf;
  for (int64_t c = 0; c < count; ++c) mx = std::max(mx, get(c).m);
  if (mx == ninf) {
    std::fill(out, out + hd, 0.f);
    return mx;
  }
  double sum = 0;
  bool first = true;
  for (int64_t c = 0; c < count; ++c) {
    const Partial p = get(c);
    if (p.m == ninf) continue;
    const float f = std::exp(p.m - mx);
    sum += (double)p.l * f;
    if (first)
      for (int64_t x = 0; x < hd; ++x) out[x] = f * p.o[x];
    else
      for (int64_t x = 0; x < hd; ++x) out[x] += f * p.o[x];
    first = false;
  }
  const float inv = (float)(1.0 / sum);
  for (int64_t x = 0; x < hd; ++x) out[x] *= inv;
  return mx + (float)std::log(sum);
}

}  // namespace focus::cpu::tiles
