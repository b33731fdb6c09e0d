// quant_matvec kernels for AVX2 + FMA + F16C (this file is compiled with those flags; it is only
// called when the CPU has them). Integer products use vpmaddubsw (unsigned weight bytes times signed
// activation bytes, pairs summed in 16 bits: at most 2 * 63 * 127 for the 6-bit types, so nothing
// saturates; Q8_0 multiplies |w| by x with w's sign) and vpmaddwd to 32 bits. One 32-byte register
// per block or sub-block, its float scale broadcast. Everything here has internal linkage.
#include <immintrin.h>

#include <cstring>

#include "kernels/cpu/quant_matvec_impl.h"

namespace focus::cpu::qmv {
namespace {

#define QMV_INLINE inline __attribute__((always_inline))

QMV_INLINE float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
QMV_INLINE uint32_t rd32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
QMV_INLINE __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
QMV_INLINE __m128i load128(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }

// Sum of u8 x s8 products, four per 32-bit lane.
QMV_INLINE __m256i dot_u8s8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
QMV_INLINE float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Weights come from memory once per product (a model's weights do not fit in the caches), so the
// bytes [from, to) of the rows being read are prefetched kPrefetch bytes ahead of use: the
// hardware prefetchers alone leave much of the memory bandwidth unused.
constexpr int64_t kPrefetch = 2048;
QMV_INLINE void prefetch_ahead(const uint8_t* from, const uint8_t* to, const uint8_t* end) {
  if (end - to < kPrefetch) return;
  for (const uint8_t* p = from + kPrefetch; p < to + kPrefetch; p += 64) _mm_prefetch((const char*)p, _MM_HINT_T0);
}

// Runs Op::row<R, MT> over the rows [r0, r1) and the activation rows in tiles: 2 weight rows at a
// time while decoding (M = 1 or 2: two independent chains of work), by MT activation rows. Each
// output's operations are the same whatever R, MT and the tiling. (Four rows at a time, one more
// chain, ran at half the memory speed or less on an AMD Zen 3 for Q8_0 and Q6_K, and no faster for
// the others, when the weight streams from memory as it does while decoding.)
template <class Op>
void rows_driver(const Mat& W, int64_t r0, int64_t r1, const Act& a, float* y, int64_t ldy) {
  float out[16] = {};
  int64_t n = r0;
  auto rp = [&](int64_t i) { return W.data + (size_t)i * W.row_bytes; };
  if constexpr (Op::multi_row) {
    if (a.M == 1) {
      for (; n + 2 <= r1; n += 2) {
        const uint8_t* rows[2] = {rp(n), rp(n + 1)};
        prefetch_ahead(rp(n), rp(n + 2), rp(W.rows));
        Op::template row<2, 1>(W, rows, a, 0, out);
        for (int r = 0; r < 2; ++r) y[n + r] = out[r];
      }
    } else if (a.M == 2) {
      for (; n + 2 <= r1; n += 2) {
        const uint8_t* rows[2] = {rp(n), rp(n + 1)};
        prefetch_ahead(rp(n), rp(n + 2), rp(W.rows));
        Op::template row<2, 2>(W, rows, a, 0, out);
        for (int r = 0; r < 2; ++r)
          for (int m = 0; m < 2; ++m) y[m * ldy + n + r] = out[r * 2 + m];
      }
    }
  }
  for (; n < r1; ++n) {
    const uint8_t* rows[1] = {rp(n)};
    prefetch_ahead(rp(n), rp(n + 1), rp(W.rows));
    int64_t m0 = 0;
    for (; m0 + 4 <= a.M; m0 += 4) {
      Op::template row<1, 4>(W, rows, a, m0, out);
      for (int i = 0; i < 4; ++i) y[(m0 + i) * ldy + n] = out[i];
    }
    const int64_t rest = a.M - m0;
    if (rest == 3) Op::template row<1, 3>(W, rows, a, m0, out);
    else if (rest == 2) Op::template row<1, 2>(W, rows, a, m0, out);
    else if (rest == 1) Op::template row<1, 1>(W, rows, a, m0, out);
    for (int64_t i = 0; i < rest; ++i) y[(m0 + i) * ldy + n] = out[i];
  }
}

// Scales of up to 8 blocks: the 32-bit words at p, p + bb, ... (blocks past n_ok read as 0).
template <int bb>
QMV_INLINE __m256i words8(const uint8_t* p, int n_ok) {
  if (n_ok >= 8)
    return _mm256_setr_epi32((int)rd32(p), (int)rd32(p + bb), (int)rd32(p + 2 * bb), (int)rd32(p + 3 * bb),
                             (int)rd32(p + 4 * bb), (int)rd32(p + 5 * bb), (int)rd32(p + 6 * bb),
                             (int)rd32(p + 7 * bb));
  alignas(32) uint32_t w[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < n_ok; ++i) w[i] = rd32(p + i * bb);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(w));
}
// The fp16 in the low (hi = false) or high halves of 8 words, as floats.
QMV_INLINE __m256 halves8(__m256i w, bool hi) {
  const __m256i pick = hi ? _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1, 2, 3, 6, 7,
                                             10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1)
                          : _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 4, 5, 8,
                                             9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(w, pick), 0x08);  // qwords 0, 2
  return _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
}

// ---------------------------------------------------------------- Q4_0 / Q4_1 / Q5_0 / Q5_1
// Groups of 8 blocks: their fp16 d (and m) are converted together, the block scales d * d_x and
// the offset (-8 d, -16 d) or min (m) terms formed as 8-lane vectors. Steps of two blocks a, b:
// the low nibbles [a | b] against the activations [a 0-15 | b 0-15] and the high nibbles against
// [a 16-31 | b 16-31] (layout Nib16x2), summed in 16 bits (at most 2 * 2 * 31 * 127), so lanes 0-3
// hold block a and 4-7 block b; each block's scale is permuted onto its lanes. Q5's fifth bits:
// qh of a and b in the two 128-bit lanes, bytes 0-1 (low halves) or 2-3 (high) spread eight
// bytes each and tested bit by bit.
enum class C { Q4_0, Q4_1, Q5_0, Q5_1 };

template <C T>
struct Q45 {
  static constexpr bool min = T == C::Q4_1 || T == C::Q5_1, five = T == C::Q5_0 || T == C::Q5_1;
  static constexpr int bb = T == C::Q4_0 ? 18 : T == C::Q4_1 ? 20 : T == C::Q5_0 ? 22 : 24;
  static constexpr int qhoff = min ? 4 : 2, qoff = five ? qhoff + 4 : qhoff;
  static constexpr float offset = five ? -16.f : -8.f;  // of the types without a min
  static constexpr bool multi_row = true;

  template <int R, int MT>
  static QMV_INLINE void row(const Mat& W, const uint8_t* const* rows, const Act& a, int64_t m0, float* out) {
    const int64_t nb = W.cols / 32, nbp = a.Kp / 32;
    const __m256i m4 = _mm256_set1_epi8(0x0F), b16 = _mm256_set1_epi8(16), ones = _mm256_set1_epi16(1);
    const __m256i spread_lo = _mm256_setr_epi64x(0, 0x0101010101010101ll, 0, 0x0101010101010101ll);
    const __m256i spread_hi = _mm256_setr_epi64x(0x0202020202020202ll, 0x0303030303030303ll,
                                                 0x0202020202020202ll, 0x0303030303030303ll);
    const __m256i bits = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    __m256 acc[R][MT];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < nb; g += 8) {
      const int ng = (int)(nb - g < 8 ? nb - g : 8);
      __m256 sc[R][MT];
      __m256i qh8[R];
      for (int r = 0; r < R; ++r) {
        const uint8_t* gp = rows[r] + g * bb;
        const __m256i w = words8<bb>(gp, ng);
        const __m256 dw = halves8(w, false);
        const __m256 off = min ? halves8(w, true) : _mm256_mul_ps(dw, _mm256_set1_ps(offset));
        if constexpr (five) qh8[r] = words8<bb>(gp + qhoff, ng);
        for (int m = 0; m < MT; ++m) {
          const int64_t o = (m0 + m) * nbp + g;
          sc[r][m] = _mm256_mul_ps(dw, _mm256_loadu_ps(a.d32 + o));
          acc[r][m] = _mm256_fmadd_ps(off, _mm256_loadu_ps(a.s32 + o), acc[r][m]);
        }
      }
      for (int j = 0; j < ng; j += 2) {
        const __m256i pidx = _mm256_setr_epi32(j, j, j, j, j + 1, j + 1, j + 1, j + 1);
        for (int r = 0; r < R; ++r) {
          // A missing second block re-reads the first: its activations are zero.
          const uint8_t* p = rows[r] + (g + j) * bb + qoff;
          const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(load128(p)),
                                                    load128(j + 1 < ng ? p + bb : p), 1);
          __m256i lo = _mm256_and_si256(v, m4);
          __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
          if constexpr (five) {
            const __m256i qh = _mm256_permutevar8x32_epi32(qh8[r], pidx);
            const __m256i l5 = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(qh, spread_lo), bits), bits);
            const __m256i h5 = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(qh, spread_hi), bits), bits);
            lo = _mm256_or_si256(lo, _mm256_and_si256(l5, b16));
            hi = _mm256_or_si256(hi, _mm256_and_si256(h5, b16));
          }
          for (int m = 0; m < MT; ++m) {
            const int8_t* xq = a.q + (m0 + m) * a.Kp + (g + j) * 32;
            const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, load256(xq)),
                                                 _mm256_maddubs_epi16(hi, load256(xq + 32)));
            acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones)),
                                        _mm256_permutevar8x32_ps(sc[r][m], pidx), acc[r][m]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) out[r * MT + m] = hsum(acc[r][m]);
  }
};

// ---------------------------------------------------------------- Q8_0
// One block per step: |w| times x with w's sign (at most 2 * 128 * 127 per 16-bit pair); scales
// as for Q4_0, eight blocks at a time.
struct Q8 {
  static constexpr int bb = 34;
  static constexpr bool multi_row = true;
  template <int R, int MT>
  static QMV_INLINE void row(const Mat& W, const uint8_t* const* rows, const Act& a, int64_t m0, float* out) {
    const int64_t nb = W.cols / 32, nbp = a.Kp / 32;
    __m256 acc[R][MT];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < nb; g += 8) {
      const int ng = (int)(nb - g < 8 ? nb - g : 8);
      __m256 sc[R][MT];
      for (int r = 0; r < R; ++r) {
        const __m256 dw = halves8(words8<bb>(rows[r] + g * bb, ng), false);
        for (int m = 0; m < MT; ++m) sc[r][m] = _mm256_mul_ps(dw, _mm256_loadu_ps(a.d32 + (m0 + m) * nbp + g));
      }
      for (int j = 0; j < ng; ++j) {
        const __m256i pidx = _mm256_set1_epi32(j);
        for (int r = 0; r < R; ++r) {
          const __m256i w = load256(rows[r] + (g + j) * bb + 2);
          const __m256i wabs = _mm256_sign_epi8(w, w);
          for (int m = 0; m < MT; ++m) {
            const __m256i xq = _mm256_sign_epi8(load256(a.q + (m0 + m) * a.Kp + (g + j) * 32), w);
            acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(wabs, xq)),
                                        _mm256_permutevar8x32_ps(sc[r][m], pidx), acc[r][m]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) out[r * MT + m] = hsum(acc[r][m]);
  }
};

// ---------------------------------------------------------------- Q4_K / Q5_K
QMV_INLINE void k4_scales(const uint8_t* s, uint64_t& sc, uint64_t& mn) {
  const uint32_t u0 = rd32(s), u1 = rd32(s + 4), u2 = rd32(s + 8);
  const uint32_t sc_lo = u0 & 0x3F3F3F3Fu, mn_lo = u1 & 0x3F3F3F3Fu;
  const uint32_t sc_hi = (u2 & 0x0F0F0F0Fu) | ((u0 >> 2) & 0x30303030u);
  const uint32_t mn_hi = ((u2 >> 4) & 0x0F0F0F0Fu) | ((u1 >> 2) & 0x30303030u);
  sc = sc_lo | ((uint64_t)sc_hi << 32);
  mn = mn_lo | ((uint64_t)mn_hi << 32);
}
QMV_INLINE __m256 bytes8_to_ps(uint64_t v) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)v)));
}

template <bool Five>
struct QK45 {
  static constexpr int bb = Five ? 176 : 144, qoff = Five ? 48 : 16;
  static constexpr bool multi_row = true;
  template <int R, int MT>
  static QMV_INLINE void row(const Mat& W, const uint8_t* const* rows, const Act& a, int64_t m0, float* out) {
    const int64_t nsb = W.cols / 256, nbp = a.Kp / 32;
    const __m256i m4 = _mm256_set1_epi8(0x0F), b16 = _mm256_set1_epi8(16);
    __m256 acc[R][MT];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; ++sb) {
      __m256 sc[R][MT];
      __m256i qh[R];
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = rows[r] + sb * bb;
        uint64_t scb, mnb;
        k4_scales(p + 4, scb, mnb);
        const __m256 ds = _mm256_mul_ps(_mm256_set1_ps(half(p)), bytes8_to_ps(scb));
        const __m256 dmn = _mm256_mul_ps(_mm256_set1_ps(half(p + 2)), bytes8_to_ps(mnb));
        for (int m = 0; m < MT; ++m) {
          const int64_t o = (m0 + m) * nbp + sb * 8;
          sc[r][m] = _mm256_mul_ps(ds, _mm256_loadu_ps(a.d32 + o));
          acc[r][m] = _mm256_fnmadd_ps(dmn, _mm256_loadu_ps(a.s32 + o), acc[r][m]);
        }
        qh[r] = Five ? load256(p + 16) : _mm256_setzero_si256();
      }
      for (int j = 0; j < 4; ++j) {
        const __m256i i_lo = _mm256_set1_epi32(2 * j), i_hi = _mm256_set1_epi32(2 * j + 1);
        for (int r = 0; r < R; ++r) {
          const __m256i v = load256(rows[r] + sb * bb + qoff + 32 * j);
          __m256i lo = _mm256_and_si256(v, m4);
          __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
          if (Five) {  // bits 2j and 2j + 1 of qh, moved down two places per chunk
            lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(qh[r], 4), b16));
            hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(qh[r], 3), b16));
            qh[r] = _mm256_srli_epi16(qh[r], 2);
          }
          for (int m = 0; m < MT; ++m) {
            const int8_t* xq = a.q + (m0 + m) * a.Kp + sb * 256 + 64 * j;
            acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(lo, load256(xq))),
                                        _mm256_permutevar8x32_ps(sc[r][m], i_lo), acc[r][m]);
            acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(hi, load256(xq + 32))),
                                        _mm256_permutevar8x32_ps(sc[r][m], i_hi), acc[r][m]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) out[r * MT + m] = hsum(acc[r][m]);
  }
};

// ---------------------------------------------------------------- Q6_K
struct Q6K {
  static constexpr int bb = 210;
  static constexpr bool multi_row = true;
  template <int R, int MT>
  static QMV_INLINE void row(const Mat& W, const uint8_t* const* rows, const Act& a, int64_t m0, float* out) {
    const int64_t nsb = W.cols / 256, nb16p = a.Kp / 16;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256i idx[4] = {_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
                            _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5), _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)};
    __m256 acc[R][MT];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; ++sb) {
      for (int h = 0; h < 2; ++h) {
        for (int r = 0; r < R; ++r) {
          const uint8_t* p = rows[r] + sb * bb;
          // Scales of this half's eight sub-blocks; the -32 offset through the 16-element sums.
          const __m256 dsc = _mm256_mul_ps(_mm256_set1_ps(half(p + 208)),
                                           _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                                               reinterpret_cast<const __m128i*>(p + 192 + 8 * h)))));
          __m256 sc[MT];
          for (int m = 0; m < MT; ++m) {
            const int64_t o = (m0 + m) * nb16p + sb * 16 + 8 * h;
            sc[m] = _mm256_mul_ps(dsc, _mm256_loadu_ps(a.d16 + o));
            acc[r][m] = _mm256_fmadd_ps(_mm256_mul_ps(dsc, _mm256_set1_ps(-32.f)), _mm256_loadu_ps(a.s16 + o),
                                        acc[r][m]);
          }
          const uint8_t* ql = p + 64 * h;
          const __m256i l0 = load256(ql), l1 = load256(ql + 32), qh = load256(p + 128 + 32 * h);
          __m256i q[4];
          q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
          q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
          q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, m30));
          q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                 _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
          for (int m = 0; m < MT; ++m) {
            const int8_t* xq = a.q + (m0 + m) * a.Kp + sb * 256 + 128 * h;
            for (int c = 0; c < 4; ++c)
              acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(q[c], load256(xq + 32 * c))),
                                          _mm256_permutevar8x32_ps(sc[m], idx[c]), acc[r][m]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) out[r * MT + m] = hsum(acc[r][m]);
  }
};

// ---------------------------------------------------------------- F32 / F16 / BF16
enum class FT { F32, F16, BF16 };

template <FT T>
QMV_INLINE __m256 load_w(const uint8_t* row, int64_t k) {
  if constexpr (T == FT::F32) return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + k);
  else if constexpr (T == FT::F16) return _mm256_cvtph_ps(load128(row + 2 * k));
  else return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load128(row + 2 * k)), 16));
}
template <FT T>
QMV_INLINE float load_w1(const uint8_t* row, int64_t k) {
  uint16_t h;
  if constexpr (T == FT::F32) {
    float f;
    std::memcpy(&f, row + 4 * k, 4);
    return f;
  } else if constexpr (T == FT::F16) {
    std::memcpy(&h, row + 2 * k, 2);
    return _cvtsh_ss(h);
  } else {
    std::memcpy(&h, row + 2 * k, 2);
    const uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
}

template <FT T>
struct Flt {
  static constexpr bool multi_row = false;
  template <int R, int MT>
  static QMV_INLINE void row(const Mat& W, const uint8_t* const* rows, const Act& a, int64_t m0, float* out) {
    static_assert(R == 1);
    const uint8_t* row = rows[0];
    const int64_t K = W.cols;
    __m256 acc[MT][4];
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      __m256 w[4];
      for (int j = 0; j < 4; ++j) w[j] = load_w<T>(row, k + 8 * j);
      for (int m = 0; m < MT; ++m) {
        const float* x = a.x + (m0 + m) * K + k;
        for (int j = 0; j < 4; ++j) acc[m][j] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(x + 8 * j), acc[m][j]);
      }
    }
    for (int j = 0; k + 8 <= K; k += 8, ++j) {
      const __m256 w = load_w<T>(row, k);
      for (int m = 0; m < MT; ++m) acc[m][j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(a.x + (m0 + m) * K + k), acc[m][j]);
    }
    __m128 tail[MT];
    for (int m = 0; m < MT; ++m) tail[m] = _mm_setzero_ps();
    for (; k < K; ++k) {
      const __m128 w = _mm_set_ss(load_w1<T>(row, k));
      for (int m = 0; m < MT; ++m) tail[m] = _mm_fmadd_ss(w, _mm_set_ss(a.x[(m0 + m) * K + k]), tail[m]);
    }
    for (int m = 0; m < MT; ++m)
      out[m] = hsum(_mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]), _mm256_add_ps(acc[m][2], acc[m][3]))) +
               _mm_cvtss_f32(tail[m]);
  }
};

// Sum of the 8 lanes.
QMV_INLINE int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

}  // namespace

void quantize_row_avx2(const float* x, int64_t K, int8_t* q, float* d, int32_t* sum16) {
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t b = 0; b < K / 32; ++b, x += 32, q += 32) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], sign), _mm256_and_ps(v[1], sign)),
                             _mm256_max_ps(_mm256_and_ps(v[2], sign), _mm256_and_ps(v[3], sign)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float db = _mm_cvtss_f32(h) / 127.f;
    d[b] = db;
    if (!(db > 0.f)) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_setzero_si256());
      sum16[2 * b] = sum16[2 * b + 1] = 0;
      continue;
    }
    const __m256 vd = _mm256_set1_ps(db);
    __m256i qi[4];
    for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_div_ps(v[i], vd));
    // Saturating packs keep values (|q| <= 127); the in-lane order is fixed by one permutation.
    const __m256i w01 = _mm256_packs_epi32(qi[0], qi[1]), w23 = _mm256_packs_epi32(qi[2], qi[3]);
    const __m256i b8 =
        _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), b8);
    sum16[2 * b] = hsum_epi32(_mm256_add_epi32(qi[0], qi[1]));
    sum16[2 * b + 1] = hsum_epi32(_mm256_add_epi32(qi[2], qi[3]));
  }
}

Kernel kernel_avx2(io::GGMLType t) {
  using io::GGMLType;
  switch (t) {
    case GGMLType::Q4_0: return {rows_driver<Q45<C::Q4_0>>, ActLayout::Nib16x2, true, ActLanes::None};
    case GGMLType::Q4_1: return {rows_driver<Q45<C::Q4_1>>, ActLayout::Nib16x2, true, ActLanes::None};
    case GGMLType::Q5_0: return {rows_driver<Q45<C::Q5_0>>, ActLayout::Nib16x2, true, ActLanes::None};
    case GGMLType::Q5_1: return {rows_driver<Q45<C::Q5_1>>, ActLayout::Nib16x2, true, ActLanes::None};
    case GGMLType::Q8_0: return {rows_driver<Q8>, ActLayout::Natural, true, ActLanes::None};
    case GGMLType::Q4_K: return {rows_driver<QK45<false>>, ActLayout::Natural, true, ActLanes::None};
    case GGMLType::Q5_K: return {rows_driver<QK45<true>>, ActLayout::Natural, true, ActLanes::None};
    case GGMLType::Q6_K: return {rows_driver<Q6K>, ActLayout::Natural, true, ActLanes::None};
    case GGMLType::F32: return {rows_driver<Flt<FT::F32>>, ActLayout::Natural, false, ActLanes::None};
    case GGMLType::F16: return {rows_driver<Flt<FT::F16>>, ActLayout::Natural, false, ActLanes::None};
    case GGMLType::BF16: return {rows_driver<Flt<FT::BF16>>, ActLayout::Natural, false, ActLanes::None};
    default: return {nullptr, ActLayout::Natural, false, ActLanes::None};
  }
}

}  // namespace focus::cpu::qmv
