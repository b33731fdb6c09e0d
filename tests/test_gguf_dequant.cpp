// GGUF dequantisation tests: the type table and half floats, hand-built blocks of every
// supported type checked against expectations written from the block format definitions, and
// tensors of every type read back through a GGUF file.
#include <gtest/gtest.h>
#include <unistd.h>

#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <cstdio>
#include <algorithm>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/mapped_file.h"
#include "io/ggml_types.h"
#include "io/gguf.h"
#include "test_gguf_builder.h"
#include "test_util.h"

namespace fs = std::filesystem;
using focus::io::GGMLType;
using focus::io::GGUFFile;
using namespace focus::test::gguf;

namespace {

// ================================================================ reference formulas
// Written from the format definitions, one element at a time. Every float operation ggml
// rounds is rounded explicitly here (products of two floats are exact in double), so the
// expectations do not depend on the compiler contracting or reordering anything.

float rnd(double x) { return (float)x; }

// Half -> float from the IEEE definition.
double half_value(uint16_t h) {
  const int sign = (h >> 15) ? -1 : 1, e = (h >> 10) & 31, m = h & 1023;
  if (e == 31) return m ? std::nan("") : sign * INFINITY;
  if (e == 0) return sign * std::ldexp((double)m, -24);
  return sign * std::ldexp((double)(1024 + m), e - 25);
}

uint16_t rd16(const uint8_t* p) { return (uint16_t)(p[0] | (p[1] << 8)); }
float h(const uint8_t* p) { return (float)half_value(rd16(p)); }

// Unpack the six-bit scale / min of sub-block j from the 12-byte Q4_K / Q5_K scale field.
void k_scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Element i of one block of type t, starting at b.
float ref_elem(GGMLType t, const uint8_t* b, int i) {
  switch (t) {
    case GGMLType::Q4_0: {
      const int q = i < 16 ? (b[2 + i] & 15) : (b[2 + i - 16] >> 4);
      return rnd((double)(q - 8) * h(b));
    }
    case GGMLType::Q4_1: {
      const int q = i < 16 ? (b[4 + i] & 15) : (b[4 + i - 16] >> 4);
      return rnd((double)rnd((double)q * h(b)) + h(b + 2));
    }
    case GGMLType::Q5_0: {
      const uint32_t qh = b[2] | (b[3] << 8) | (b[4] << 16) | ((uint32_t)b[5] << 24);
      const int lo = i < 16 ? (b[6 + i] & 15) : (b[6 + i - 16] >> 4);
      const int q = lo | (int)(((qh >> i) & 1) << 4);
      return rnd((double)(q - 16) * h(b));
    }
    case GGMLType::Q5_1: {
      const uint32_t qh = b[4] | (b[5] << 8) | (b[6] << 16) | ((uint32_t)b[7] << 24);
      const int lo = i < 16 ? (b[8 + i] & 15) : (b[8 + i - 16] >> 4);
      const int q = lo | (int)(((qh >> i) & 1) << 4);
      return rnd((double)rnd((double)q * h(b)) + h(b + 2));
    }
    case GGMLType::Q8_0:
      return rnd((double)(int8_t)b[2 + i] * h(b));
    case GGMLType::Q2_K: {
      // scales[16] | qs[64] | d | dmin; 128-element halves, 32-element groups at shifts 0,2,4,6.
      const int half = i / 128, g = (i % 128) / 32, l = i % 32;
      const int q = (b[16 + half * 32 + l] >> (2 * g)) & 3;
      const int s = b[i / 16];
      const float dl = rnd((double)h(b + 80) * (s & 15)), ml = rnd((double)h(b + 82) * (s >> 4));
      return rnd((double)rnd((double)dl * q) - ml);
    }
    case GGMLType::Q3_K: {
      // hmask[32] | qs[64] | scales[12] | d
      const int half = i / 128, g = (i % 128) / 32, l = i % 32;
      const int lo = (b[32 + half * 32 + l] >> (2 * g)) & 3;
      const int hbit = (b[l] >> (half * 4 + g)) & 1;
      const int q = lo - (hbit ? 0 : 4);
      const int j = i / 16;
      const uint8_t* s = b + 96;
      const int s_lo = j < 8 ? (s[j] & 15) : (s[j - 8] >> 4);
      const int s_hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
      const int sc = (s_lo | (s_hi << 4)) - 32;
      return rnd((double)rnd((double)h(b + 108) * sc) * q);
    }
    case GGMLType::Q4_K: {
      // d | dmin | scales[12] | qs[128]; 64-element chunks: low nibbles then high nibbles.
      const int j = i / 32, l = i % 32;
      const uint8_t byte = b[16 + (i / 64) * 32 + l];
      const int q = (i % 64) < 32 ? (byte & 15) : (byte >> 4);
      int sc, mn;
      k_scale_min(b + 4, j, sc, mn);
      const float d1 = rnd((double)h(b) * sc), m1 = rnd((double)h(b + 2) * mn);
      return rnd((double)rnd((double)d1 * q) - m1);
    }
    case GGMLType::Q5_K: {
      // d | dmin | scales[12] | qh[32] | qs[128]; bit j of qh[l] is the fifth bit.
      const int j = i / 32, l = i % 32;
      const uint8_t byte = b[48 + (i / 64) * 32 + l];
      const int q = ((i % 64) < 32 ? (byte & 15) : (byte >> 4)) | (((b[16 + l] >> j) & 1) << 4);
      int sc, mn;
      k_scale_min(b + 4, j, sc, mn);
      const float d1 = rnd((double)h(b) * sc), m1 = rnd((double)h(b + 2) * mn);
      return rnd((double)rnd((double)d1 * q) - m1);
    }
    case GGMLType::Q6_K: {
      // ql[128] | qh[64] | scales[16] (int8) | d
      const int half = i / 128, g = (i % 128) / 32, l = i % 32;
      const uint8_t lbyte = b[half * 64 + (g & 1) * 32 + l];
      const int lo = g < 2 ? (lbyte & 15) : (lbyte >> 4);
      const int hi = (b[128 + half * 32 + l] >> (2 * g)) & 3;
      const int q = (lo | (hi << 4)) - 32;
      const int sc = (int8_t)b[192 + i / 16];
      return rnd((double)rnd((double)h(b + 208) * sc) * q);
    }
    case GGMLType::Q8_K: {
      float d;
      std::memcpy(&d, b, 4);
      return rnd((double)d * (int8_t)b[4 + i]);
    }
    case GGMLType::F32: {
      float f;
      std::memcpy(&f, b, 4);
      return f;
    }
    case GGMLType::F16:
      return (float)half_value(rd16(b));
    case GGMLType::BF16: {
      const uint32_t u = (uint32_t)rd16(b) << 16;
      return std::bit_cast<float>(u);
    }
    default:
      ADD_FAILURE() << "no reference for " << focus::io::type_name(t);
      return 0;
  }
}

// Random half-precision scale factors: powers of two (every product exact), or arbitrary normals.
uint16_t random_half(std::mt19937& rng, bool dyadic) {
  const uint16_t sign = (rng() & 1) ? 0x8000 : 0;
  if (dyadic) {
    static const uint16_t pow2[] = {0x3C00, 0x3800, 0x3400, 0x3000, 0x4000, 0x1400, 0x0010 /* 2^-20, subnormal */};
    return (uint16_t)(sign | pow2[rng() % 7]);
  }
  const uint16_t e = (uint16_t)(5 + rng() % 16);  // 2^-10 .. 2^5
  return (uint16_t)(sign | (e << 10) | (rng() & 1023));
}

// Random blocks of type t with sensible scale fields.
std::string random_blocks(GGMLType t, int64_t n_blocks, std::mt19937& rng, bool dyadic) {
  const size_t bb = focus::io::type_block_bytes(t);
  std::string out(bb * n_blocks, '\0');
  for (auto& c : out) c = (char)(rng() & 0xFF);
  auto put16 = [&](size_t at, uint16_t v) {
    out[at] = (char)(v & 0xFF);
    out[at + 1] = (char)(v >> 8);
  };
  for (int64_t k = 0; k < n_blocks; ++k) {
    const size_t b = k * bb;
    switch (t) {
      case GGMLType::Q4_0: case GGMLType::Q5_0: case GGMLType::Q8_0:
        put16(b, random_half(rng, dyadic));
        break;
      case GGMLType::Q4_1: case GGMLType::Q5_1: case GGMLType::Q4_K: case GGMLType::Q5_K:
        put16(b, random_half(rng, dyadic));
        put16(b + 2, random_half(rng, dyadic));
        break;
      case GGMLType::Q2_K:
        put16(b + 80, random_half(rng, dyadic));
        put16(b + 82, random_half(rng, dyadic));
        break;
      case GGMLType::Q3_K: put16(b + 108, random_half(rng, dyadic)); break;
      case GGMLType::Q6_K: put16(b + 208, random_half(rng, dyadic)); break;
      case GGMLType::Q8_K: {
        const float d = dyadic ? std::ldexp(1.0f, (int)(rng() % 20) - 15) : 0.001f * (float)(1 + rng() % 1000);
        std::memcpy(&out[b], &d, 4);
        break;
      }
      case GGMLType::F32: {
        const float f = std::ldexp((float)((int)(rng() % 20001) - 10000), -(int)(rng() % 20));
        std::memcpy(&out[b], &f, 4);
        break;
      }
      default:
        break;  // F16 / BF16: any bit pattern
    }
  }
  return out;
}

std::vector<float> reference(GGMLType t, const std::string& bytes) {
  const size_t bb = focus::io::type_block_bytes(t), be = focus::io::type_block_elems(t);
  std::vector<float> out;
  for (size_t k = 0; k * bb < bytes.size(); ++k)
    for (size_t i = 0; i < be; ++i)
      out.push_back(ref_elem(t, reinterpret_cast<const uint8_t*>(bytes.data()) + k * bb, (int)i));
  return out;
}

// Bitwise comparison that treats any two NaNs as equal.
void expect_same_floats(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < got.size() && bad < 10; ++i) {
    if (std::isnan(want[i]) && std::isnan(got[i])) continue;
    if (fbits(got[i]) != fbits(want[i])) {
      ADD_FAILURE() << what << " element " << i << ": got " << got[i] << " want " << want[i];
      ++bad;
    }
  }
}

const GGMLType kSupported[] = {GGMLType::F32,  GGMLType::F16,  GGMLType::BF16, GGMLType::Q4_0, GGMLType::Q4_1,
                               GGMLType::Q5_0, GGMLType::Q5_1, GGMLType::Q8_0, GGMLType::Q2_K, GGMLType::Q3_K,
                               GGMLType::Q4_K, GGMLType::Q5_K, GGMLType::Q6_K, GGMLType::Q8_K};


}  // namespace

// ================================================================ type table and half floats

TEST(GgmlTypes, SizesAndNames) {
  struct Row {
    GGMLType t;
    const char* name;
    size_t elems, bytes;
  };
  const Row rows[] = {{GGMLType::F32, "F32", 1, 4},      {GGMLType::F16, "F16", 1, 2},
                      {GGMLType::BF16, "BF16", 1, 2},    {GGMLType::Q4_0, "Q4_0", 32, 18},
                      {GGMLType::Q4_1, "Q4_1", 32, 20},  {GGMLType::Q5_0, "Q5_0", 32, 22},
                      {GGMLType::Q5_1, "Q5_1", 32, 24},  {GGMLType::Q8_0, "Q8_0", 32, 34},
                      {GGMLType::Q2_K, "Q2_K", 256, 84}, {GGMLType::Q3_K, "Q3_K", 256, 110},
                      {GGMLType::Q4_K, "Q4_K", 256, 144}, {GGMLType::Q5_K, "Q5_K", 256, 176},
                      {GGMLType::Q6_K, "Q6_K", 256, 210}, {GGMLType::Q8_K, "Q8_K", 256, 292},
                      {GGMLType::I8, "I8", 1, 1},        {GGMLType::I32, "I32", 1, 4},
                      {GGMLType::F64, "F64", 1, 8}};
  for (const Row& r : rows) {
    EXPECT_EQ(focus::io::type_name(r.t), r.name);
    EXPECT_EQ(focus::io::type_block_elems(r.t), r.elems) << r.name;
    EXPECT_EQ(focus::io::type_block_bytes(r.t), r.bytes) << r.name;
    EXPECT_TRUE(focus::io::type_supported(r.t)) << r.name;
  }
  EXPECT_EQ(focus::io::type_name(static_cast<GGMLType>(77)), "type#77");
  EXPECT_EQ(focus::io::type_name(static_cast<GGMLType>(4)), "type#4");  // removed Q4_2
  EXPECT_EQ(focus::io::type_block_bytes(static_cast<GGMLType>(77)), 0u);
  EXPECT_FALSE(focus::io::type_supported(static_cast<GGMLType>(77)));
  EXPECT_FALSE(focus::io::type_supported(GGMLType::Q8_1));
  EXPECT_FALSE(focus::io::type_supported(static_cast<GGMLType>(16)));  // IQ2_XXS

  EXPECT_EQ(focus::io::row_bytes(GGMLType::Q4_K, 512), 288u);
  EXPECT_EQ(focus::io::row_bytes(GGMLType::F16, 7), 14u);
  EXPECT_THROW(focus::io::row_bytes(GGMLType::Q4_0, 33), focus::Error);
  EXPECT_THROW(focus::io::row_bytes(static_cast<GGMLType>(77), 32), focus::Error);
  std::vector<float> y(32);
  const std::string blk(34, '\0');
  EXPECT_THROW(focus::io::dequantize(GGMLType::Q8_0, blk.data(), y.data(), 31), focus::Error);
  try {
    focus::io::dequantize(GGMLType::Q8_1, blk.data(), y.data(), 32);
    ADD_FAILURE() << "Q8_1 dequantised";
  } catch (const focus::Error& e) {
    EXPECT_NE(std::string(e.what()).find("Q8_1"), std::string::npos) << e.what();
  }
}

TEST(GgmlTypes, HalfToFloatExhaustive) {
  for (uint32_t u = 0; u < 65536; ++u) {
    const float got = focus::io::fp16_to_fp32((uint16_t)u);
    const double want = half_value((uint16_t)u);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << std::hex << u;
      ASSERT_EQ(fbits(got) >> 31, u >> 15) << std::hex << u;  // sign kept
      ASSERT_EQ((fbits(got) >> 13) & 1023, u & 1023) << std::hex << u;  // payload kept
    } else {
      ASSERT_EQ(fbits(got), fbits((float)want)) << std::hex << u;
    }
  }
  EXPECT_EQ(focus::io::fp16_to_fp32(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(focus::io::fp16_to_fp32(0x7BFF), 65504.0f);
  EXPECT_EQ(focus::io::fp16_to_fp32(0xFC00), -INFINITY);
  EXPECT_EQ(fbits(focus::io::fp16_to_fp32(0x8000)), 0x80000000u);
}

TEST(GgmlTypes, FloatToHalfRoundsToNearestEven) {
  using focus::io::fp16_to_fp32;
  using focus::io::fp32_to_fp16;
  // Every half survives a round trip (NaN stays NaN).
  for (uint32_t u = 0; u < 65536; ++u) {
    const uint16_t x = (uint16_t)u;
    const uint16_t back = fp32_to_fp16(fp16_to_fp32(x));
    if ((x & 0x7C00) == 0x7C00 && (x & 0x3FF)) {
      EXPECT_TRUE((back & 0x7C00) == 0x7C00 && (back & 0x3FF)) << std::hex << u;
    } else {
      ASSERT_EQ(back, x) << std::hex << u;
    }
  }
  // Midpoints between neighbouring positive halves round to the even one; a hair off goes the other way.
  for (uint32_t u = 0; u < 0x7BFF; ++u) {
    const double lo = half_value((uint16_t)u), hi = half_value((uint16_t)(u + 1));
    const float mid = (float)((lo + hi) / 2);  // exact: halves have 11 significant bits
    ASSERT_EQ((double)mid, (lo + hi) / 2);
    const uint16_t even = (u & 1) ? (uint16_t)(u + 1) : (uint16_t)u;
    ASSERT_EQ(fp32_to_fp16(mid), even) << std::hex << u;
    ASSERT_EQ(fp32_to_fp16(std::nextafter(mid, 0.0f)), (uint16_t)u) << std::hex << u;
    ASSERT_EQ(fp32_to_fp16(std::nextafter(mid, INFINITY)), (uint16_t)(u + 1)) << std::hex << u;
    ASSERT_EQ(fp32_to_fp16(-mid), (uint16_t)(even | 0x8000)) << std::hex << u;
  }
  EXPECT_EQ(fp32_to_fp16(65519.996f), 0x7BFF);
  EXPECT_EQ(fp32_to_fp16(65520.0f), 0x7C00);  // ties to even: overflows to inf
  EXPECT_EQ(fp32_to_fp16(1e10f), 0x7C00);
  EXPECT_EQ(fp32_to_fp16(-INFINITY), 0xFC00);
  EXPECT_EQ(fp32_to_fp16(std::ldexp(1.0f, -25)), 0x0000);  // half the smallest subnormal: ties to 0
  EXPECT_EQ(fp32_to_fp16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  EXPECT_EQ(fp32_to_fp16(1e-30f), 0x0000);
  const uint16_t n = fp32_to_fp16(std::nanf(""));
  EXPECT_TRUE((n & 0x7C00) == 0x7C00 && (n & 0x3FF));
}

TEST(GgmlTypes, BFloat16) {
  EXPECT_EQ(focus::io::bf16_to_fp32(0x3F80), 1.0f);
  EXPECT_EQ(focus::io::bf16_to_fp32(0xC040), -3.0f);
  EXPECT_EQ(focus::io::bf16_to_fp32(0x7F80), INFINITY);
  EXPECT_EQ(focus::io::bf16_to_fp32(0x0001), std::ldexp(1.0f, -133));
  EXPECT_TRUE(std::isnan(focus::io::bf16_to_fp32(0x7FC0)));
}

// ================================================================ dequantisation

// Hand-written blocks with values worked out by hand.
TEST(Dequantize, HandWorkedBlocks) {
  std::vector<float> y(256);
  {  // Q8_0: d = 0.5, q = -128, 1, 2, ..., 31
    std::string b(34, '\0');
    b[0] = 0x00, b[1] = 0x38;
    for (int i = 0; i < 32; ++i) b[2 + i] = (char)(i == 0 ? -128 : i);
    focus::io::dequantize(GGMLType::Q8_0, b.data(), y.data(), 32);
    EXPECT_EQ(y[0], -64.0f);
    for (int i = 1; i < 32; ++i) EXPECT_EQ(y[i], 0.5f * i);
  }
  {  // Q4_0: d = 2, byte j = (j + 1) << 4 | j  ->  y[j] = 2 (j - 8), y[j+16] = 2 (j + 1 - 8)
    std::string b(18, '\0');
    b[0] = 0x00, b[1] = 0x40;
    for (int j = 0; j < 16; ++j) b[2 + j] = (char)((((j + 1) & 15) << 4) | j);
    focus::io::dequantize(GGMLType::Q4_0, b.data(), y.data(), 32);
    for (int j = 0; j < 16; ++j) {
      EXPECT_EQ(y[j], 2.0f * (j - 8));
      EXPECT_EQ(y[j + 16], 2.0f * (((j + 1) & 15) - 8));
    }
  }
  {  // Q4_1: d = 0.25, m = -1, all nibbles 0xF -> -1 + 3.75
    std::string b(20, '\xFF');
    b[0] = 0x00, b[1] = 0x34, b[2] = 0x00, b[3] = (char)0xBC;
    focus::io::dequantize(GGMLType::Q4_1, b.data(), y.data(), 32);
    for (int i = 0; i < 32; ++i) EXPECT_EQ(y[i], 2.75f);
  }
  {  // Q5_0: d = 1, nibbles 0, qh has only bit 17 set -> y = -16 except y[17] = 0
    std::string b(22, '\0');
    b[0] = 0x00, b[1] = 0x3C, b[2 + 2] = 0x02;  // qh byte 2, bit 1 = bit 17
    focus::io::dequantize(GGMLType::Q5_0, b.data(), y.data(), 32);
    for (int i = 0; i < 32; ++i) EXPECT_EQ(y[i], i == 17 ? 0.0f : -16.0f) << i;
  }
  {  // Q6_K: d = 1, all scales 1, ql = 0, qh = 0 except qh[0] = 0b00000011 -> element 0 is 48 - 32 = 16
    std::string b(210, '\0');
    for (int i = 0; i < 16; ++i) b[192 + i] = 1;
    b[128] = 0x03;
    b[208] = 0x00, b[209] = 0x3C;
    focus::io::dequantize(GGMLType::Q6_K, b.data(), y.data(), 256);
    EXPECT_EQ(y[0], 16.0f);
    for (int i = 1; i < 256; ++i) EXPECT_EQ(y[i], -32.0f) << i;
  }
  {  // Q4_K: d = 1, dmin = 1; sub-block 5 has scale 33 (0b100001) and min 2; its nibbles 3 -> 33*3 - 2
    std::string b(144, '\0');
    b[1] = 0x3C, b[3] = 0x3C;
    // j = 5 >= 4: scale low 4 bits in byte 9 low nibble, high 2 bits in byte 1 top bits;
    // min low 4 bits in byte 9 high nibble, high 2 bits in byte 5 top bits.
    b[4 + 9] = (char)((2 << 4) | (33 & 15));
    b[4 + 1] = (char)((33 >> 4) << 6);
    for (int l = 0; l < 32; ++l) b[16 + 2 * 32 + l] = (char)0x30;  // chunk 2, high nibble = sub-block 5
    focus::io::dequantize(GGMLType::Q4_K, b.data(), y.data(), 256);
    for (int i = 0; i < 256; ++i) EXPECT_EQ(y[i], (i >= 160 && i < 192) ? 33.0f * 3 - 2 : 0.0f) << i;
  }
}

// Random blocks of every supported type against the element-wise reference formulas.
TEST(Dequantize, AllTypesMatchFormatDefinitions) {
  std::mt19937 rng(1234);
  for (GGMLType t : kSupported) {
    for (bool dyadic : {true, false}) {
      const int64_t nb = 37;
      const std::string bytes = random_blocks(t, nb, rng, dyadic);
      const int64_t n = nb * (int64_t)focus::io::type_block_elems(t);
      std::vector<float> got(n);
      focus::io::dequantize(t, bytes.data(), got.data(), n);
      expect_same_floats(got, reference(t, bytes), focus::io::type_name(t) + (dyadic ? " (dyadic)" : " (random)"));
    }
  }
}

TEST(Dequantize, PlainIntegerAndDoubleTypes) {
  std::vector<float> y(3);
  const int8_t i8[3] = {-128, 0, 127};
  focus::io::dequantize(GGMLType::I8, i8, y.data(), 3);
  EXPECT_EQ(y, (std::vector<float>{-128, 0, 127}));
  const int32_t i32[3] = {-7, 1 << 24, 5};
  focus::io::dequantize(GGMLType::I32, i32, y.data(), 3);
  EXPECT_EQ(y, (std::vector<float>{-7, 16777216.0f, 5}));
  const double f64[3] = {0.5, -1e300, 3.25};
  focus::io::dequantize(GGMLType::F64, f64, y.data(), 3);
  EXPECT_EQ(y[0], 0.5f);
  EXPECT_EQ(y[1], -INFINITY);
  EXPECT_EQ(y[2], 3.25f);
}

// A GGUF holding a tensor of every supported type (3 rows of 2 blocks) round-trips through to_float.
TEST(GgufFile, TensorsOfEveryType) {
  std::mt19937 rng(99);
  Builder g;
  g.kv_str("general.architecture", "test");
  std::vector<std::string> datas;
  for (GGMLType t : kSupported) {
    const uint64_t be = focus::io::type_block_elems(t);
    datas.push_back(random_blocks(t, 6, rng, false));
    g.tensor("t." + focus::io::type_name(t), {2 * be, 3}, t, datas.back());
  }
  TempFile f("every_type.gguf", g.build());
  GGUFFile file(f.path);
  ASSERT_EQ(file.tensors().size(), std::size(kSupported));
  for (size_t k = 0; k < std::size(kSupported); ++k) {
    const GGMLType t = kSupported[k];
    const auto& ten = file.tensor("t." + focus::io::type_name(t));
    EXPECT_EQ(ten.type, t);
    EXPECT_EQ(ten.n_elements(), (int64_t)(6 * focus::io::type_block_elems(t)));
    EXPECT_EQ(ten.nbytes, datas[k].size());
    EXPECT_EQ(ten.offset % 32, 0u);
    EXPECT_EQ(std::memcmp(ten.data, datas[k].data(), ten.nbytes), 0);
    expect_same_floats(file.to_float(ten), reference(t, datas[k]), focus::io::type_name(t));
  }
}

// A large tensor (parallel path) gives the same result as one dequantize call.
TEST(GgufFile, LargeTensorParallelMatchesSerial) {
  std::mt19937 rng(7);
  const std::string data = random_blocks(GGMLType::Q4_K, 2 * 1000, rng, false);
  Builder g;
  g.tensor("big", {512, 1000}, GGMLType::Q4_K, data);
  TempFile f("big.gguf", g.build());
  GGUFFile file(f.path);
  std::vector<float> serial(512 * 1000);
  focus::io::dequantize(GGMLType::Q4_K, data.data(), serial.data(), (int64_t)serial.size());
  expect_same_floats(file.to_float(file.tensor("big")), serial, "big");
}
