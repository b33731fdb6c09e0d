// Force-included into the library sources of the clang builds (fuzzing, ThreadSanitizer): GCC's __builtin_shuffle (one
// or two vectors and an index vector, indices taken modulo the lane count) for clang, which
// spells vector shuffles differently (element-wise, so slow, but exact), and a CPU feature
// test clang 14 lacks.
#pragma once
#if defined(__clang__) && defined(__cplusplus)

namespace focus_fuzz_compat {
template <class V, class M>
inline V shuffle1(V x, M m) {
  constexpr int n = sizeof(V) / sizeof(x[0]);
  V r = x;
  for (int i = 0; i < n; ++i) r[i] = x[m[i] & (n - 1)];
  return r;
}
template <class V, class M>
inline V shuffle2(V a, V b, M m) {
  constexpr int n = sizeof(V) / sizeof(a[0]);
  V r = a;
  for (int i = 0; i < n; ++i) {
    const int j = m[i] & (2 * n - 1);
    r[i] = j < n ? a[j] : b[j - n];
  }
  return r;
}

// clang 14's __builtin_cpu_supports does not know "f16c": that one is read from CPUID leaf 1.
inline bool cpu_supports(const char* f) {
  auto is = [f](const char* s) { return __builtin_strcmp(f, s) == 0; };
  if (is("f16c")) {
    unsigned a = 0, b = 0, c = 0, d = 0;
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
    return (c >> 29) & 1;
  }
  if (is("avx2")) return __builtin_cpu_supports("avx2");
  if (is("fma")) return __builtin_cpu_supports("fma");
  if (is("avx512f")) return __builtin_cpu_supports("avx512f");
  if (is("avx512bw")) return __builtin_cpu_supports("avx512bw");
  if (is("avx512dq")) return __builtin_cpu_supports("avx512dq");
  if (is("avx512vl")) return __builtin_cpu_supports("avx512vl");
  if (is("avx512vnni")) return __builtin_cpu_supports("avx512vnni");
  return false;
}
}  // namespace focus_fuzz_compat
#define __builtin_cpu_supports(f) focus_fuzz_compat::cpu_supports(f)

#define FOCUS_FUZZ_SHUFFLE_PICK(a, b, c, name, ...) name
#define __builtin_shuffle(...) \
  FOCUS_FUZZ_SHUFFLE_PICK(__VA_ARGS__, focus_fuzz_compat::shuffle2, focus_fuzz_compat::shuffle1, unused)(__VA_ARGS__)

#endif
