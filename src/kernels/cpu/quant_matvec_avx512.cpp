// quant_matvec kernels for AVX-512 F/BW/VL with VNNI (this file is compiled with those flags; it
// is only called when the CPU has them). Integer dot products use vpdpbusd (unsigned weight bytes
// times signed activation bytes, four products per 32-bit lane); offsets and mins of the weights
// are applied through the activations' block sums. Per-block scales are applied in float32 lane
// by lane: a vector of 16 block (or sub-block) scales is formed once and permuted onto the lanes.
// Everything here has internal linkage, so nothing compiled with these flags can be picked by the
// linker for code that runs on other CPUs.
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
QMV_INLINE __m512i load512(const void* p) { return _mm512_loadu_si512(p); }
QMV_INLINE __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
QMV_INLINE __m128i load128(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }

// Runs Op::row<MT> for every row in [r0, r1) and every tile of up to four activation rows.
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

// Four block scales (float lanes) of 16 per step: lane l of a step gets scale 4 s + l / 4.
QMV_INLINE __m512i quad_index() { return _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3); }
QMV_INLINE __m512i pair_index() { return _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1); }

// ---------------------------------------------------------------- Q4_0 / Q4_1
// Groups of 16 blocks: the fp16 d (and m) of all 16 come in one gather; steps of 4 blocks take the
// 4 x 16 nibble bytes into one register, low nibbles against the activations' low halves (layout
// Nib16), high nibbles against the high halves, into the same lanes.
template <bool Min>
struct Q4 {
  static constexpr int bb = Min ? 20 : 18, qoff = Min ? 4 : 2;
  template <int MT>
  static QMV_INLINE void row(const Mat& W, const uint8_t* row, const Act& a, int64_t m0, float* out) {
    const int64_t nb = W.cols / 32, nbp = a.Kp / 32;
    const __m512i gidx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(bb));
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < nb; g += 16) {
      const int64_t ng = nb - g < 16 ? nb - g : 16;
      const __mmask16 km = (__mmask16)((1u << ng) - 1u);
      const uint8_t* gp = row + g * bb;
      const __m512i dm = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), km, gidx, gp, 1);
      const __m512 dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
      const __m512 off = Min ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)))
                             : _mm512_mul_ps(dw, _mm512_set1_ps(-8.f));
      __m512 sc[MT];
      for (int m = 0; m < MT; ++m) {
        const int64_t o = (m0 + m) * nbp + g;
        sc[m] = _mm512_mul_ps(dw, _mm512_loadu_ps(a.d32 + o));
        acc[m] = _mm512_fmadd_ps(off, _mm512_loadu_ps(a.s32 + o), acc[m]);
      }
      __m512i sidx = quad_index();
      for (int64_t s = 0; s < ng; s += 4, sidx = _mm512_add_epi32(sidx, _mm512_set1_epi32(4))) {
        const uint8_t* p = gp + s * bb + qoff;
        // Blocks past the row's end (inside the last step) re-read the step's first block: their
        // activations are zero.
        const uint8_t* p1 = s + 1 < ng ? p + bb : p;
        const uint8_t* p2 = s + 2 < ng ? p + 2 * bb : p;
        const uint8_t* p3 = s + 3 < ng ? p + 3 * bb : p;
        __m512i v = _mm512_castsi128_si512(load128(p));
        v = _mm512_inserti32x4(v, load128(p1), 1);
        v = _mm512_inserti32x4(v, load128(p2), 2);
        v = _mm512_inserti32x4(v, load128(p3), 3);
        const __m512i lo = _mm512_and_si512(v, m4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        for (int m = 0; m < MT; ++m) {
          const int8_t* xq = a.q + (m0 + m) * a.Kp + (g + s) * 32;
          __m512i i = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, load512(xq));
          i = _mm512_dpbusd_epi32(i, hi, load512(xq + 64));
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_permutexvar_ps(sidx, sc[m]), acc[m]);
        }
      }
    }
    for (int m = 0; m < MT; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
  }
};

// ---------------------------------------------------------------- Q8_0
// Weights made unsigned by flipping the sign bit (w + 128); the 128 * sum(x) this adds is taken
// off through the block sums. Steps of two blocks.
struct Q8 {
  static constexpr int bb = 34;
  template <int MT>
  static QMV_INLINE void row(const Mat& W, const uint8_t* row, const Act& a, int64_t m0, float* out) {
    const int64_t nb = W.cols / 32, nbp = a.Kp / 32;
    const __m512i gidx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(bb));
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < nb; g += 16) {
      const int64_t ng = nb - g < 16 ? nb - g : 16;
      const __mmask16 km = (__mmask16)((1u << ng) - 1u);
      const uint8_t* gp = row + g * bb;
      const __m512i dm = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), km, gidx, gp, 1);
      const __m512 dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
      const __m512 off = _mm512_mul_ps(dw, _mm512_set1_ps(-128.f));
      __m512 sc[MT];
      for (int m = 0; m < MT; ++m) {
        const int64_t o = (m0 + m) * nbp + g;
        sc[m] = _mm512_mul_ps(dw, _mm512_loadu_ps(a.d32 + o));
        acc[m] = _mm512_fmadd_ps(off, _mm512_loadu_ps(a.s32 + o), acc[m]);
      }
      __m512i sidx = pair_index();
      for (int64_t s = 0; s < ng; s += 2, sidx = _mm512_add_epi32(sidx, _mm512_set1_epi32(2))) {
        const uint8_t* p = gp + s * bb + 2;
        __m512i v = _mm512_castsi256_si512(load256(p));
        v = _mm512_inserti64x4(v, load256(s + 1 < ng ? p + bb : p), 1);
        v = _mm512_xor_si512(v, flip);
        for (int m = 0; m < MT; ++m) {
          const int8_t* xq = a.q + (m0 + m) * a.Kp + (g + s) * 32;
          const __m512i i = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v, load512(xq));
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_permutexvar_ps(sidx, sc[m]), acc[m]);
        }
      }
    }
    for (int m = 0; m < MT; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
  }
};

// ---------------------------------------------------------------- Q4_K / Q5_K
// 256-element super-blocks of eight 32-element sub-blocks, each with a 6-bit scale and min. A step
// reads 64 bytes of nibbles (two 64-element chunks): low nibbles are sub-blocks 4t and 4t + 2, high
// nibbles 4t + 1 and 4t + 3 (activation layout Nib32). Q5_K adds the fifth bit from qh.

// The eight scales and eight mins, unpacked from their 12 bytes into bytes.
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
    const __m512i m4 = _mm512_set1_epi8(0x0F), b16 = _mm512_set1_epi8(16);
    // Lanes of the low nibbles take scales 4t (first half) and 4t + 2, of the high 4t + 1 and 4t + 3.
    const __m512i two_pair = _mm512_slli_epi32(pair_index(), 1);
    const __m512i il[2] = {two_pair, _mm512_add_epi32(two_pair, _mm512_set1_epi32(4))};
    const __m512i ih[2] = {_mm512_add_epi32(two_pair, _mm512_set1_epi32(1)),
                           _mm512_add_epi32(two_pair, _mm512_set1_epi32(5))};
    // Fifth-bit masks of step t: low nibbles use qh bits 4t (first half) and 4t + 2, high nibbles 4t + 1, 4t + 3.
    const __m512i hb_lo[2] = {_mm512_inserti64x4(_mm512_set1_epi8(0x01), _mm256_set1_epi8(0x04), 1),
                              _mm512_inserti64x4(_mm512_set1_epi8(0x10), _mm256_set1_epi8(0x40), 1)};
    const __m512i hb_hi[2] = {_mm512_inserti64x4(_mm512_set1_epi8(0x02), _mm256_set1_epi8(0x08), 1),
                              _mm512_inserti64x4(_mm512_set1_epi8(0x20), _mm256_set1_epi8((char)0x80), 1)};
    __m512 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* p = row + sb * bb;
      const float d = half(p), dmin = half(p + 2);
      uint64_t scb, mnb;
      k4_scales(p + 4, scb, mnb);
      const __m256 ds = _mm256_mul_ps(_mm256_set1_ps(d), bytes8_to_ps(scb));
      const __m512 dmn = _mm512_zextps256_ps512(_mm256_mul_ps(_mm256_set1_ps(dmin), bytes8_to_ps(mnb)));
      __m512 sc[MT];
      for (int m = 0; m < MT; ++m) {
        const int64_t o = (m0 + m) * nbp + sb * 8;
        sc[m] = _mm512_zextps256_ps512(_mm256_mul_ps(ds, _mm256_loadu_ps(a.d32 + o)));
        acc[m] = _mm512_fnmadd_ps(dmn, _mm512_zextps256_ps512(_mm256_loadu_ps(a.s32 + o)), acc[m]);
      }
      __m512i qh;
      if (Five) qh = _mm512_broadcast_i64x4(load256(p + 16));
      for (int t = 0; t < 2; ++t) {
        const __m512i v = load512(p + qoff + 64 * t);
        __m512i lo = _mm512_and_si512(v, m4);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        if (Five) {
          lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(qh, hb_lo[t]), lo, b16);
          hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(qh, hb_hi[t]), hi, b16);
        }
        for (int m = 0; m < MT; ++m) {
          const int8_t* xq = a.q + (m0 + m) * a.Kp + sb * 256 + 128 * t;
          const __m512i il32 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, load512(xq));
          const __m512i ih32 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, load512(xq + 64));
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(il32), _mm512_permutexvar_ps(il[t], sc[m]), acc[m]);
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ih32), _mm512_permutexvar_ps(ih[t], sc[m]), acc[m]);
        }
      }
    }
    for (int m = 0; m < MT; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
  }
};

// ---------------------------------------------------------------- Q6_K
// 16 sub-blocks of 16 with int8 scales; 6-bit quants offset by 32 (taken off through the 16-element
// activation sums). Each 128-element half: low nibbles of ql[0..64) with qh bits 0-1 / 2-3 are
// elements 0..63, high nibbles with qh bits 4-5 / 6-7 elements 64..127 (natural activation order).
struct Q6K {
  static constexpr int bb = 210;
  template <int MT>
  static QMV_INLINE void row(const Mat& W, const uint8_t* row, const Act& a, int64_t m0, float* out) {
    const int64_t nsb = W.cols / 256, nb16p = a.Kp / 16;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i q0 = quad_index(), four = _mm512_set1_epi32(4);
    const __m512i idx[4] = {q0, _mm512_add_epi32(q0, four), _mm512_add_epi32(q0, _mm512_set1_epi32(8)),
                            _mm512_add_epi32(q0, _mm512_set1_epi32(12))};
    __m512 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* p = row + sb * bb;
      const __m512 dsc = _mm512_mul_ps(_mm512_set1_ps(half(p + 208)),
                                       _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load128(p + 192))));
      const __m512 cor = _mm512_mul_ps(dsc, _mm512_set1_ps(-32.f));
      __m512 sc[MT];
      for (int m = 0; m < MT; ++m) {
        const int64_t o = (m0 + m) * nb16p + sb * 16;
        sc[m] = _mm512_mul_ps(dsc, _mm512_loadu_ps(a.d16 + o));
        acc[m] = _mm512_fmadd_ps(cor, _mm512_loadu_ps(a.s16 + o), acc[m]);
      }
      for (int h = 0; h < 2; ++h) {
        const __m512i v = load512(p + 64 * h);
        const __m256i qh256 = load256(p + 128 + 32 * h);
        const __m512i qh = _mm512_inserti64x4(_mm512_castsi256_si512(qh256), _mm256_srli_epi16(qh256, 2), 1);
        // lo | (qh << 4 & 0x30), hi | (qh & 0x30): ternary logic A | (B & C) = 0xF8.
        const __m512i wlo = _mm512_ternarylogic_epi32(_mm512_and_si512(v, m4), _mm512_slli_epi16(qh, 4), m30, 0xF8);
        const __m512i whi =
            _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(v, 4), m4), qh, m30, 0xF8);
        for (int m = 0; m < MT; ++m) {
          const int8_t* xq = a.q + (m0 + m) * a.Kp + sb * 256 + 128 * h;
          const __m512i ilo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wlo, load512(xq));
          const __m512i ihi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), whi, load512(xq + 64));
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ilo), _mm512_permutexvar_ps(idx[2 * h], sc[m]), acc[m]);
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ihi), _mm512_permutexvar_ps(idx[2 * h + 1], sc[m]), acc[m]);
        }
      }
    }
    for (int m = 0; m < MT; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
  }
};

// ---------------------------------------------------------------- F32 / F16 / BF16
// Float32 products with four partial sums per activation row; the row's tail is masked.
enum class FT { F32, F16, BF16 };

template <FT T>
QMV_INLINE __m512 load_w(const uint8_t* row, int64_t k) {
  if constexpr (T == FT::F32) return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + k);
  else if constexpr (T == FT::F16) return _mm512_cvtph_ps(load256(row + 2 * k));
  else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load256(row + 2 * k)), 16));
}
template <FT T>
QMV_INLINE __m512 load_w_masked(const uint8_t* row, int64_t k, __mmask16 km) {
  if constexpr (T == FT::F32) return _mm512_maskz_loadu_ps(km, reinterpret_cast<const float*>(row) + k);
  else if constexpr (T == FT::F16) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(km, row + 2 * k));
  else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(km, row + 2 * k)), 16));
}

template <FT T>
struct Flt {
  template <int MT>
  static QMV_INLINE void row(const Mat& W, const uint8_t* row, const Act& a, int64_t m0, float* out) {
    const int64_t K = W.cols;
    __m512 acc[MT][4];
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
      __m512 w[4];
      for (int j = 0; j < 4; ++j) w[j] = load_w<T>(row, k + 16 * j);
      for (int m = 0; m < MT; ++m) {
        const float* x = a.x + (m0 + m) * K + k;
        for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_fmadd_ps(w[j], _mm512_loadu_ps(x + 16 * j), acc[m][j]);
      }
    }
    for (int j = 0; k < K; k += 16, ++j) {
      const int64_t left = K - k;
      const __mmask16 km = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
      const __m512 w = load_w_masked<T>(row, k, km);
      for (int m = 0; m < MT; ++m)
        acc[m][j] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(km, a.x + (m0 + m) * K + k), acc[m][j]);
    }
    for (int m = 0; m < MT; ++m)
      out[m] = _mm512_reduce_add_ps(
          _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3])));
  }
};

}  // namespace

Kernel kernel_avx512(io::GGMLType t) {
  using io::GGMLType;
  switch (t) {
    case GGMLType::Q4_0: return {rows_driver<Q4<false>>, ActLayout::Nib16, true};
    case GGMLType::Q4_1: return {rows_driver<Q4<true>>, ActLayout::Nib16, true};
    case GGMLType::Q8_0: return {rows_driver<Q8>, ActLayout::Natural, true};
    case GGMLType::Q4_K: return {rows_driver<QK45<false>>, ActLayout::Nib32, true};
    case GGMLType::Q5_K: return {rows_driver<QK45<true>>, ActLayout::Nib32, true};
    case GGMLType::Q6_K: return {rows_driver<Q6K>, ActLayout::Natural, true};
    case GGMLType::F32: return {rows_driver<Flt<FT::F32>>, ActLayout::Natural, false};
    case GGMLType::F16: return {rows_driver<Flt<FT::F16>>, ActLayout::Natural, false};
    case GGMLType::BF16: return {rows_driver<Flt<FT::BF16>>, ActLayout::Natural, false};
    default: return {nullptr, ActLayout::Natural, false};
  }
}

}  // namespace focus::cpu::qmv
