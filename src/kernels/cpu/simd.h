// Native-width float vectors for the CPU kernels, via GCC vector extensions: one vector is one
// register of the widest vector unit the build targets (16 floats with AVX-512, 8 with AVX / AVX2,
// 4 otherwise), so no operation is split into pieces or bounced through memory.
//
// Also here: the register blocking of the micro-kernels built on these vectors, which depends on
// the size of the register file (32 vector registers with AVX-512, 16 without).
#pragma once
#include <cstdint>
#include <cstring>
#include <utility>
#if defined(__x86_64__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace focus::cpu::simd {

#if defined(__AVX512F__)
inline constexpr int kV = 16;  // floats per vector
#elif defined(__AVX__)
inline constexpr int kV = 8;
#else
inline constexpr int kV = 4;
#endif
static_assert((kV & (kV - 1)) == 0, "the lane count must be a power of two");

typedef float vf __attribute__((vector_size(kV * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(kV * sizeof(int32_t))));

// ---- register blocking (accumulators = rows x vectors; a few more registers hold the operands).
// With 16 registers the blocks stop at 12 accumulators: 16 spill accumulators to the stack in
// every step (measured on Zen 3: 4 x 4 runs at about two thirds of the speed of 4 x 3), and 8
// only just cover the FMA latency. A 64-key tile row (8 vectors) goes as 3 + 3 + 2.
#if defined(__AVX512F__)
inline constexpr int kScoreVecs = 4;  // key vectors per Q.K^T block of 4 query rows: 16 accumulators
inline constexpr int kPvVecs = 4;     // output vectors per P.V block of 4 rows: 16 accumulators
inline constexpr int kGemmRows = 6;   // small GEMM (soft attention): 6 x 4 = 24 accumulators
inline constexpr int kGemmVecs = 4;
#else
inline constexpr int kScoreVecs = 3;  // 12 accumulators + 3 key vectors + 1 broadcast = 16 registers
inline constexpr int kPvVecs = 3;     // 12 accumulators + 3 value vectors + 1 broadcast
inline constexpr int kGemmRows = 4;   // 4 x 3 = 12 accumulators + 3 B vectors + 1 broadcast
inline constexpr int kGemmVecs = 3;
#endif

// x rounded up to a whole number of vectors.
inline constexpr int64_t round_up(int64_t x) { return (x + kV - 1) / kV * kV; }

// Calls f.template operator()<N>() with N == n, for 1 <= n <= Max (nothing otherwise).
template <int Max, class F>
inline void with_count(int n, F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) {
    (void)((n == I + 1 ? (f.template operator()<I + 1>(), true) : false) || ...);
  }(std::make_integer_sequence<int, Max>{});
}

// Splits n vectors into the fewest chunks of at most Max vectors, of sizes as equal as possible
// (larger first), and calls f.template operator()<N>(first) for each: N vectors from vector
// `first` on. Equal chunks keep every block's accumulator chains long enough to hide the FMA
// latency (a 7-vector row becomes 3 + 2 + 2, not 3 + 3 + 1).
template <int Max, class F>
inline void for_chunks(int n, F&& f) {
  const int chunks = (n + Max - 1) / Max;
  for (int i = 0, first = 0; i < chunks; ++i) {
    const int len = n / chunks + (i < n % chunks ? 1 : 0);
    with_count<Max>(len, [&]<int N>() { f.template operator()<N>(first); });
    first += len;
  }
}

// ---- basic operations.
namespace detail {
template <int... J>
inline vf splat(float x, std::integer_sequence<int, J...>) {
  return vf{((void)J, x)...};
}
}  // namespace detail
// x in every lane. Written as a lane list, not as vf{} + x: adding zero is not exact for -0, so
// the compiler would have to do the add before broadcasting.
inline vf bcast(float x) { return detail::splat(x, std::make_integer_sequence<int, kV>{}); }
inline vf load(const float* p) {
  vf r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
inline vi loadi(const int32_t* p) {
  vi r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
inline void store(float* p, vf x) { std::memcpy(p, &x, sizeof(x)); }
// A load kept in a register: stops the compiler from folding it into every FMA that uses it,
// which would turn one load per micro-kernel step into one per row.
inline vf load_reg(const float* p) {
  vf r = load(p);
#if defined(__x86_64__) && defined(__AVX512F__)
  asm("" : "+v"(r));
#elif defined(__x86_64__) && defined(__SSE__)
  asm("" : "+x"(r));
#endif
  return r;
}
// a * b + c with one rounding wherever the hardware has FMA. Written out rather than left to
// contraction: GCC's tuning for some cores (AMD Zen) turns a lone loop-carried a += b * c chain
// back into a multiply and an add, so a 1 x 1 block would round differently from a 4 x 3 block
// and a row's bits would depend on the rows it is computed with.
inline vf vfma(vf a, vf b, vf c) {
#if defined(__x86_64__) && defined(__FMA__) && defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__x86_64__) && defined(__FMA__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
// Bit j set where lane j of a comparison's mask is true (all ones).
inline uint32_t lane_bits(vi m) {
#if defined(__x86_64__) && defined(__FMA__) && defined(__AVX512F__)
  return (uint32_t)_mm512_cmplt_epi32_mask((__m512i)m, _mm512_setzero_si512());
#elif defined(__x86_64__) && defined(__FMA__)
  return (uint32_t)_mm256_movemask_ps((__m256)m);
#else
  uint32_t b = 0;
  for (int j = 0; j < kV; ++j) b |= (uint32_t)(m[j] < 0) << j;
  return b;
#endif
}
inline vf select(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }

namespace detail {
template <int... J>
constexpr vi iota_lanes(std::integer_sequence<int, J...>) {
  return vi{J...};
}
// Lane j takes lane j ^ B: swaps neighbouring blocks of B lanes.
template <int B, int... J>
constexpr vi xor_lanes(std::integer_sequence<int, J...>) {
  return vi{(J ^ B)...};
}
template <int B>
inline constexpr vi kXor = xor_lanes<B>(std::make_integer_sequence<int, kV>{});
}  // namespace detail

// {0, 1, .., kV - 1}.
inline constexpr vi iota = detail::iota_lanes(std::make_integer_sequence<int, kV>{});

// Reductions over the lanes: log2(kV) halving steps, each combining every lane with its partner
// B lanes away (a fixed order, so the result depends only on the lane values).
template <int B = kV / 2>
inline float hmax(vf x) {
  x = vmax(x, __builtin_shuffle(x, detail::kXor<B>));
  if constexpr (B > 1)
    return hmax<B / 2>(x);
  else
    return x[0];
}
template <int B = kV / 2>
inline float hsum(vf x) {
  x += __builtin_shuffle(x, detail::kXor<B>);
  if constexpr (B > 1)
    return hsum<B / 2>(x);
  else
    return x[0];
}

// ---- kV x kV transpose held in kV registers: r[i][j] <-> r[j][i].
namespace detail {
// One step swaps the off-diagonal B x B blocks of every 2B x 2B block: rows i and i + B exchange
// the halves selected by bit B of the column.
template <int B, bool Upper>
constexpr int transpose_lane(int j) {
  return Upper ? ((j & B) ? kV + j : j + B) : ((j & B) ? kV + j - B : j);
}
template <int B, bool Upper, int... J>
constexpr vi transpose_mask(std::integer_sequence<int, J...>) {
  return vi{transpose_lane<B, Upper>(J)...};
}
template <int B>
inline void transpose_step(vf (&r)[kV]) {
  constexpr vi m_lo = transpose_mask<B, false>(std::make_integer_sequence<int, kV>{});
  constexpr vi m_hi = transpose_mask<B, true>(std::make_integer_sequence<int, kV>{});
  for (int i = 0; i < kV; ++i) {
    if (i & B) continue;
    const vf a = r[i], b = r[i + B];
    r[i] = __builtin_shuffle(a, b, m_lo);
    r[i + B] = __builtin_shuffle(a, b, m_hi);
  }
}
}  // namespace detail
// log2(kV) steps, on blocks of 1, 2, .., kV / 2.
template <int B = 1>
inline void transpose(vf (&r)[kV]) {
  detail::transpose_step<B>(r);
  if constexpr (2 * B < kV) transpose<2 * B>(r);
}

// ---- exp and log.

// e^x for x <= 0 as 2^n 2^f: n = round(x log2 e), f in [-1/2, 1/2], 2^f by a degree-5 minimax
// polynomial (relative error about 2e-7). Inputs below -87 give e^-87 (about 1e-38), not 0.
inline vf vexp_clamped(vf x) {
  const vf magic = bcast(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf t = vmax(x, bcast(-87.f)) * 1.44269504088896341f;
  const vf tn = t + magic;
  const vf f = t - (tn - magic);
  vf p = bcast(1.3264722656e-3f);
  p = p * f + 9.6715129912e-3f;
  p = p * f + 5.5507335812e-2f;
  p = p * f + 2.4022242427e-1f;
  p = p * f + 6.9314700365e-1f;
  p = p * f + 1.f;
  const vi e = ((vi)tn - ((vi)magic - 127)) << 23;  // 2^n in the exponent field
  return p * (vf)e;
}
// The same, but exactly 0 below -87 (and for -inf, the masked scores).
inline vf vexp(vf x) { return select(x >= -87.f, vexp_clamped(x), vf{}); }

// exp(x) for any x (Cephes polynomial, ~1 ulp); exactly 0 for x < -87.3, so exp(-inf) = 0;
// inputs above 88 give e^88.
inline vf vexp_cephes(vf x) {
  const vi tiny = x < bcast(-87.33654f);
  x = tiny ? bcast(-87.33654f) : x;
  x = x > bcast(88.0f) ? bcast(88.0f) : x;
  const vf magic = bcast(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf fx = (x * 1.44269504088896341f + magic) - magic;
  const vf r = x - fx * 0.693359375f + fx * 2.12194440e-4f;
  vf y = bcast(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  const vi bits = (__builtin_convertvector(fx, vi) + 127) << 23;
  vf pow2;
  std::memcpy(&pow2, &bits, sizeof(pow2));
  y *= pow2;
  return tiny ? vf{} : y;
}

// log(x) per lane for positive normal x (Cephes polynomial, ~1 ulp).
inline vf vlog(vf x) {
  vi bits;
  std::memcpy(&bits, &x, sizeof(bits));
  vf e = __builtin_convertvector(((bits >> 23) & 0xff) - 126, vf);  // x = m * 2^e, m in [0.5, 1)
  const vi mb = (bits & 0x007fffff) | 0x3f000000;
  vf m;
  std::memcpy(&m, &mb, sizeof(m));
  const vi small = m < bcast(0.707106781186547524f);
  e = small ? e - 1.f : e;
  m = small ? m + m - 1.f : m - 1.f;
  const vf z = m * m;
  vf y = bcast(7.0376836292e-2f);
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m * z;
  y += e * -2.12194440e-4f;
  y -= 0.5f * z;
  return m + y + e * 0.693359375f;
}

}  // namespace focus::cpu::simd
