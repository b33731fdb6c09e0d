// ggml tensor types: sizes, names and dequantisation. Block layouts follow ggml's definitions
// (ggml-common.h); every formula keeps ggml's order of float operations so the results are
// bit-identical to ggml's reference dequantisers.
#include "io/ggml_types.h"

#include <bit>
#include <cstring>

#include "core/error.h"

// Rounding: with fp16 scales (11 significant bits), sub-block scales of at most 8 bits and quants
// of at most 6, every product below is exact in float; only Q8_K (float32 scale) rounds its
// product, and no addition follows it. So fused multiply-adds cannot change any result.

namespace focus::io {

namespace {

constexpr int QK = 32;    // elements per block of the classic quants
constexpr int QK_K = 256; // elements per super-block of the k-quants

// Byte sizes of the block structs (all little-endian, packed, no padding).
constexpr size_t kQ4_0 = 2 + QK / 2;                        // d, qs[16]
constexpr size_t kQ4_1 = 2 + 2 + QK / 2;                    // d, m, qs[16]
constexpr size_t kQ5_0 = 2 + 4 + QK / 2;                    // d, qh[4], qs[16]
constexpr size_t kQ5_1 = 2 + 2 + 4 + QK / 2;                // d, m, qh[4], qs[16]
constexpr size_t kQ8_0 = 2 + QK;                            // d, qs[32]
constexpr size_t kQ8_1 = 2 + 2 + QK;                        // d, s, qs[32]
constexpr size_t kQ2_K = QK_K / 16 + QK_K / 4 + 2 + 2;      // scales[16], qs[64], d, dmin
constexpr size_t kQ3_K = QK_K / 8 + QK_K / 4 + 12 + 2;      // hmask[32], qs[64], scales[12], d
constexpr size_t kQ4_K = 2 + 2 + 12 + QK_K / 2;             // d, dmin, scales[12], qs[128]
constexpr size_t kQ5_K = 2 + 2 + 12 + QK_K / 8 + QK_K / 2;  // d, dmin, scales[12], qh[32], qs[128]
constexpr size_t kQ6_K = QK_K / 2 + QK_K / 4 + QK_K / 16 + 2;  // ql[128], qh[64], scales[16], d
constexpr size_t kQ8_K = 4 + QK_K + QK_K / 16 * 2;          // float d, qs[256], bsums[16]

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
// IEEE half -> single, exact for every input: normals rebias the exponent, subnormals are
// scaled exactly (mantissa * 2^-24), and inf / NaN keep their payload bits. Branch-free (masks
// instead of conditionals) so loops over halves vectorise.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7FFFu;
  const uint32_t normal = (em << 13) + ((127u - 15u) << 23);
  const uint32_t inf_nan = (em << 13) | 0x7F800000u;
  const uint32_t subnormal = std::bit_cast<uint32_t>((float)(int32_t)em * 0x1p-24f);
  const uint32_t is_inf_nan = 0u - (uint32_t)(em >= 0x7C00u);
  const uint32_t is_normal = 0u - (uint32_t)(em >= 0x0400u);
  const uint32_t bits = (inf_nan & is_inf_nan) | (normal & is_normal & ~is_inf_nan) | (subnormal & ~is_normal);
  return std::bit_cast<float>(sign | bits);
}
inline float load_f16(const uint8_t* p) { return half_to_float(load_u16(p)); }

// ---------------------------------------------------------------- classic 32-element blocks
// Element j < 16 is the low nibble of qs[j], element j + 16 the high nibble.

void deq_q4_0(const uint8_t* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQ4_0, y += QK) {
    const float d = load_f16(x);
    const uint8_t* qs = x + 2;
    for (int j = 0; j < QK / 2; ++j) {
      y[j] = (float)((qs[j] & 0x0F) - 8) * d;
      y[j + QK / 2] = (float)((qs[j] >> 4) - 8) * d;
    }
  }
}

void deq_q4_1(const uint8_t* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQ4_1, y += QK) {
    const float d = load_f16(x), m = load_f16(x + 2);
    const uint8_t* qs = x + 4;
    for (int j = 0; j < QK / 2; ++j) {
      y[j] = (float)(qs[j] & 0x0F) * d + m;
      y[j + QK / 2] = (float)(qs[j] >> 4) * d + m;
    }
  }
}

// Q5: bit j of the 32-bit qh is the fifth bit of element j.
void deq_q5_0(const uint8_t* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQ5_0, y += QK) {
    const float d = load_f16(x);
    const uint32_t qh = load_u32(x + 2);
    const uint8_t* qs = x + 6;
    for (int j = 0; j < QK / 2; ++j) {
      const int h0 = (int)((qh >> j) & 1) << 4, h1 = (int)((qh >> (j + 16)) & 1) << 4;
      y[j] = (float)(((qs[j] & 0x0F) | h0) - 16) * d;
      y[j + QK / 2] = (float)(((qs[j] >> 4) | h1) - 16) * d;
    }
  }
}

void deq_q5_1(const uint8_t* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQ5_1, y += QK) {
    const float d = load_f16(x), m = load_f16(x + 2);
    const uint32_t qh = load_u32(x + 4);
    const uint8_t* qs = x + 8;
    for (int j = 0; j < QK / 2; ++j) {
      const int h0 = (int)((qh >> j) & 1) << 4, h1 = (int)((qh >> (j + 16)) & 1) << 4;
      y[j] = (float)((qs[j] & 0x0F) | h0) * d + m;
      y[j + QK / 2] = (float)((qs[j] >> 4) | h1) * d + m;
    }
  }
}

void deq_q8_0(const uint8_t* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQ8_0, y += QK) {
    const float d = load_f16(x);
    const int8_t* qs = reinterpret_cast<const int8_t*>(x + 2);
    for (int j = 0; j < QK; ++j) y[j] = (float)qs[j] * d;
  }
}

// ---------------------------------------------------------------- k-quants (256-element super-blocks)

// Q2_K: 16 sub-blocks of 16; scales[k] holds a 4-bit scale (low) and 4-bit min (high).
// Each 128-element half reads 32 bytes of qs at shifts 0, 2, 4, 6.
void deq_q2_k(const uint8_t* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQ2_K) {
    const uint8_t* sc = x;
    const uint8_t* q = x + QK_K / 16;
    const float d = load_f16(x + QK_K / 16 + QK_K / 4), dmin = load_f16(x + QK_K / 16 + QK_K / 4 + 2);
    int is = 0;
    for (int half = 0; half < 2; ++half, q += 32) {
      for (int shift = 0; shift < 8; shift += 2) {
        for (int k = 0; k < 2; ++k, ++is, y += 16) {
          const float dl = d * (float)(sc[is] & 0x0F), ml = dmin * (float)(sc[is] >> 4);
          const uint8_t* qq = q + 16 * k;
          for (int l = 0; l < 16; ++l) y[l] = dl * (float)((qq[l] >> shift) & 3) - ml;
        }
      }
    }
  }
}

// The 16 six-bit scales of Q3_K: low 4 bits from bytes 0..7 (low nibbles, then high nibbles),
// high 2 bits from bytes 8..11 (scale i uses byte 8 + i % 4 at bit 2 * (i / 4)).
inline void q3_k_scales(const uint8_t* s, int8_t out[16]) {
  for (int i = 0; i < 16; ++i) {
    const int lo = i < 8 ? (s[i] & 0x0F) : (s[i - 8] >> 4);
    const int hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    out[i] = (int8_t)((lo | (hi << 4)) - 32);
  }
}

// Q3_K: 2 low bits in qs (as Q2_K), the third bit in hmask; a clear hmask bit subtracts 4.
void deq_q3_k(const uint8_t* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQ3_K) {
    const uint8_t* hm = x;
    const uint8_t* q = x + QK_K / 8;
    int8_t scales[16];
    q3_k_scales(x + QK_K / 8 + QK_K / 4, scales);
    const float d_all = load_f16(x + QK_K / 8 + QK_K / 4 + 12);
    int is = 0;
    uint8_t m = 1;
    for (int half = 0; half < 2; ++half, q += 32) {
      for (int shift = 0; shift < 8; shift += 2, m = (uint8_t)(m << 1)) {
        for (int k = 0; k < 2; ++k, ++is, y += 16) {
          const float dl = d_all * (float)scales[is];
          const uint8_t* qq = q + 16 * k;
          const uint8_t* hh = hm + 16 * k;
          for (int l = 0; l < 16; ++l)
            y[l] = dl * (float)((int)((qq[l] >> shift) & 3) - ((hh[l] & m) ? 0 : 4));
        }
      }
    }
  }
}

// Six-bit scale and min of sub-block j (0..7) of Q4_K / Q5_K, packed into 12 bytes.
inline void k4_scale_min(int j, const uint8_t* q, uint8_t& sc, uint8_t& mn) {
  if (j < 4) {
    sc = q[j] & 63;
    mn = q[j + 4] & 63;
  } else {
    sc = (uint8_t)((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4));
    mn = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

// Q4_K: 8 sub-blocks of 32; each 64-element chunk takes the low then high nibbles of 32 bytes.
void deq_q4_k(const uint8_t* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQ4_K) {
    const float d = load_f16(x), dmin = load_f16(x + 2);
    const uint8_t* scales = x + 4;
    const uint8_t* q = x + 16;
    for (int j = 0; j < QK_K / 64; ++j, q += 32, y += 64) {
      uint8_t sc, mn;
      k4_scale_min(2 * j, scales, sc, mn);
      const float d1 = d * (float)sc, m1 = dmin * (float)mn;
      k4_scale_min(2 * j + 1, scales, sc, mn);
      const float d2 = d * (float)sc, m2 = dmin * (float)mn;
      for (int l = 0; l < 32; ++l) y[l] = d1 * (float)(q[l] & 0x0F) - m1;
      for (int l = 0; l < 32; ++l) y[l + 32] = d2 * (float)(q[l] >> 4) - m2;
    }
  }
}

// Q5_K: as Q4_K plus a fifth bit from qh; chunk j uses bits 2j and 2j+1 of qh[l].
void deq_q5_k(const uint8_t* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQ5_K) {
    const float d = load_f16(x), dmin = load_f16(x + 2);
    const uint8_t* scales = x + 4;
    const uint8_t* qh = x + 16;
    const uint8_t* ql = x + 16 + QK_K / 8;
    for (int j = 0; j < QK_K / 64; ++j, ql += 32, y += 64) {
      uint8_t sc, mn;
      k4_scale_min(2 * j, scales, sc, mn);
      const float d1 = d * (float)sc, m1 = dmin * (float)mn;
      k4_scale_min(2 * j + 1, scales, sc, mn);
      const float d2 = d * (float)sc, m2 = dmin * (float)mn;
      const int b1 = 2 * j, b2 = 2 * j + 1;
      for (int l = 0; l < 32; ++l)
        y[l] = d1 * (float)((ql[l] & 0x0F) | (((qh[l] >> b1) & 1) << 4)) - m1;
      for (int l = 0; l < 32; ++l)
        y[l + 32] = d2 * (float)((ql[l] >> 4) | (((qh[l] >> b2) & 1) << 4)) - m2;
    }
  }
}

// Q6_K: 16 sub-blocks of 16 with int8 scales. Each 128-element half uses 64 bytes of ql
// (low nibbles of bytes 0..63, then high nibbles) and 32 bytes of qh (2 bits per element).
void deq_q6_k(const uint8_t* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQ6_K) {
    const uint8_t* ql = x;
    const uint8_t* qh = x + QK_K / 2;
    const int8_t* sc = reinterpret_cast<const int8_t*>(x + QK_K / 2 + QK_K / 4);
    const float d = load_f16(x + QK_K / 2 + QK_K / 4 + QK_K / 16);
    for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8, y += 128) {
      for (int k = 0; k < 2; ++k) {  // elements l in [16k, 16k + 16) share their four scales
        const float s1 = d * (float)sc[k], s2 = d * (float)sc[k + 2], s3 = d * (float)sc[k + 4],
                    s4 = d * (float)sc[k + 6];
        for (int l = 16 * k; l < 16 * k + 16; ++l) {
          const int q1 = (int)((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) - 32;
          const int q2 = (int)((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
          const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
          const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
          y[l] = s1 * (float)q1;
          y[l + 32] = s2 * (float)q2;
          y[l + 64] = s3 * (float)q3;
          y[l + 96] = s4 * (float)q4;
        }
      }
    }
  }
}

void deq_q8_k(const uint8_t* x, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQ8_K, y += QK_K) {
    float d;
    std::memcpy(&d, x, 4);
    const int8_t* qs = reinterpret_cast<const int8_t*>(x + 4);
    for (int j = 0; j < QK_K; ++j) y[j] = d * (float)qs[j];
  }
}

// ---------------------------------------------------------------- plain types

void deq_f16(const uint8_t* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = half_to_float(load_u16(x + 2 * i));
}
void deq_bf16(const uint8_t* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = bf16_to_fp32(load_u16(x + 2 * i));
}
template <typename T>
void deq_cast(const uint8_t* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    T v;
    std::memcpy(&v, x + sizeof(T) * i, sizeof(T));
    y[i] = (float)v;
  }
}

struct TypeInfo {
  const char* name;
  size_t block_elems, block_bytes;
  void (*deq)(const uint8_t*, float*, int64_t);  // takes a block count; nullptr: unsupported
};

// Indexed by type id; name == nullptr for ids that are not (or no longer) valid types.
const TypeInfo* info(GGMLType t) {
  static const TypeInfo table[] = {
      /* 0 */ {"F32", 1, 4, deq_cast<float>},
      /* 1 */ {"F16", 1, 2, deq_f16},
      /* 2 */ {"Q4_0", QK, kQ4_0, deq_q4_0},
      /* 3 */ {"Q4_1", QK, kQ4_1, deq_q4_1},
      /* 4 */ {nullptr, 0, 0, nullptr},  // Q4_2, removed from ggml
      /* 5 */ {nullptr, 0, 0, nullptr},  // Q4_3, removed from ggml
      /* 6 */ {"Q5_0", QK, kQ5_0, deq_q5_0},
      /* 7 */ {"Q5_1", QK, kQ5_1, deq_q5_1},
      /* 8 */ {"Q8_0", QK, kQ8_0, deq_q8_0},
      /* 9 */ {"Q8_1", QK, kQ8_1, nullptr},
      /* 10 */ {"Q2_K", QK_K, kQ2_K, deq_q2_k},
      /* 11 */ {"Q3_K", QK_K, kQ3_K, deq_q3_k},
      /* 12 */ {"Q4_K", QK_K, kQ4_K, deq_q4_k},
      /* 13 */ {"Q5_K", QK_K, kQ5_K, deq_q5_k},
      /* 14 */ {"Q6_K", QK_K, kQ6_K, deq_q6_k},
      /* 15 */ {"Q8_K", QK_K, kQ8_K, deq_q8_k},
      // 16..23: IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ4_NL, IQ3_S, IQ2_S, IQ4_XS (not supported)
      /* 16 */ {"IQ2_XXS", QK_K, 2 + QK_K / 4, nullptr},
      /* 17 */ {"IQ2_XS", QK_K, 2 + QK_K / 4 + QK_K / 32, nullptr},
      /* 18 */ {"IQ3_XXS", QK_K, 2 + QK_K / 4 + QK_K / 8, nullptr},
      /* 19 */ {"IQ1_S", QK_K, 2 + QK_K / 8 + QK_K / 16, nullptr},
      /* 20 */ {"IQ4_NL", QK, 2 + QK / 2, nullptr},
      /* 21 */ {"IQ3_S", QK_K, 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4, nullptr},
      /* 22 */ {"IQ2_S", QK_K, 2 + QK_K / 4 + QK_K / 16, nullptr},
      /* 23 */ {"IQ4_XS", QK_K, 2 + 2 + QK_K / 2 + QK_K / 64, nullptr},
      /* 24 */ {"I8", 1, 1, deq_cast<int8_t>},
      /* 25 */ {"I16", 1, 2, deq_cast<int16_t>},
      /* 26 */ {"I32", 1, 4, deq_cast<int32_t>},
      /* 27 */ {"I64", 1, 8, deq_cast<int64_t>},
      /* 28 */ {"F64", 1, 8, deq_cast<double>},
      /* 29 */ {"IQ1_M", QK_K, QK_K / 8 + QK_K / 16 + QK_K / 32, nullptr},
      /* 30 */ {"BF16", 1, 2, deq_bf16},
  };
  const auto id = static_cast<uint32_t>(t);
  if (id >= sizeof(table) / sizeof(table[0]) || !table[id].name) return nullptr;
  return &table[id];
}

}  // namespace

bool type_supported(GGMLType t) {
  const TypeInfo* ti = info(t);
  return ti && ti->deq;
}

std::string type_name(GGMLType t) {
  const TypeInfo* ti = info(t);
  return ti ? ti->name : "type#" + std::to_string(static_cast<uint32_t>(t));
}

size_t type_block_elems(GGMLType t) {
  const TypeInfo* ti = info(t);
  return ti ? ti->block_elems : 0;
}

size_t type_block_bytes(GGMLType t) {
  const TypeInfo* ti = info(t);
  return ti ? ti->block_bytes : 0;
}

size_t row_bytes(GGMLType t, int64_t n) {
  const TypeInfo* ti = info(t);
  if (!ti) fail("unknown tensor type ", type_name(t));
  FOCUS_CHECK(n >= 0 && n % (int64_t)ti->block_elems == 0, "a row of ", n, " elements is not a multiple of the ",
              ti->name, " block size ", ti->block_elems);
  return (size_t)(n / (int64_t)ti->block_elems) * ti->block_bytes;
}

void dequantize(GGMLType t, const void* src, float* dst, int64_t n) {
  const TypeInfo* ti = info(t);
  FOCUS_CHECK(ti && ti->deq, "cannot dequantise tensor type ", type_name(t), ": not supported");
  FOCUS_CHECK(n >= 0 && n % (int64_t)ti->block_elems == 0, "cannot dequantise ", n, " elements of ", ti->name,
              ": not a multiple of the block size ", ti->block_elems);
  ti->deq(static_cast<const uint8_t*>(src), dst, n / (int64_t)ti->block_elems);
}

float fp16_to_fp32(uint16_t h) { return half_to_float(h); }

// IEEE single -> half with round-to-nearest-even, overflow to inf, gradual underflow, and
// NaN kept as a quiet NaN.
uint16_t fp32_to_fp16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return (uint16_t)(sign | 0x7E00u | ((ax >> 13) & 0x3FFu));  // NaN
  if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);  // rounds to >= 65520: inf
  if (ax >= 0x38800000u) {                                    // normal half (>= 2^-14)
    const uint32_t mant_round = ax + 0xFFFu + ((ax >> 13) & 1u);  // RNE on the 13 dropped bits
    return (uint16_t)(sign | ((mant_round - (112u << 23)) >> 13));
  }
  if (ax < 0x33000000u) return sign;  // below half the smallest subnormal (2^-25): zero
  // Subnormal half: value = m * 2^-24 with m = round(|f| * 2^24), computed on the integer mantissa.
  const uint32_t e = ax >> 23;                      // 102..112
  const uint32_t mant = (ax & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126u - e;                  // 14..24: bits to drop
  uint32_t m = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u), halfway = 1u << (shift - 1u);
  if (rem > halfway || (rem == halfway && (m & 1u))) ++m;
  return (uint16_t)(sign | m);
}

float bf16_to_fp32(uint16_t h) { return std::bit_cast<float>((uint32_t)h << 16); }

uint16_t fp32_to_bf16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // quiet NaN
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace focus::io
