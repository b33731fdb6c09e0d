// quant_matvec kernels for AVX-512 F/BW/VL with VNNI (this file is compiled with those flags; it
// is only called when the CPU has them). Integer dot products use vpdpbusd (unsigned weight bytes
// times signed activation bytes, four products per 32-bit lane); offsets and mins of the weights
// are applied through the activations' block sums. Block scales are applied in float32 lane by
// lane (each lane's four products belong to one block or sub-block). Everything here has internal
// linkage, so nothing compiled with these flags can be picked by the linker for code that runs on
// other CPUs.
#include <immintrin.h>

#include <cstring>

// GCC 12's AVX-512 headers build casts and extracts on _mm*_undefined_*() values, which
// -Wmaybe-uninitialized reports once inlined; the values are never read.
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

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
// Sum of the 16 lanes, in a fixed order.
QMV_INLINE float hsum(__m512 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
  v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_cvtss_f32(v);
}
QMV_INLINE __m512i load512(const void* p) { return _mm512_loadu_si512(p); }
QMV_INLINE __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
QMV_INLINE __m128i load128(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }

// Weights come from memory once per product (a model's weights do not fit in the caches), so the
// bytes [from, to) of the rows being read are prefetched kPrefetch bytes ahead of use: the
// hardware prefetchers alone leave much of the memory bandwidth unused.
constexpr int64_t kPrefetch = 12288;
QMV_INLINE void prefetch_ahead(const uint8_t* from, const uint8_t* to, const uint8_t* end) {
  if (end - to < kPrefetch) return;
  for (const uint8_t* p = from + kPrefetch; p < to + kPrefetch; p += 64) _mm_prefetch((const char*)p, _MM_HINT_T0);
}

// Runs Op::row<R, MT> over the rows [r0, r1) and the activation rows in tiles: R weight rows at a
// time (independent chains of work for the out-of-order core while decoding, M = 1 or 2) by MT
// activation rows. Each output's operations are the same whatever R, MT and the tiling.
template <class Op>
void rows_driver(const Mat& W, int64_t r0, int64_t r1, const Act& a, float* y, int64_t ldy) {
  float out[16] = {};
  int64_t n = r0;
  auto rp = [&](int64_t i) { return W.data + (size_t)i * W.row_bytes; };
  if constexpr (Op::multi_row) {
    for (; a.M <= 2 && n + 4 <= r1; n += 4) {
      const uint8_t* rows[4] = {rp(n), rp(n + 1), rp(n + 2), rp(n + 3)};
      prefetch_ahead(rp(n), rp(n + 4), rp(W.rows));
      if (a.M == 1) Op::template row<4, 1>(W, rows, a, 0, out);
      else Op::template row<4, 2>(W, rows, a, 0, out);
      for (int r = 0; r < 4; ++r)
        for (int64_t m = 0; m < a.M; ++m) y[m * ldy + n + r] = out[r * a.M + m];
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

// Four block scales (float lanes) of 16 per step: lane l of a step gets scale 4 s + l / 4.
QMV_INLINE __m512i quad_index() { return _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3); }
QMV_INLINE __m512i pair_index() { return _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1); }

// 32 word indices for vpermw / vpermt2w, built at compile time.
struct WordIdx {
  alignas(64) uint16_t v[32];
};
QMV_INLINE __m512i load_idx(const WordIdx& w) { return _mm512_load_si512(w.v); }
// Q4/Q5 steps: words 0..15 the d of block l / 4, words 16..31 the m of block (l - 16) / 4 (with_m)
// or d again.
constexpr WordIdx dm_words(int bb, bool with_m) {
  WordIdx w{};
  for (int l = 0; l < 32; ++l) w.v[l] = (uint16_t)((l % 16) / 4 * (bb / 2) + (with_m && l >= 16 ? 1 : 0));
  return w;
}
// Q5 steps: every word of 128-bit lane b from block b's qh (words 8b, 8b + 1 its two halves).
constexpr WordIdx qh_words(int bb, int qhoff) {
  WordIdx w{};
  for (int l = 0; l < 32; ++l) w.v[l] = (uint16_t)((l / 8) * (bb / 2) + qhoff / 2 + (l % 2));
  return w;
}
// Q8_0 steps: words 0..7 the d of the first block, 8..15 of the second.
constexpr WordIdx d2_words(int bb) {
  WordIdx w{};
  for (int l = 0; l < 32; ++l) w.v[l] = (uint16_t)((l % 16) / 8 * (bb / 2));
  return w;
}

// ---------------------------------------------------------------- Q4_0 / Q4_1 / Q5_0 / Q5_1
// Steps of 4 blocks: the 4 x 16 nibble bytes go into one register, low nibbles against the
// activations' low halves (layout Nib16), high nibbles against the high halves, into the same
// lanes (lanes 4b..4b+3: block b). The blocks' fp16 d (and m) are picked out of the step's first
// 64 (Q5: 128) bytes with one word permutation, d onto the block's lanes and m (or the offset
// -8 d / -16 d) multiplied by the activation sum held in the block's first lane (ActLanes::Lanes4).
// Q5's fifth bits: the same permutation puts block b's qh into 128-bit lane b, where bytes 0-1
// (low halves) or 2-3 (high halves) are spread eight lanes each and tested bit by bit.
enum class C { Q4_0, Q4_1, Q5_0, Q5_1 };

template <C T>
struct Q45 {
  static constexpr bool min = T == C::Q4_1 || T == C::Q5_1, five = T == C::Q5_0 || T == C::Q5_1;
  static constexpr int bb = T == C::Q4_0 ? 18 : T == C::Q4_1 ? 20 : T == C::Q5_0 ? 22 : 24;
  static constexpr int qhoff = min ? 4 : 2, qoff = five ? qhoff + 4 : qhoff;
  static constexpr float offset = five ? -16.f : -8.f;  // of the types without a min
  static constexpr bool multi_row = true;
  static constexpr WordIdx kDm = dm_words(bb, min), kQh = qh_words(bb, qhoff);

  // Four blocks from bp (n_ok of them real; the rest re-read the first: their activations are 0)
  // against the activations of step k (elements 128 k onwards).
  template <int MT>
  static QMV_INLINE void step(const uint8_t* bp, int n_ok, const Act& a, int64_t m0, int64_t k, __m512* acc) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const uint8_t* p = bp + qoff;
    __m512i v = _mm512_castsi128_si512(load128(p));
    v = _mm512_inserti32x4(v, load128(n_ok > 1 ? p + bb : p), 1);
    v = _mm512_inserti32x4(v, load128(n_ok > 2 ? p + 2 * bb : p), 2);
    v = _mm512_inserti32x4(v, load128(n_ok > 3 ? p + 3 * bb : p), 3);
    __m512i lo = _mm512_and_si512(v, m4);
    __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    // The step's header bytes: never past its last real block.
    const int nbytes = n_ok * bb;
    const __m512i h0 = nbytes >= 64 ? load512(bp) : _mm512_maskz_loadu_epi8((__mmask64)((1ull << nbytes) - 1), bp);
    __m512i dm;
    if constexpr (five) {
      const __m512i h1 = nbytes > 64 ? _mm512_maskz_loadu_epi8((__mmask64)((1ull << (nbytes - 64)) - 1), bp + 64)
                                     : _mm512_setzero_si512();
      dm = _mm512_permutex2var_epi16(h0, load_idx(kDm), h1);
      const __m512i qh = _mm512_permutex2var_epi16(h0, load_idx(kQh), h1);
      const __m512i spread_lo = _mm512_set4_epi32(0x01010101, 0x01010101, 0, 0);
      const __m512i spread_hi = _mm512_set4_epi32(0x03030303, 0x03030303, 0x02020202, 0x02020202);
      const __m512i bits = _mm512_set1_epi64((long long)0x8040201008040201ull), b16 = _mm512_set1_epi8(16);
      lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(_mm512_shuffle_epi8(qh, spread_lo), bits), lo, b16);
      hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(_mm512_shuffle_epi8(qh, spread_hi), bits), hi, b16);
    } else {
      dm = _mm512_permutexvar_epi16(load_idx(kDm), h0);
    }
    const __m512 dw = _mm512_cvtph_ps(_mm512_castsi512_si256(dm));
    const __m512 off =
        min ? _mm512_cvtph_ps(_mm512_extracti64x4_epi64(dm, 1)) : _mm512_mul_ps(dw, _mm512_set1_ps(offset));
    for (int m = 0; m < MT; ++m) {
      const int64_t row = m0 + m;
      const int8_t* xq = a.q + row * a.Kp + 128 * k;
      const float* dl = a.dl + row * a.nl + 16 * k;
      const float* sl = a.sl + row * a.nl + 16 * k;
      __m512i i = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, load512(xq));
      i = _mm512_dpbusd_epi32(i, hi, load512(xq + 64));
      acc[m] = _mm512_fmadd_ps(off, _mm512_loadu_ps(sl), acc[m]);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(dw, _mm512_loadu_ps(dl)), acc[m]);
    }
  }

  template <int R, int MT>
  static QMV_INLINE void row(const Mat& W, const uint8_t* const* rows, const Act& a, int64_t m0, float* out) {
    const int64_t nb = W.cols / 32;
    __m512 acc[R][MT];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4)
      for (int r = 0; r < R; ++r) step<MT>(rows[r] + b * bb, 4, a, m0, b / 4, acc[r]);
    if (b < nb)
      for (int r = 0; r < R; ++r) step<MT>(rows[r] + b * bb, (int)(nb - b), a, m0, b / 4, acc[r]);
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) out[r * MT + m] = hsum(acc[r][m]);
  }
};

// ---------------------------------------------------------------- Q8_0
// Weights made unsigned by flipping the sign bit (w + 128); the 128 * sum(x) this adds is taken
// off through the activation sums. Steps of two blocks (lanes 8b..8b+7: block b, ActLanes::Lanes8);
// the two fp16 d come out of the step's first 64 bytes with one word permutation.
struct Q8 {
  static constexpr int bb = 34;
  static constexpr bool multi_row = true;
  static constexpr WordIdx kD = d2_words(bb);

  template <int MT>
  static QMV_INLINE void step(const uint8_t* bp, bool two, const Act& a, int64_t m0, int64_t k, __m512* acc) {
    const uint8_t* p = bp + 2;
    __m512i v = _mm512_castsi256_si512(load256(p));
    v = _mm512_inserti64x4(v, load256(two ? p + bb : p), 1);
    v = _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80));
    const __m512i h = two ? load512(bp) : _mm512_maskz_loadu_epi8((__mmask64)((1ull << bb) - 1), bp);
    const __m512 dw = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(load_idx(kD), h)));
    const __m512 off = _mm512_mul_ps(dw, _mm512_set1_ps(-128.f));
    for (int m = 0; m < MT; ++m) {
      const int64_t row = m0 + m;
      const float* dl = a.dl + row * a.nl + 16 * k;
      const float* sl = a.sl + row * a.nl + 16 * k;
      const __m512i i = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v, load512(a.q + row * a.Kp + 64 * k));
      acc[m] = _mm512_fmadd_ps(off, _mm512_loadu_ps(sl), acc[m]);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(dw, _mm512_loadu_ps(dl)), acc[m]);
    }
  }

  template <int R, int MT>
  static QMV_INLINE void row(const Mat& W, const uint8_t* const* rows, const Act& a, int64_t m0, float* out) {
    const int64_t nb = W.cols / 32;
    __m512 acc[R][MT];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2)
      for (int r = 0; r < R; ++r) step<MT>(rows[r] + b * bb, true, a, m0, b / 2, acc[r]);
    if (b < nb)
      for (int r = 0; r < R; ++r) step<MT>(rows[r] + b * bb, false, a, m0, b / 2, acc[r]);
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) out[r * MT + m] = hsum(acc[r][m]);
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
  static constexpr bool multi_row = true;
  template <int R, int MT>
  static QMV_INLINE void row(const Mat& W, const uint8_t* const* rows, const Act& a, int64_t m0, float* out) {
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
    __m512 acc[R][MT];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; ++sb) {
      __m512 sc[R][MT];
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = rows[r] + sb * bb;
        const float d = half(p), dmin = half(p + 2);
        uint64_t scb, mnb;
        k4_scales(p + 4, scb, mnb);
        const __m256 ds = _mm256_mul_ps(_mm256_set1_ps(d), bytes8_to_ps(scb));
        const __m512 dmn = _mm512_zextps256_ps512(_mm256_mul_ps(_mm256_set1_ps(dmin), bytes8_to_ps(mnb)));
        for (int m = 0; m < MT; ++m) {
          const int64_t o = (m0 + m) * nbp + sb * 8;
          sc[r][m] = _mm512_zextps256_ps512(_mm256_mul_ps(ds, _mm256_loadu_ps(a.d32 + o)));
          acc[r][m] = _mm512_fnmadd_ps(dmn, _mm512_zextps256_ps512(_mm256_loadu_ps(a.s32 + o)), acc[r][m]);
        }
      }
      for (int t = 0; t < 2; ++t) {
        for (int r = 0; r < R; ++r) {
          const uint8_t* p = rows[r] + sb * bb;
          const __m512i v = load512(p + qoff + 64 * t);
          __m512i lo = _mm512_and_si512(v, m4);
          __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
          if constexpr (Five) {
            const __m512i qh = _mm512_broadcast_i64x4(load256(p + 16));
            lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(qh, hb_lo[t]), lo, b16);
            hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(qh, hb_hi[t]), hi, b16);
          }
          for (int m = 0; m < MT; ++m) {
            const int8_t* xq = a.q + (m0 + m) * a.Kp + sb * 256 + 128 * t;
            const __m512i il32 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, load512(xq));
            const __m512i ih32 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, load512(xq + 64));
            acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(il32), _mm512_permutexvar_ps(il[t], sc[r][m]), acc[r][m]);
            acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ih32), _mm512_permutexvar_ps(ih[t], sc[r][m]), acc[r][m]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) out[r * MT + m] = hsum(acc[r][m]);
  }
};

// ---------------------------------------------------------------- Q6_K
// 16 sub-blocks of 16 with int8 scales; 6-bit quants offset by 32 (taken off through the 16-element
// activation sums). Each 128-element half: low nibbles of ql[0..64) with qh bits 0-1 / 2-3 are
// elements 0..63, high nibbles with qh bits 4-5 / 6-7 elements 64..127 (natural activation order).
struct Q6K {
  static constexpr int bb = 210;
  static constexpr bool multi_row = true;
  template <int R, int MT>
  static QMV_INLINE void row(const Mat& W, const uint8_t* const* rows, const Act& a, int64_t m0, float* out) {
    const int64_t nsb = W.cols / 256, nb16p = a.Kp / 16;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i q0 = quad_index(), four = _mm512_set1_epi32(4);
    const __m512i idx[4] = {q0, _mm512_add_epi32(q0, four), _mm512_add_epi32(q0, _mm512_set1_epi32(8)),
                            _mm512_add_epi32(q0, _mm512_set1_epi32(12))};
    __m512 acc[R][MT];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; ++sb) {
      __m512 sc[R][MT];
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = rows[r] + sb * bb;
        const __m512 dsc = _mm512_mul_ps(_mm512_set1_ps(half(p + 208)),
                                         _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load128(p + 192))));
        const __m512 cor = _mm512_mul_ps(dsc, _mm512_set1_ps(-32.f));
        for (int m = 0; m < MT; ++m) {
          const int64_t o = (m0 + m) * nb16p + sb * 16;
          sc[r][m] = _mm512_mul_ps(dsc, _mm512_loadu_ps(a.d16 + o));
          acc[r][m] = _mm512_fmadd_ps(cor, _mm512_loadu_ps(a.s16 + o), acc[r][m]);
        }
      }
      for (int h = 0; h < 2; ++h)
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = rows[r] + sb * bb;
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
          acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ilo), _mm512_permutexvar_ps(idx[2 * h], sc[r][m]), acc[r][m]);
          acc[r][m] =
              _mm512_fmadd_ps(_mm512_cvtepi32_ps(ihi), _mm512_permutexvar_ps(idx[2 * h + 1], sc[r][m]), acc[r][m]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) out[r * MT + m] = hsum(acc[r][m]);
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
  else
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(km, row + 2 * k)), 16));
}

template <FT T>
struct Flt {
  static constexpr bool multi_row = false;  // four partial sums per row are enough
  template <int R, int MT>
  static QMV_INLINE void row(const Mat& W, const uint8_t* const* rows, const Act& a, int64_t m0, float* out) {
    static_assert(R == 1);
    const uint8_t* row = rows[0];
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
      out[m] = hsum(
          _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3])));
  }
};

}  // namespace

void quantize_row_avx512(const float* x, int64_t K, int8_t* q, float* d, int32_t* sum16) {
  for (int64_t b = 0; b < K / 32; ++b, x += 32, q += 32) {
    const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    __m512 m = _mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1));
    m = _mm512_max_ps(m, _mm512_shuffle_f32x4(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm512_max_ps(m, _mm512_shuffle_f32x4(m, m, _MM_SHUFFLE(2, 3, 0, 1)));
    m = _mm512_max_ps(m, _mm512_permute_ps(m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm512_max_ps(m, _mm512_permute_ps(m, _MM_SHUFFLE(2, 3, 0, 1)));
    const float db = _mm512_cvtss_f32(m) / 127.f;
    d[b] = db;
    if (!(db > 0.f)) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_setzero_si256());
      sum16[2 * b] = sum16[2 * b + 1] = 0;
      continue;
    }
    const __m512 vd = _mm512_set1_ps(db);
    // Correctly rounded division, then conversion in the default round-to-nearest-even mode.
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_div_ps(v0, vd)), q1 = _mm512_cvtps_epi32(_mm512_div_ps(v1, vd));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q1));
    sum16[2 * b] = _mm512_reduce_add_epi32(q0);
    sum16[2 * b + 1] = _mm512_reduce_add_epi32(q1);
  }
}

Kernel kernel_avx512(io::GGMLType t) {
  using io::GGMLType;
  switch (t) {
    case GGMLType::Q4_0: return {rows_driver<Q45<C::Q4_0>>, ActLayout::Nib16, true, ActLanes::Lanes4};
    case GGMLType::Q4_1: return {rows_driver<Q45<C::Q4_1>>, ActLayout::Nib16, true, ActLanes::Lanes4};
    case GGMLType::Q5_0: return {rows_driver<Q45<C::Q5_0>>, ActLayout::Nib16, true, ActLanes::Lanes4};
    case GGMLType::Q5_1: return {rows_driver<Q45<C::Q5_1>>, ActLayout::Nib16, true, ActLanes::Lanes4};
    case GGMLType::Q8_0: return {rows_driver<Q8>, ActLayout::Natural, true, ActLanes::Lanes8};
    case GGMLType::Q4_K: return {rows_driver<QK45<false>>, ActLayout::Nib32, true, ActLanes::None};
    case GGMLType::Q5_K: return {rows_driver<QK45<true>>, ActLayout::Nib32, true, ActLanes::None};
    case GGMLType::Q6_K: return {rows_driver<Q6K>, ActLayout::Natural, true, ActLanes::None};
    case GGMLType::F32: return {rows_driver<Flt<FT::F32>>, ActLayout::Natural, false, ActLanes::None};
    case GGMLType::F16: return {rows_driver<Flt<FT::F16>>, ActLayout::Natural, false, ActLanes::None};
    case GGMLType::BF16: return {rows_driver<Flt<FT::BF16>>, ActLayout::Natural, false, ActLanes::None};
    default: return {nullptr, ActLayout::Natural, false, ActLanes::None};
  }
}

}  // namespace focus::cpu::qmv
