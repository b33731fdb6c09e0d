// The element types a KV cache can hold (float32, IEEE half, bfloat16), views of cached rows of
// any of them, and the conversions: a cached element widened to float, a float rounded to what
// the cache stores (the vector forms for the kernels: kv_simd.h). Rounding is to nearest, ties to
// even, for both 16-bit types; bfloat16 keeps float32's range, half keeps 11 significant bits
// but overflows beyond 65504 (such values become infinite, as in any half-precision cache).
#pragma once
#include <cstdint>
#include <cstring>
#include <string>

#include "io/ggml_types.h"

namespace focus::cpu {

enum class KvType : uint8_t { F32, F16, BF16 };

KvType parse_kv_type(const std::string& s);  // "f32", "f16", "bf16"; throws Error
std::string to_string(KvType t);
inline int64_t kv_type_bytes(KvType t) { return t == KvType::F32 ? 4 : 2; }

// Element tags for the two 16-bit types (the bits as stored).
struct Half {
  uint16_t bits;
};
struct BHalf {
  uint16_t bits;
};

// Rows of a cache: element j of row r is at data + r * stride + j (stride in elements).
struct KvView {
  const void* data = nullptr;
  KvType type = KvType::F32;
  KvView() = default;
  KvView(const float* p) : data(p), type(KvType::F32) {}  // NOLINT: a float array is a view
  KvView(const void* p, KvType t) : data(p), type(t) {}
  template <class E>
  const E* as() const {
    return static_cast<const E*>(data);
  }
};

// Calls f(E{}) with E the element type of t (float, Half or BHalf).
template <class F>
decltype(auto) with_kv_type(KvType t, F&& f) {
  switch (t) {
    case KvType::F16: return f(Half{});
    case KvType::BF16: return f(BHalf{});
    default: return f(float{});
  }
}

// ---- scalars.
inline float kv_load(const float* p) { return *p; }
inline float kv_load(const Half* p) { return io::fp16_to_fp32(p->bits); }
inline float kv_load(const BHalf* p) {
  const uint32_t u = (uint32_t)p->bits << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// dst[0 .. n) = src rounded to type t (stored as t's elements).
void kv_store(const float* src, int64_t n, KvType t, void* dst);
// dst[0 .. n) = the cached elements as floats.
void kv_load_floats(KvView src, int64_t n, float* dst);
// x[0 .. n) replaced by the float value of its rounding to t (what a cache of type t gives back).
void kv_round(float* x, int64_t n, KvType t);

}  // namespace focus::cpu
