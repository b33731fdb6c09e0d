#include "kernels/cpu/kv_types.h"

#include <algorithm>

#include "core/error.h"
#include "kernels/cpu/kv_simd.h"

namespace focus::cpu {

KvType parse_kv_type(const std::string& s) {
  if (s == "f32") return KvType::F32;
  if (s == "f16") return KvType::F16;
  if (s == "bf16") return KvType::BF16;
  fail("unknown KV cache type '", s, "' (expected f32, f16 or bf16)");
}

std::string to_string(KvType t) {
  switch (t) {
    case KvType::F16: return "f16";
    case KvType::BF16: return "bf16";
    default: return "f32";
  }
}

void kv_store(const float* src, int64_t n, KvType t, void* dst) {
  if (t == KvType::F32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  auto* d = static_cast<uint16_t*>(dst);
  int64_t i = 0;
  if (t == KvType::F16) {
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
      _mm256_storeu_si256((__m256i*)(d + i),
                          _mm512_maskz_cvtps_ph((__mmask16)0xffff, _mm512_loadu_ps(src + i),
                                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128((__m128i*)(d + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; i < n; ++i) d[i] = io::fp32_to_fp16(src[i]);
  } else {
    for (; i < n; ++i) d[i] = io::fp32_to_bf16(src[i]);
  }
}

void kv_load_floats(KvView src, int64_t n, float* dst) {
  with_kv_type(src.type, [&](auto tag) {
    using E = decltype(tag);
    const E* s = src.as<E>();
    int64_t i = 0;
    for (; i + simd::kV <= n; i += simd::kV) simd::store(dst + i, kv_load_vec(s + i));
    for (; i < n; ++i) dst[i] = kv_load(s + i);
  });
}

void kv_round(float* x, int64_t n, KvType t) {
  if (t == KvType::F32) return;
  uint16_t buf[256];
  for (int64_t i0 = 0; i0 < n; i0 += 256) {
    const int64_t m = std::min<int64_t>(256, n - i0);
    kv_store(x + i0, m, t, buf);
    kv_load_floats(KvView(buf, t), m, x + i0);
  }
}

}  // namespace focus::cpu
