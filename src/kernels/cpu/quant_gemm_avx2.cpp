// quant_gemm's inner kernel for AVX2 + FMA (CPUs without AVX-512 VNNI). The panel and the
// activations are those of the AVX-512 kernel (quant_gemm_avx512.cpp): 32 weight rows of signed
// bytes interleaved so that 32 bytes hold four consecutive elements of 8 rows, and each token's
// bytes as u = q + 128. AVX2 has no four-byte dot product: vpmaddubsw multiplies unsigned by
// signed bytes and adds neighbouring pairs into saturating 16-bit lanes, and vpmaddwd by ones adds
// those pairs into the 32-bit lane of one row. A pair is at most 2 * 255 * max|w| (GemmPanel::
// max_abs_q), so S steps' pairs can be added in 16 bits first while S * 2 * 255 * max|w| < 2^15:
// four steps for 4-bit weights (and Q5_0's [-16, 15]), two for Q5_1, Q5_K and Q6_K ([-32, 31]).
// Q8_0's pairs would overflow: its panels take signed activations instead, vpmaddubsw(|w|,
// sign(q, w)) = w q per byte, a pair at most 2 * 128 * 127. Every integer sum is exact, so each
// group's sum is what vpdpbusd gives, and the float steps are the AVX-512 kernel's, in the same order.
// A tile is NR tokens times 16 rows (half a panel): AVX2 has 16 vector registers, which hold the
// tile's 16- and 32-bit integer sums; its float sums, updated once per group, stay in memory.
// Internal linkage except for the one entry point, as in quant_matvec_avx2.cpp.
#include <immintrin.h>

#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "kernels/cpu/quant_matvec_impl.h"

namespace focus::cpu::qmv {
namespace {

#define QG_INLINE inline __attribute__((always_inline))

QG_INLINE int32_t rd32(const uint8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return v;
}

// One step of four elements for 8 rows: per 16-bit lane, a row's two byte products with the
// token's bytes x, added. Signed: x holds q (not q + 128), and |w| times sign(q, w) is w q.
template <bool Signed>
QG_INLINE __m256i pairs(__m256i x, __m256i w) {
  if constexpr (Signed) return _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
  else return _mm256_maddubs_epi16(x, w);
}

// Outputs y[m0 + j, n0 + r0 + 0..15] for j < NR, r0 = 16 * half. GS: elements per group (16 or
// 32); HasB: the weights have per-group offsets (w = A q + B); S: steps whose pairs are added in
// 16 bits before they are widened (S * 2 * 255 * max |w| < 2^15); Signed: a Q8_0 panel (S = 1).
template <int NR, int GS, bool HasB, int S, bool Signed>
void tile(const GemmPanel& p, const GemmAct& a, int64_t m0, int half, float* y, int64_t ldy, int64_t n0) {
  constexpr int kSteps = GS / 4;
  static_assert(kSteps % S == 0, "a group is whole runs of S steps");
  const int64_t ng = p.K / GS;
  const int r0 = 16 * half;
  alignas(32) float facc[NR][16] = {};  // the tile's outputs so far
  const uint8_t* act[NR];
  const float* dact[NR];
  const float* sact[NR];
  for (int j = 0; j < NR; ++j) {
    act[j] = a.u + (m0 + j) * a.Kp;
    dact[j] = a.d32 + (m0 + j) * a.nb32;
    sact[j] = a.s16 + (m0 + j) * a.nb16;
  }
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
  // A step's 128 bytes are [32 rows][4 elements]: rows r0 .. r0 + 15 are its bytes 4 r0 .. 4 r0 + 63.
  const int8_t* wq = p.q + 4 * r0;
  for (int64_t g = 0; g < ng; ++g) {
    __m256i i0[NR], i1[NR];
    if constexpr (Signed) {
      for (int j = 0; j < NR; ++j) i0[j] = i1[j] = _mm256_setzero_si256();
    } else {
      // -128 * (the group's weight sum) takes the +128 of the activations back out.
      const __m256i c0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.negcorr + g * 32 + r0));
      const __m256i c1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.negcorr + g * 32 + r0 + 8));
      for (int j = 0; j < NR; ++j) i0[j] = c0, i1[j] = c1;
    }
    const uint8_t* xg[NR];
    for (int j = 0; j < NR; ++j) xg[j] = act[j] + g * GS;
    for (int t0 = 0; t0 < kSteps; t0 += S) {
      __m256i h0[NR], h1[NR];  // S steps' pairs in 16 bits
      for (int t = t0; t < t0 + S; ++t, wq += 128) {
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq));
        const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + 32));
        for (int j = 0; j < NR; ++j) {
          __m256i x = _mm256_set1_epi32(rd32(xg[j] + 4 * t));
          if constexpr (Signed) x = _mm256_xor_si256(x, flip);  // q + 128 back to q
          const __m256i p0 = pairs<Signed>(x, w0), p1 = pairs<Signed>(x, w1);
          h0[j] = t == t0 ? p0 : _mm256_add_epi16(h0[j], p0);
          h1[j] = t == t0 ? p1 : _mm256_add_epi16(h1[j], p1);
        }
      }
      for (int j = 0; j < NR; ++j) {
        i0[j] = _mm256_add_epi32(i0[j], _mm256_madd_epi16(h0[j], ones));
        i1[j] = _mm256_add_epi32(i1[j], _mm256_madd_epi16(h1[j], ones));
      }
    }
    const __m256 A0 = _mm256_loadu_ps(p.A + g * 32 + r0), A1 = _mm256_loadu_ps(p.A + g * 32 + r0 + 8);
    const int64_t b32 = g * GS / 32;
    for (int j = 0; j < NR; ++j) {
      const __m256 d = _mm256_set1_ps(dact[j][b32]);
      __m256 f0 = _mm256_load_ps(facc[j]), f1 = _mm256_load_ps(facc[j] + 8);
      f0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0[j]), _mm256_mul_ps(A0, d), f0);
      f1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1[j]), _mm256_mul_ps(A1, d), f1);
      _mm256_store_ps(facc[j], f0); _mm256_store_ps(facc[j] + 8, f1);
    }
    if constexpr (HasB) {
      const __m256 B0 = _mm256_loadu_ps(p.B + g * 32 + r0), B1 = _mm256_loadu_ps(p.B + g * 32 + r0 + 8);
      for (int j = 0; j < NR; ++j) {
        // The group's activation sum (scaled): one 16-sum, or two for a 32-group.
        const float s = GS == 16 ? sact[j][g] : sact[j][2 * g] + sact[j][2 * g + 1];
        const __m256 sv = _mm256_set1_ps(s);
        _mm256_store_ps(facc[j], _mm256_fmadd_ps(B0, sv, _mm256_load_ps(facc[j])));
        _mm256_store_ps(facc[j] + 8, _mm256_fmadd_ps(B1, sv, _mm256_load_ps(facc[j] + 8)));
      }
    }
  }
  const int n = p.rows - r0;  // rows of this half that exist (1 .. 16)
  if (n >= 16) {
    for (int j = 0; j < NR; ++j) {
      float* out = y + (m0 + j) * ldy + n0 + r0;
      _mm256_storeu_ps(out, _mm256_load_ps(facc[j]));
      _mm256_storeu_ps(out + 8, _mm256_load_ps(facc[j] + 8));
    }
    return;
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i k0m = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane);
  const __m256i k1m = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8), lane);
  for (int j = 0; j < NR; ++j) {
    float* out = y + (m0 + j) * ldy + n0 + r0;
    _mm256_maskstore_ps(out, k0m, _mm256_load_ps(facc[j]));
    _mm256_maskstore_ps(out + 8, k1m, _mm256_load_ps(facc[j] + 8));
  }
}

template <int GS, bool HasB, int S, bool Signed>
void panel_all_rows(const GemmPanel& p, const GemmAct& a, float* y, int64_t ldy, int64_t n0) {
  constexpr int NR = Signed ? 3 : 2;  // tokens per tile (measured best on Zen 3)
  for (int half = 0; half < 2 && 16 * half < p.rows; ++half) {
    int64_t m = 0;
    for (; m + NR <= a.M; m += NR) tile<NR, GS, HasB, S, Signed>(p, a, m, half, y, ldy, n0);
    if (a.M - m == 2) tile<2, GS, HasB, S, Signed>(p, a, m, half, y, ldy, n0);
    else if (a.M - m == 1) tile<1, GS, HasB, S, Signed>(p, a, m, half, y, ldy, n0);
  }
}

template <int S, bool Signed>
void panel(const GemmPanel& p, const GemmAct& a, float* y, int64_t ldy, int64_t n0) {
  if (p.group == 16) {
    if (p.has_b) panel_all_rows<16, true, S, Signed>(p, a, y, ldy, n0);
    else panel_all_rows<16, false, S, Signed>(p, a, y, ldy, n0);
  } else {
    if (p.has_b) panel_all_rows<32, true, S, Signed>(p, a, y, ldy, n0);
    else panel_all_rows<32, false, S, Signed>(p, a, y, ldy, n0);
  }
}

}  // namespace

void gemm_panel_avx2(const GemmPanel& p, const GemmAct& a, float* y, int64_t ldy, int64_t n0) {
  // A pair is at most 2 * 255 * max|w| in 16 bits (32767).
  if (p.max_abs_q <= 16) panel<4, false>(p, a, y, ldy, n0);
  else if (p.max_abs_q <= 32) panel<2, false>(p, a, y, ldy, n0);
  else panel<1, true>(p, a, y, ldy, n0);
}

}  // namespace focus::cpu::qmv
