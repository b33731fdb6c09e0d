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

template <class Op>
void rows_driver(const Mat& W, int64_t r0, int64_t r1, const Act& a, float* y, int64_t ldy) {
  for (int64_t n = r0; n < r1; ++n) {
    const uint8_t* row = W.data + (size_t)n * W.row_bytes;
    float out[4];
    int64_t m0 = 0;
    for (; m0 + 4 <= a.M; m0 += 4) {
      Op::template row<4>(W, row, a, m0, out);
      for (int i = 0; i < 4; ++i) y[(m0 + i) * ldy + n] = out[i];
    }
    const int64_t rest = a.M - m0;
    if (rest == 3) Op::template row<3>(W, row, a, m0, out);
    else if (rest == 2) Op::template row<2>(W, row, a, m0, out);
    else if (rest == 1) Op::template row<1>(W, row, a, m0, out);
    for (int64_t i = 0; i < rest; ++i) y[(m0 + i) * ldy + n] = out[i];
  }
}

// ---------------------------------------------------------------- Q4_0 / Q4_1 / Q8_0
// One 32-element block per step; the offset (Q4_0: -8 d, Q8_0: none) or min (Q4_1: m) times the
// block's activation sum goes to a scalar sum.
enum class C { Q4_0, Q4_1, Q8_0 };

template <C T>
struct Classic {
  static constexpr int bb = T == C::Q4_1 ? 20 : T == C::Q4_0 ? 18 : 34;
  template <int MT>
  static QMV_INLINE void row(const Mat& W, const uint8_t* row, const Act& a, int64_t m0, float* out) {
    const int64_t nb = W.cols / 32, nbp = a.Kp / 32;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[MT];
    __m128 off_acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps(), off_acc[m] = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = row + b * bb;
      const float dw = half(p);
      __m256i w;
      if constexpr (T == C::Q8_0) {
        w = load256(p + 2);
      } else {
        const __m128i v = load128(p + (T == C::Q4_1 ? 4 : 2));
        w = _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1), m4);
      }
      const __m256i wabs = T == C::Q8_0 ? _mm256_sign_epi8(w, w) : w;
      const __m128 off = _mm_set_ss(T == C::Q4_1 ? half(p + 2) : dw * -8.f);
      for (int m = 0; m < MT; ++m) {
        const int64_t o = (m0 + m) * nbp + b;
        __m256i xq = load256(a.q + (m0 + m) * a.Kp + b * 32);
        if constexpr (T == C::Q8_0) xq = _mm256_sign_epi8(xq, w);
        const __m256 s = _mm256_set1_ps(dw * a.d32[o]);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(wabs, xq)), s, acc[m]);
        if constexpr (T != C::Q8_0) off_acc[m] = _mm_fmadd_ss(off, _mm_set_ss(a.s32[o]), off_acc[m]);
      }
    }
    for (int m = 0; m < MT; ++m) out[m] = hsum(acc[m]) + _mm_cvtss_f32(off_acc[m]);
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
  template <int MT>
  static QMV_INLINE void row(const Mat& W, const uint8_t* row, const Act& a, int64_t m0, float* out) {
    const int64_t nsb = W.cols / 256, nbp = a.Kp / 32;
    const __m256i m4 = _mm256_set1_epi8(0x0F), b16 = _mm256_set1_epi8(16);
    __m256 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* p = row + sb * bb;
      uint64_t scb, mnb;
      k4_scales(p + 4, scb, mnb);
      const __m256 ds = _mm256_mul_ps(_mm256_set1_ps(half(p)), bytes8_to_ps(scb));
      const __m256 dmn = _mm256_mul_ps(_mm256_set1_ps(half(p + 2)), bytes8_to_ps(mnb));
      __m256 sc[MT];
      for (int m = 0; m < MT; ++m) {
        const int64_t o = (m0 + m) * nbp + sb * 8;
        sc[m] = _mm256_mul_ps(ds, _mm256_loadu_ps(a.d32 + o));
        acc[m] = _mm256_fnmadd_ps(dmn, _mm256_loadu_ps(a.s32 + o), acc[m]);
      }
      __m256i qh = Five ? load256(p + 16) : _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        const __m256i v = load256(p + qoff + 32 * j);
        __m256i lo = _mm256_and_si256(v, m4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        if (Five) {  // bits 2j and 2j + 1 of qh, moved down two places per chunk
          lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(qh, 4), b16));
          hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(qh, 3), b16));
          qh = _mm256_srli_epi16(qh, 2);
        }
        const __m256i i_lo = _mm256_set1_epi32(2 * j), i_hi = _mm256_set1_epi32(2 * j + 1);
        for (int m = 0; m < MT; ++m) {
          const int8_t* xq = a.q + (m0 + m) * a.Kp + sb * 256 + 64 * j;
          acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(lo, load256(xq))),
                                   _mm256_permutevar8x32_ps(sc[m], i_lo), acc[m]);
          acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(hi, load256(xq + 32))),
                                   _mm256_permutevar8x32_ps(sc[m], i_hi), acc[m]);
        }
      }
    }
    for (int m = 0; m < MT; ++m) out[m] = hsum(acc[m]);
  }
};

// ---------------------------------------------------------------- Q6_K
struct Q6K {
  static constexpr int bb = 210;
  template <int MT>
  static QMV_INLINE void row(const Mat& W, const uint8_t* row, const Act& a, int64_t m0, float* out) {
    const int64_t nsb = W.cols / 256, nb16p = a.Kp / 16;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256i idx[4] = {_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
                            _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5), _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)};
    __m256 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* p = row + sb * bb;
      const __m256 d = _mm256_set1_ps(half(p + 208));
      const __m128i sc8 = load128(p + 192);
      const __m256 dsc[2] = {_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8))),
                             _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8))))};
      const __m256 m32 = _mm256_set1_ps(-32.f);
      __m256 sc[MT][2];
      for (int m = 0; m < MT; ++m) {
        const int64_t o = (m0 + m) * nb16p + sb * 16;
        for (int h = 0; h < 2; ++h) {
          sc[m][h] = _mm256_mul_ps(dsc[h], _mm256_loadu_ps(a.d16 + o + 8 * h));
          acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(dsc[h], m32), _mm256_loadu_ps(a.s16 + o + 8 * h), acc[m]);
        }
      }
      for (int h = 0; h < 2; ++h) {
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
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(q[c], load256(xq + 32 * c))),
                                     _mm256_permutevar8x32_ps(sc[m][h], idx[c]), acc[m]);
        }
      }
    }
    for (int m = 0; m < MT; ++m) out[m] = hsum(acc[m]);
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
  template <int MT>
  static QMV_INLINE void row(const Mat& W, const uint8_t* row, const Act& a, int64_t m0, float* out) {
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

}  // namespace

Kernel kernel_avx2(io::GGMLType t) {
  using io::GGMLType;
  switch (t) {
    case GGMLType::Q4_0: return {rows_driver<Classic<C::Q4_0>>, ActLayout::Natural, true};
    case GGMLType::Q4_1: return {rows_driver<Classic<C::Q4_1>>, ActLayout::Natural, true};
    case GGMLType::Q8_0: return {rows_driver<Classic<C::Q8_0>>, ActLayout::Natural, true};
    case GGMLType::Q4_K: return {rows_driver<QK45<false>>, ActLayout::Natural, true};
    case GGMLType::Q5_K: return {rows_driver<QK45<true>>, ActLayout::Natural, true};
    case GGMLType::Q6_K: return {rows_driver<Q6K>, ActLayout::Natural, true};
    case GGMLType::F32: return {rows_driver<Flt<FT::F32>>, ActLayout::Natural, false};
    case GGMLType::F16: return {rows_driver<Flt<FT::F16>>, ActLayout::Natural, false};
    case GGMLType::BF16: return {rows_driver<Flt<FT::BF16>>, ActLayout::Natural, false};
    default: return {nullptr, ActLayout::Natural, false};
  }
}

}  // namespace focus::cpu::qmv
