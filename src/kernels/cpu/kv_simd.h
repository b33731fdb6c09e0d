// Vectors of simd::kV cached elements (kv_types.h) widened to floats, for the attention kernels.
#pragma once
#include <cstdint>
#include <cstring>

#include "kernels/cpu/kv_types.h"
#include "kernels/cpu/simd.h"

namespace focus::cpu {

inline simd::vf kv_load_vec(const float* p) { return simd::load(p); }
inline simd::vf kv_load_vec(const BHalf* p) {
  typedef uint16_t vu16 __attribute__((vector_size(simd::kV * 2)));
  typedef uint32_t vu32 __attribute__((vector_size(simd::kV * 4)));
  vu16 h;
  std::memcpy(&h, p, sizeof(h));
  const vu32 w = __builtin_convertvector(h, vu32) << 16;
  return (simd::vf)w;
}
inline simd::vf kv_load_vec(const Half* p) {
#if defined(__AVX512F__)
  // The zero-masking form: the plain one leaves its pass-through operand undefined, which GCC
  // reports as possibly uninitialised.
  return (simd::vf)_mm512_maskz_cvtph_ps((__mmask16)0xffff, _mm256_loadu_si256((const __m256i*)p));
#elif defined(__F16C__) && defined(__AVX__)
  return (simd::vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
  simd::vf r;
  for (int i = 0; i < simd::kV; ++i) r[i] = kv_load(p + i);
  return r;
#endif
}

}  // namespace focus::cpu
