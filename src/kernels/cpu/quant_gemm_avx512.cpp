// quant_gemm's inner kernel for AVX-512 F/BW/VL with VNNI (compiled with those flags; called only
// when the CPU has them). A panel holds 32 weight rows as signed bytes, interleaved so that one
// 64-byte load gives four consecutive elements of 16 rows; the activations are unsigned bytes
// (the signed value + 128), and one vpdpbusd multiplies four of a token's bytes, broadcast to all
// lanes, with the four bytes of each of 16 rows. Every lane is one output, so no horizontal sums
// are needed. The integer accumulators start at -128 * (sum of the group's weight bytes), which
// removes the +128 of the activations exactly; each group's sum is then scaled in float32.
// Internal linkage except for the one entry point, as in quant_matvec_avx512.cpp.
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

// Outputs y[m0 + j, n0 + 0..31] for j < NR. GS: elements per group (16 or 32); HasB: the weights
// have per-group offsets (w = A q + B).
template <int NR, int GS, bool HasB>
void tile(const GemmPanel& p, const GemmAct& a, int64_t m0, float* y, int64_t ldy, int64_t n0) {
  constexpr int kSteps = GS / 4;
  const int64_t ng = p.K / GS;
  __m512 f0[NR], f1[NR];
  for (int j = 0; j < NR; ++j) f0[j] = f1[j] = _mm512_setzero_ps();
  const uint8_t* act[NR];
  const float* dact[NR];
  const float* sact[NR];
  for (int j = 0; j < NR; ++j) {
    act[j] = a.u + (m0 + j) * a.Kp;
    dact[j] = a.d32 + (m0 + j) * a.nb32;
    sact[j] = a.s16 + (m0 + j) * a.nb16;
  }
  const int8_t* wq = p.q;
  for (int64_t g = 0; g < ng; ++g) {
    const __m512i c0 = _mm512_loadu_si512(p.negcorr + g * 32), c1 = _mm512_loadu_si512(p.negcorr + g * 32 + 16);
    __m512i i0[NR], i1[NR];
    for (int j = 0; j < NR; ++j) i0[j] = c0, i1[j] = c1;
    const int64_t k0 = g * GS;
    for (int t = 0; t < kSteps; ++t, wq += 128) {
      const __m512i w0 = _mm512_loadu_si512(wq), w1 = _mm512_loadu_si512(wq + 64);
      for (int j = 0; j < NR; ++j) {
        const __m512i x = _mm512_set1_epi32(rd32(act[j] + k0 + 4 * t));
        i0[j] = _mm512_dpbusd_epi32(i0[j], x, w0);
        i1[j] = _mm512_dpbusd_epi32(i1[j], x, w1);
      }
    }
    const __m512 A0 = _mm512_loadu_ps(p.A + g * 32), A1 = _mm512_loadu_ps(p.A + g * 32 + 16);
    const int64_t b32 = k0 / 32;
    for (int j = 0; j < NR; ++j) {
      const __m512 d = _mm512_set1_ps(dact[j][b32]);
      f0[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0[j]), _mm512_mul_ps(A0, d), f0[j]);
      f1[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1[j]), _mm512_mul_ps(A1, d), f1[j]);
    }
    if constexpr (HasB) {
      const __m512 B0 = _mm512_loadu_ps(p.B + g * 32), B1 = _mm512_loadu_ps(p.B + g * 32 + 16);
      for (int j = 0; j < NR; ++j) {
        // The group's activation sum (scaled): one 16-sum, or two for a 32-group.
        const float s = GS == 16 ? sact[j][g] : sact[j][2 * g] + sact[j][2 * g + 1];
        const __m512 sv = _mm512_set1_ps(s);
        f0[j] = _mm512_fmadd_ps(B0, sv, f0[j]);
        f1[j] = _mm512_fmadd_ps(B1, sv, f1[j]);
      }
    }
  }
  const int rows = p.rows;
  const __mmask16 k0m = (__mmask16)(rows >= 16 ? 0xFFFF : (1u << rows) - 1);
  const __mmask16 k1m = (__mmask16)(rows >= 32 ? 0xFFFF : rows <= 16 ? 0 : (1u << (rows - 16)) - 1);
  for (int j = 0; j < NR; ++j) {
    float* out = y + (m0 + j) * ldy + n0;
    _mm512_mask_storeu_ps(out, k0m, f0[j]);
    _mm512_mask_storeu_ps(out + 16, k1m, f1[j]);
  }
}

template <int GS, bool HasB>
void panel_all_rows(const GemmPanel& p, const GemmAct& a, float* y, int64_t ldy, int64_t n0) {
  constexpr int NR = 6;  // tokens per tile (4 measured the same on Gemma 3 prefill)
  int64_t m = 0;
  for (; m + NR <= a.M; m += NR) tile<NR, GS, HasB>(p, a, m, y, ldy, n0);
  switch (a.M - m) {
    case 5: tile<5, GS, HasB>(p, a, m, y, ldy, n0); break;
    case 4: tile<4, GS, HasB>(p, a, m, y, ldy, n0); break;
    case 3: tile<3, GS, HasB>(p, a, m, y, ldy, n0); break;
    case 2: tile<2, GS, HasB>(p, a, m, y, ldy, n0); break;
    case 1: tile<1, GS, HasB>(p, a, m, y, ldy, n0); break;
    default: break;
  }
}

}  // namespace

void gemm_panel_avx512(const GemmPanel& p, const GemmAct& a, float* y, int64_t ldy, int64_t n0) {
  if (p.group == 16) {
    if (p.has_b) panel_all_rows<16, true>(p, a, y, ldy, n0);
    else panel_all_rows<16, false>(p, a, y, ldy, n0);
  } else {
    if (p.has_b) panel_all_rows<32, true>(p, a, y, ldy, n0);
    else panel_all_rows<32, false>(p, a, y, ldy, n0);
  }
}

}  // namespace focus::cpu::qmv
