// GGUF reader and dequantisation tests:
//  - hand-built blocks of every supported type checked against expectations written from the
//    block format definitions;
//  - malformed files, each of which must fail with focus::Error naming the file and the problem;
//  - the cached real models compared tensor by tensor with the `gguf` Python package
//    (scripts/gguf_reference.py).
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
#include "test_util.h"

namespace fs = std::filesystem;
using focus::io::GGMLType;
using focus::io::GGUFFile;

namespace {

// ================================================================ helpers

fs::path scratch_dir() {
  fs::path d = fs::temp_directory_path() / ("focus_test_gguf_" + std::to_string(::getpid()));
  fs::create_directories(d);
  return d;
}

// A file in the scratch directory, removed when it goes out of scope.
struct TempFile {
  std::string path;
  TempFile(const std::string& name, const std::string& bytes) : path((scratch_dir() / name).string()) {
    std::ofstream(path, std::ios::binary).write(bytes.data(), (std::streamsize)bytes.size());
  }
  ~TempFile() {
    std::error_code ec;
    fs::remove(path, ec);
    fs::remove(fs::path(path).parent_path(), ec);  // only succeeds once the directory is empty
  }
};

// Little-endian byte writer.
struct Bytes {
  std::string b;
  template <typename T>
  Bytes& put(T v) {
    b.append(reinterpret_cast<const char*>(&v), sizeof(T));
    return *this;
  }
  Bytes& str(const std::string& s) {
    put<uint64_t>(s.size());
    b += s;
    return *this;
  }
};

enum VT : uint32_t {
  V_UINT8 = 0, V_INT8, V_UINT16, V_INT16, V_UINT32, V_INT32, V_FLOAT32, V_BOOL, V_STRING, V_ARRAY,
  V_UINT64, V_INT64, V_FLOAT64,
};

// Builds GGUF files. Tensor data offsets are laid out automatically (aligned) unless given.
struct Builder {
  uint32_t version = 3;
  uint64_t alignment = 32;  // layout only; add a general.alignment kv to change the file's
  std::string kvs;
  uint64_t n_kv = 0;
  struct Tensor {
    std::string name;
    std::vector<uint64_t> ne;
    uint32_t type;
    std::string data;
    std::optional<uint64_t> offset;  // automatic when absent
  };
  std::vector<Tensor> tensors;

  // Raw entry: key, value type, encoded value.
  Builder& kv_raw(const std::string& key, uint32_t type, const std::string& value) {
    Bytes w;
    w.str(key).put<uint32_t>(type);
    kvs += w.b + value;
    ++n_kv;
    return *this;
  }
  template <typename T>
  Builder& kv(const std::string& key, uint32_t type, T v) {
    return kv_raw(key, type, Bytes().put(v).b);
  }
  Builder& kv_str(const std::string& key, const std::string& v) { return kv_raw(key, V_STRING, Bytes().str(v).b); }
  template <typename T>
  Builder& kv_array(const std::string& key, uint32_t elem, const std::vector<T>& v) {
    Bytes w;
    w.put<uint32_t>(elem).put<uint64_t>(v.size());
    for (const T& x : v) w.put(x);
    return kv_raw(key, V_ARRAY, w.b);
  }
  Builder& kv_str_array(const std::string& key, const std::vector<std::string>& v) {
    Bytes w;
    w.put<uint32_t>(V_STRING).put<uint64_t>(v.size());
    for (const auto& s : v) w.str(s);
    return kv_raw(key, V_ARRAY, w.b);
  }
  Builder& tensor(const std::string& name, std::vector<uint64_t> ne, uint32_t type, std::string data,
                  std::optional<uint64_t> offset = std::nullopt) {
    tensors.push_back({name, std::move(ne), type, std::move(data), offset});
    return *this;
  }
  Builder& tensor(const std::string& name, std::vector<uint64_t> ne, GGMLType type, std::string data,
                  std::optional<uint64_t> offset = std::nullopt) {
    return tensor(name, std::move(ne), static_cast<uint32_t>(type), std::move(data), offset);
  }

  std::string build() const {
    Bytes w;
    w.b = "GGUF";
    w.put<uint32_t>(version).put<uint64_t>(tensors.size()).put<uint64_t>(n_kv);
    w.b += kvs;
    auto align = [&](uint64_t x) { return (x + alignment - 1) / alignment * alignment; };
    std::vector<uint64_t> offs;
    uint64_t off = 0;
    for (const Tensor& t : tensors) {
      const uint64_t o = t.offset.value_or(off);
      offs.push_back(o);
      off = align(o + t.data.size());
      w.str(t.name).put<uint32_t>((uint32_t)t.ne.size());
      for (uint64_t d : t.ne) w.put(d);
      w.put<uint32_t>(t.type).put<uint64_t>(o);
    }
    if (tensors.empty()) return w.b;  // no data section, no padding
    const size_t data_start = align(w.b.size());
    w.b.resize(data_start, '\0');
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (offs[i] > (1u << 30)) continue;  // deliberately bogus offset: no data written
      if (w.b.size() < data_start + offs[i]) w.b.resize(data_start + offs[i], '\0');
      w.b.replace(data_start + offs[i], tensors[i].data.size(), tensors[i].data);
    }
    return w.b;
  }
};

// Expects parsing `bytes` to throw focus::Error starting with the path and containing every phrase.
void expect_gguf_error(const std::string& name, const std::string& bytes, const std::vector<std::string>& phrases) {
  TempFile f(name, bytes);
  try {
    GGUFFile g(f.path);
    ADD_FAILURE() << name << ": parsed without error";
  } catch (const focus::Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.rfind(f.path + ": ", 0), 0u) << "message does not start with the path: " << m;
    for (const auto& p : phrases) EXPECT_NE(m.find(p), std::string::npos) << "missing '" << p << "' in: " << m;
  }
}

uint32_t fbits(float f) { return std::bit_cast<uint32_t>(f); }

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

// ================================================================ metadata

TEST(GgufFile, MetadataOfEveryType) {
  Builder g;
  g.version = 2;
  g.kv<uint8_t>("u8", V_UINT8, 200)
      .kv<int8_t>("i8", V_INT8, -100)
      .kv<uint16_t>("u16", V_UINT16, 60000)
      .kv<int16_t>("i16", V_INT16, -30000)
      .kv<uint32_t>("u32", V_UINT32, 4000000000u)
      .kv<int32_t>("i32", V_INT32, -2000000000)
      .kv<uint64_t>("u64", V_UINT64, 18000000000000000000ull)
      .kv<int64_t>("i64", V_INT64, -9000000000000000000ll)
      .kv<float>("f32", V_FLOAT32, 0.1f)
      .kv<double>("f64", V_FLOAT64, 0.1)
      .kv<uint8_t>("bool", V_BOOL, 1)
      .kv_str("str", std::string("h\0llo", 5))
      .kv_array<int32_t>("ai32", V_INT32, {-1, 2, 3})
      .kv_array<uint8_t>("abool", V_BOOL, {1, 0})
      .kv_array<uint64_t>("au64", V_UINT64, {7})
      .kv_array<float>("af32", V_FLOAT32, {0.5f, -2.0f})
      .kv_array<double>("af64", V_FLOAT64, {1e300})
      .kv_array<int16_t>("aempty", V_INT16, {})
      .kv_str_array("astr", {"a", "", "ccc"})
      .kv<uint32_t>("general.alignment", V_UINT32, 64);
  g.alignment = 64;
  g.tensor("w", {4}, GGMLType::F32, Bytes().put(1.0f).put(2.0f).put(3.0f).put(4.0f).b);
  g.tensor("v", {2}, GGMLType::F32, Bytes().put(5.0f).put(6.0f).b);
  TempFile f("meta.gguf", g.build());
  GGUFFile file(f.path);
  EXPECT_EQ(file.version(), 2u);
  EXPECT_EQ(file.alignment(), 64u);
  EXPECT_EQ(file.metadata().size(), 20u);
  EXPECT_EQ(std::get<uint64_t>(file.get("u8")), 200u);
  EXPECT_EQ(std::get<int64_t>(file.get("i8")), -100);
  EXPECT_EQ(std::get<uint64_t>(file.get("u16")), 60000u);
  EXPECT_EQ(std::get<int64_t>(file.get("i16")), -30000);
  EXPECT_EQ(std::get<uint64_t>(file.get("u32")), 4000000000u);
  EXPECT_EQ(std::get<int64_t>(file.get("i32")), -2000000000);
  EXPECT_EQ(std::get<uint64_t>(file.get("u64")), 18000000000000000000ull);
  EXPECT_EQ(std::get<int64_t>(file.get("i64")), -9000000000000000000ll);
  EXPECT_EQ(std::get<double>(file.get("f32")), (double)0.1f);
  EXPECT_EQ(std::get<double>(file.get("f64")), 0.1);
  EXPECT_EQ(std::get<bool>(file.get("bool")), true);
  EXPECT_EQ(file.get_string("str"), std::string("h\0llo", 5));
  EXPECT_EQ(file.get_int_array("ai32"), (std::vector<int64_t>{-1, 2, 3}));
  EXPECT_EQ(file.get_int_array("abool"), (std::vector<int64_t>{1, 0}));
  EXPECT_EQ(file.get_int_array("au64"), (std::vector<int64_t>{7}));
  EXPECT_EQ(file.get_float_array("af32"), (std::vector<double>{0.5, -2.0}));
  EXPECT_EQ(file.get_float_array("af64"), (std::vector<double>{1e300}));
  EXPECT_EQ(file.get_float_array("ai32"), (std::vector<double>{-1, 2, 3}));
  EXPECT_TRUE(file.get_int_array("aempty").empty());
  EXPECT_EQ(file.get_string_array("astr"), (std::vector<std::string>{"a", "", "ccc"}));

  // Typed getters: conversions, defaults, and errors naming the file and key.
  EXPECT_EQ(file.get_int("u32"), 4000000000ll);
  EXPECT_EQ(file.get_int("i8"), -100);
  EXPECT_EQ(file.get_int("bool"), 1);
  EXPECT_EQ(file.get_int("missing", 42), 42);
  EXPECT_EQ(file.get_float("f32"), (double)0.1f);
  EXPECT_EQ(file.get_float("u16"), 60000.0);
  EXPECT_EQ(file.get_float("missing", 2.5), 2.5);
  EXPECT_EQ(file.get_string("missing", "dflt"), "dflt");
  auto expect_err = [&](const std::function<void()>& fn, const std::string& phrase) {
    try {
      fn();
      ADD_FAILURE() << "no error (" << phrase << ")";
    } catch (const focus::Error& e) {
      const std::string m = e.what();
      EXPECT_EQ(m.rfind(f.path + ": ", 0), 0u) << m;
      EXPECT_NE(m.find(phrase), std::string::npos) << m;
    }
  };
  expect_err([&] { file.get("nope"); }, "missing metadata key 'nope'");
  expect_err([&] { file.get_int("nope"); }, "'nope'");
  expect_err([&] { file.get_int("str"); }, "'str' is a string, expected an integer");
  expect_err([&] { file.get_int("u64"); }, "too large");
  expect_err([&] { file.get_int("str", 3); }, "expected an integer");  // present but wrong kind
  expect_err([&] { file.get_float("astr"); }, "expected a number");
  expect_err([&] { file.get_string("u8"); }, "expected a string");
  expect_err([&] { file.get_string_array("ai32"); }, "expected a string array");
  expect_err([&] { file.get_int_array("af32"); }, "expected an integer array");
  expect_err([&] { file.get_float_array("astr"); }, "expected a numeric array");
  expect_err([&] { file.tensor("nope"); }, "missing tensor 'nope'");

  // Tensor table with the custom alignment.
  ASSERT_EQ(file.tensors().size(), 2u);
  EXPECT_EQ(file.find("nope"), nullptr);
  const auto& v = file.tensor("v");
  EXPECT_EQ(v.offset, 64u);
  EXPECT_EQ(v.ne, (std::vector<int64_t>{2}));
  EXPECT_EQ(file.to_float(v), (std::vector<float>{5, 6}));
  EXPECT_EQ(file.to_float(file.tensor("w")), (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ((v.data - file.tensor("w").data), 64);
}

TEST(GgufFile, EmptyTensorAndKnownButUnsupportedType) {
  Builder g;
  g.tensor("empty", {0, 4}, GGMLType::F32, "");
  g.tensor("iq", {256, 1}, 16u /* IQ2_XXS */, std::string(66, '\0'));
  TempFile f("unsupported.gguf", g.build());
  GGUFFile file(f.path);
  EXPECT_EQ(file.tensor("empty").n_elements(), 0);
  EXPECT_TRUE(file.to_float(file.tensor("empty")).empty());
  try {
    file.to_float(file.tensor("iq"));
    ADD_FAILURE() << "IQ2_XXS dequantised";
  } catch (const focus::Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.rfind(f.path + ": ", 0), 0u) << m;
    EXPECT_NE(m.find("tensor 'iq' has type IQ2_XXS"), std::string::npos) << m;
  }
}

// ================================================================ malformed files

namespace {
std::string header_only(uint32_t version, uint64_t n_tensors, uint64_t n_kv) {
  return Bytes().put<uint32_t>(0x46554747u).put(version).put(n_tensors).put(n_kv).b;  // "GGUF"
}
}  // namespace

TEST(GgufMalformed, EmptyFile) { expect_gguf_error("empty.gguf", "", {"empty file", "GGUF"}); }

TEST(GgufMalformed, WrongMagic) {
  expect_gguf_error("magic.gguf", "GGUX" + std::string(60, '\0'), {"not a GGUF file", "bad magic 'GGUX'"});
  expect_gguf_error("magic_short.gguf", "GG", {"bad magic"});
  expect_gguf_error("magic_bin.gguf", std::string("\x01\x02GG", 4) + std::string(60, '\0'), {"bad magic '\\x01"});
}

TEST(GgufMalformed, UnsupportedVersions) {
  expect_gguf_error("v1.gguf", header_only(1, 0, 0), {"GGUF version 1 is not supported"});
  expect_gguf_error("v99.gguf", header_only(99, 0, 0), {"unsupported GGUF version 99"});
  expect_gguf_error("v0.gguf", header_only(0, 0, 0), {"unsupported GGUF version 0"});
  expect_gguf_error("be.gguf", header_only(0x03000000u, 0, 0), {"big-endian"});
}

TEST(GgufMalformed, TruncatedHeader) {
  const std::string full = header_only(3, 0, 0);
  expect_gguf_error("trunc_header.gguf", full.substr(0, 10), {"truncated", "header"});
  expect_gguf_error("trunc_header2.gguf", full.substr(0, 23), {"truncated", "kv count"});
  // A well-formed file with no tensors and no metadata is fine.
  TempFile f("minimal.gguf", full);
  EXPECT_NO_THROW(GGUFFile g(f.path));
}

TEST(GgufMalformed, TruncatedMetadataString) {
  Builder g;
  g.kv_str("general.architecture", "llama");
  const std::string full = g.build();
  // Cut inside the value string: its length field promises more bytes than remain.
  expect_gguf_error("trunc_str.gguf", full.substr(0, full.size() - 2),
                    {"string length 5", "general.architecture", "truncated"});
  // Cut inside the value type.
  expect_gguf_error("trunc_type.gguf", full.substr(0, 24 + 8 + 20 + 2), {"truncated", "value type"});
}

TEST(GgufMalformed, TruncatedScalarValue) {
  Builder g;
  g.kv<uint64_t>("x.count", V_UINT64, 7);
  const std::string full = g.build();
  expect_gguf_error("trunc_value.gguf", full.substr(0, full.size() - 3), {"truncated", "'x.count'"});
}

TEST(GgufMalformed, AbsurdStringLength) {
  std::string b = header_only(3, 0, 1);
  b += Bytes().put<uint64_t>(1ull << 60).b + "general.architecture";
  expect_gguf_error("absurd_string.gguf", b, {"string length 1152921504606846976", "metadata entry 0"});
}

TEST(GgufMalformed, AbsurdCounts) {
  expect_gguf_error("absurd_kv.gguf", header_only(3, 0, 1ull << 50) + std::string(100, '\0'),
                    {"kv count 1125899906842624", "impossible"});
  expect_gguf_error("absurd_tensors.gguf", header_only(3, 1ull << 50, 0) + std::string(100, '\0'),
                    {"tensor count 1125899906842624", "impossible"});
  expect_gguf_error("max_kv.gguf", header_only(3, 0, ~0ull), {"kv count 18446744073709551615"});
}

TEST(GgufMalformed, AbsurdArrayCount) {
  Builder g;
  g.kv_raw("tokenizer.ggml.tokens", V_ARRAY, Bytes().put<uint32_t>(V_STRING).put<uint64_t>(1ull << 61).b);
  expect_gguf_error("absurd_array.gguf", g.build(), {"array count 2305843009213693952", "tokenizer.ggml.tokens"});
  Builder g2;
  g2.kv_raw("scores", V_ARRAY, Bytes().put<uint32_t>(V_FLOAT32).put<uint64_t>(1000).put(1.0f).b);
  expect_gguf_error("short_array.gguf", g2.build(), {"array count 1000", "'scores'"});
}

TEST(GgufMalformed, UnknownValueTypes) {
  Builder g;
  g.kv_raw("weird", 13, Bytes().put<uint32_t>(0).b);
  expect_gguf_error("value_type.gguf", g.build(), {"unknown metadata value type 13", "'weird'"});
  Builder g2;
  g2.kv_raw("weird_array", V_ARRAY, Bytes().put<uint32_t>(99).put<uint64_t>(1).put<uint32_t>(0).b);
  expect_gguf_error("array_type.gguf", g2.build(), {"unknown array element type 99", "'weird_array'"});
}

TEST(GgufMalformed, NestedArray) {
  Builder g;
  g.kv_raw("nested", V_ARRAY,
           Bytes().put<uint32_t>(V_ARRAY).put<uint64_t>(1).put<uint32_t>(V_INT32).put<uint64_t>(1).put<int32_t>(5).b);
  expect_gguf_error("nested.gguf", g.build(), {"nested arrays", "'nested'"});
}

TEST(GgufMalformed, DuplicateKey) {
  Builder g;
  g.kv<uint32_t>("llama.block_count", V_UINT32, 1).kv<uint32_t>("llama.block_count", V_UINT32, 2);
  expect_gguf_error("dup_key.gguf", g.build(), {"duplicate metadata key 'llama.block_count'"});
}

TEST(GgufMalformed, BadAlignment) {
  for (uint32_t a : {0u, 3u, 48u}) {
    Builder g;
    g.kv<uint32_t>("general.alignment", V_UINT32, a);
    expect_gguf_error("align" + std::to_string(a) + ".gguf", g.build(),
                      {"invalid general.alignment " + std::to_string(a), "power of two"});
  }
  Builder g;
  g.kv_str("general.alignment", "32");
  expect_gguf_error("align_str.gguf", g.build(), {"general.alignment is a string"});
}

TEST(GgufMalformed, TooManyDimensions) {
  Builder g;
  g.tensor("blk.0.attn_q.weight", {1, 1, 1, 1, 32}, GGMLType::F32, std::string(128, '\0'));
  expect_gguf_error("ndims5.gguf", g.build(), {"tensor 'blk.0.attn_q.weight' has 5 dimensions"});
  Builder g0;
  g0.tensor("scalar", {}, GGMLType::F32, std::string(4, '\0'));
  expect_gguf_error("ndims0.gguf", g0.build(), {"tensor 'scalar' has 0 dimensions"});
}

TEST(GgufMalformed, NegativeAndOverflowingDimensions) {
  Builder g;
  g.tensor("neg", {32, ~0ull}, GGMLType::F32, "");
  expect_gguf_error("neg_dim.gguf", g.build(), {"tensor 'neg' has invalid dimension ne[1] = -1"});
  Builder g2;
  g2.tensor("huge", {1ull << 32, 1ull << 32}, GGMLType::F32, "");
  expect_gguf_error("overflow_dim.gguf", g2.build(), {"tensor 'huge'", "element count overflows"});
  Builder g3;  // element count fits in int64 but the byte size does not
  g3.tensor("bytes", {1ull << 31, 1ull << 31}, GGMLType::F64, "");
  expect_gguf_error("overflow_bytes.gguf", g3.build(), {"tensor 'bytes'", "overflows"});
}

TEST(GgufMalformed, UnknownTensorType) {
  Builder g;
  g.tensor("token_embd.weight", {8, 4}, 77u, std::string(256, '\0'));
  expect_gguf_error("tensor_type.gguf", g.build(), {"tensor 'token_embd.weight' has unknown tensor type id 77"});
}

TEST(GgufMalformed, RowNotMultipleOfBlock) {
  Builder g;
  g.tensor("q", {48, 2}, GGMLType::Q4_0, std::string(54, '\0'));
  expect_gguf_error("row_block.gguf", g.build(), {"tensor 'q'", "row size 48 is not a multiple of the Q4_0 block size 32"});
}

TEST(GgufMalformed, TensorDataPastEndOfFile) {
  Builder g;
  g.tensor("blk.0.attn_q.weight", {64, 64}, GGMLType::F32, std::string(64 * 64 * 4, '\0'));
  std::string b = g.build();
  b.resize(b.size() - 100);
  expect_gguf_error("past_end.gguf", b, {"tensor 'blk.0.attn_q.weight' data [offset ", ", 16384 bytes] runs past end of file (size "});
  Builder g2;  // huge offset: start + offset overflows
  g2.tensor("far", {8}, GGMLType::F32, "", ~0ull - 31);
  expect_gguf_error("far.gguf", g2.build(), {"tensor 'far' data [offset 64 + 18446744073709551584, 32 bytes]", "runs past end of file"});
  Builder g3;  // offset inside the file, data running past its end
  g3.tensor("a", {8}, GGMLType::F32, std::string(32, '\0'));
  g3.tensor("b", {16}, GGMLType::F32, "", 32);
  expect_gguf_error("overrun.gguf", g3.build(), {"tensor 'b' data [offset 128, 64 bytes] runs past end of file (size 128)"});
}

TEST(GgufMalformed, MisalignedOffset) {
  Builder g;
  g.tensor("a", {8}, GGMLType::F32, std::string(32, '\0'), 4);
  expect_gguf_error("misaligned.gguf", g.build(), {"tensor 'a' offset 4 is misaligned", "alignment 32"});
}

TEST(GgufMalformed, DuplicateTensorName) {
  Builder g;
  g.tensor("a", {8}, GGMLType::F32, std::string(32, '\0'));
  g.tensor("a", {8}, GGMLType::F32, std::string(32, '\0'));
  expect_gguf_error("dup_tensor.gguf", g.build(), {"duplicate tensor name 'a'"});
}

TEST(GgufMalformed, TruncatedTensorInfo) {
  const std::string name = "blk.0.ffn_up.weight";
  Builder g;
  g.tensor(name, {8, 2}, GGMLType::F32, "");
  const std::string full = g.build();
  const size_t info_end = 24 + 8 + name.size() + 4 + 16 + 4 + 8;
  expect_gguf_error("trunc_info.gguf", full.substr(0, info_end - 5), {"truncated", "offset of tensor '" + name + "'"});
  expect_gguf_error("trunc_info2.gguf", full.substr(0, 24 + 8 + name.size() + 4 + 10),
                    {"truncated", "dimension of tensor '" + name + "'"});
}

TEST(GgufMalformed, NotAFile) {
  const std::string dir = scratch_dir().string();
  try {
    GGUFFile g(dir);
    ADD_FAILURE() << "directory parsed";
  } catch (const focus::Error& e) {
    EXPECT_NE(std::string(e.what()).find(dir), std::string::npos) << e.what();
  }
  EXPECT_THROW(GGUFFile g(dir + "/does-not-exist.gguf"), focus::Error);
  std::error_code ec;
  fs::remove(dir, ec);
}

// Cuts of a real model at many points: every one must fail cleanly.
TEST(GgufMalformed, TruncatedRealModel) {
  const std::string model = focus::test::smollm2_path();
  FOCUS_NEED_FILE(model);
  const std::string all = focus::read_file(model);
  for (size_t cut : {size_t(3), size_t(20), size_t(100), size_t(2000), size_t(100000), size_t(1000000),
                     size_t(1785000), all.size() / 2, all.size() - 1}) {
    TempFile f("trunc_real.gguf", all.substr(0, cut));
    try {
      GGUFFile g(f.path);
      ADD_FAILURE() << "cut at " << cut << " parsed";
    } catch (const focus::Error& e) {
      const std::string m = e.what();
      EXPECT_EQ(m.rfind(f.path + ": ", 0), 0u) << m;
      const bool specific = m.find("truncated") != std::string::npos || m.find("past end of file") != std::string::npos ||
                            m.find("impossible") != std::string::npos || m.find("bad magic") != std::string::npos;
      EXPECT_TRUE(specific) << "cut at " << cut << ": " << m;
    }
  }
}

// ================================================================ real models

namespace {

bool python_gguf_available() {
  return std::system("python3 -c 'import gguf, numpy' >/dev/null 2>&1") == 0;
}

std::vector<uint8_t> from_hex(const std::string& s) {
  std::vector<uint8_t> out(s.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) out[i] = (uint8_t)std::stoi(s.substr(2 * i, 2), nullptr, 16);
  return out;
}
std::string hex_string(const std::string& s) {
  const auto v = from_hex(s);
  return std::string(v.begin(), v.end());
}

// Reference JSON for `model`, cached in the temp dir by model size / mtime and script version.
// Returns an empty json (after GTEST_SKIP or failure) when it cannot be produced.
nlohmann::json reference_for(const std::string& model) {
  const std::string script = std::string(FOCUS_SOURCE_DIR) + "/scripts/gguf_reference.py";
  auto stamp = [](const std::string& p) {
    return std::to_string(fs::file_size(p)) + "_" +
           std::to_string((uint64_t)fs::last_write_time(p).time_since_epoch().count());
  };
  const fs::path dir = fs::temp_directory_path() / "focus_gguf_reference";
  fs::create_directories(dir);
  const fs::path cached = dir / (fs::path(model).stem().string() + "-" + stamp(model) + "-" + stamp(script) + ".json");
  if (!fs::exists(cached)) {
    const std::string cmd = "python3 '" + script + "' '" + model + "' '" + cached.string() + "'";
    if (std::system(cmd.c_str()) != 0 || !fs::exists(cached)) {
      ADD_FAILURE() << "reference script failed: " << cmd;
      return {};
    }
  }
  std::ifstream in(cached);
  return nlohmann::json::parse(in);
}

// Compares one metadata entry with its reference.
void check_metadata_entry(const GGUFFile& f, const nlohmann::json& e) {
  const std::string key = e["key"];
  const std::string type = e["type"];
  SCOPED_TRACE("key " + key);
  ASSERT_TRUE(f.has(key));
  const auto& v = f.get(key);
  auto check_scalar_int = [&](const std::string& t, const nlohmann::json& j, int64_t got) {
    if (t == "UINT64") EXPECT_EQ((uint64_t)got, j.get<uint64_t>());
    else EXPECT_EQ(got, j.get<int64_t>());
  };
  if (type == "STRING") {
    EXPECT_EQ(f.get_string(key), hex_string(e["value"]));
  } else if (type == "FLOAT32") {
    EXPECT_EQ(fbits((float)std::get<double>(v)), e["value"].get<uint32_t>());
  } else if (type == "FLOAT64") {
    EXPECT_EQ(std::bit_cast<uint64_t>(std::get<double>(v)), e["value"].get<uint64_t>());
  } else if (type == "BOOL") {
    EXPECT_EQ(std::get<bool>(v), e["value"].get<int>() != 0);
  } else if (type.rfind("UINT", 0) == 0) {
    EXPECT_EQ(std::get<uint64_t>(v), e["value"].get<uint64_t>());
  } else if (type.rfind("INT", 0) == 0) {
    EXPECT_EQ(std::get<int64_t>(v), e["value"].get<int64_t>());
  } else if (type == "ARRAY") {
    const std::string elem = e["elem"];
    const auto& vals = e["values"];
    if (elem == "STRING") {
      const auto& got = f.get_string_array(key);
      ASSERT_EQ(got.size(), vals.size());
      for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], hex_string(vals[i])) << i;
    } else if (elem == "FLOAT32" || elem == "FLOAT64") {
      const auto& got = std::get<std::vector<double>>(v);
      ASSERT_EQ(got.size(), vals.size());
      for (size_t i = 0; i < got.size(); ++i) {
        if (elem == "FLOAT32") ASSERT_EQ(fbits((float)got[i]), vals[i].get<uint32_t>()) << i;
        else ASSERT_EQ(std::bit_cast<uint64_t>(got[i]), vals[i].get<uint64_t>()) << i;
      }
    } else {
      const auto& got = std::get<std::vector<int64_t>>(v);
      ASSERT_EQ(got.size(), vals.size());
      for (size_t i = 0; i < got.size(); ++i) check_scalar_int(elem, vals[i], got[i]);
    }
  } else {
    ADD_FAILURE() << "unexpected type " << type;
  }
}

void check_against_reference(const std::string& model) {
  if (!python_gguf_available()) {
    if (focus::test::require_data()) FAIL() << "python3 with the gguf and numpy packages is required";
    GTEST_SKIP() << "python3 with the gguf and numpy packages is not available";
  }
  const auto t0 = std::chrono::steady_clock::now();
  const nlohmann::json ref = reference_for(model);
  ASSERT_FALSE(ref.is_null());
  GGUFFile f(model);
  EXPECT_EQ(f.version(), ref["version"].get<uint32_t>());
  EXPECT_EQ(f.alignment(), ref["alignment"].get<size_t>());

  // Metadata: every key, every value.
  ASSERT_EQ(f.metadata().size(), ref["metadata"].size());
  for (const auto& e : ref["metadata"]) check_metadata_entry(f, e);

  // Tensors: table, sampled values bit for bit, and the full sum.
  const auto& rt = ref["tensors"];
  ASSERT_EQ(f.tensors().size(), rt.size());
  const uint8_t* data0 = f.tensors().empty() ? nullptr : f.tensors()[0].data - f.tensors()[0].offset;
  for (size_t k = 0; k < rt.size(); ++k) {
    const auto& r = rt[k];
    const auto& t = f.tensors()[k];
    SCOPED_TRACE("tensor " + t.name);
    ASSERT_EQ(t.name, r["name"].get<std::string>());
    ASSERT_EQ((uint32_t)t.type, r["type"].get<uint32_t>());
    EXPECT_EQ(focus::io::type_name(t.type), r["type_name"].get<std::string>());
    ASSERT_EQ(t.ne, r["shape"].get<std::vector<int64_t>>());
    EXPECT_EQ(t.offset, r["offset"].get<uint64_t>());
    EXPECT_EQ(t.data - data0, (ptrdiff_t)t.offset);
    ASSERT_EQ(t.n_elements(), r["n_elements"].get<int64_t>());

    const std::vector<float> x = f.to_float(t);
    const int64_t n = (int64_t)x.size();
    auto check_range = [&](const char* what, int64_t start, const nlohmann::json& bits) {
      ASSERT_LE(start + (int64_t)bits.size(), n) << what;
      for (size_t i = 0; i < bits.size(); ++i)
        ASSERT_EQ(fbits(x[start + i]), bits[i].get<uint32_t>()) << what << " element " << start + i;
    };
    check_range("first", 0, r["first"]);
    check_range("middle", r["middle_start"].get<int64_t>(), r["middle"]);
    check_range("last", n - (int64_t)r["last"].size(), r["last"]);

    // Blocked double sums keep the rounding error far below the tolerance.
    double sum = 0, abs_sum = 0;
    for (int64_t i = 0; i < n;) {
      double s = 0, a = 0;
      for (const int64_t e = std::min(n, i + 4096); i < e; ++i) {
        s += x[i];
        a += std::fabs(x[i]);
      }
      sum += s;
      abs_sum += a;
    }
    ASSERT_FALSE(r["sum"].is_null()) << "reference sum not finite";
    const double want = r["sum"], want_abs = r["abs_sum"];
    EXPECT_NEAR(sum, want, 1e-9 * want_abs + 1e-30);
    EXPECT_NEAR(abs_sum, want_abs, 1e-9 * want_abs + 1e-30);
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("  %s: %zu tensors, %zu keys checked in %.1f s\n", fs::path(model).filename().c_str(), rt.size(),
              f.metadata().size(), secs);
}

}  // namespace

TEST(GgufReal, SmolLM2MatchesPythonReference) {
  FOCUS_NEED_FILE(focus::test::smollm2_path());
  check_against_reference(focus::test::smollm2_path());
}

TEST(GgufReal, Gemma3MatchesPythonReference) {
  FOCUS_NEED_FILE(focus::test::gemma3_path());
  check_against_reference(focus::test::gemma3_path());
}

TEST(GgufReal, SmolLM2Metadata) {
  FOCUS_NEED_FILE(focus::test::smollm2_path());
  GGUFFile f(focus::test::smollm2_path());
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  EXPECT_EQ(f.get_int("llama.block_count"), 30);
  EXPECT_EQ(f.get_int("llama.attention.head_count"), 9);
  EXPECT_EQ(f.get_int("llama.attention.head_count_kv"), 3);
  EXPECT_EQ(f.get_int("llama.embedding_length"), 576);
  EXPECT_EQ(f.get_int("llama.feed_forward_length"), 1536);
  EXPECT_EQ(f.get_float("llama.rope.freq_base"), 100000.0);
  EXPECT_EQ(f.get_float("llama.attention.layer_norm_rms_epsilon"), (double)1e-5f);
  EXPECT_EQ(f.get_string_array("tokenizer.ggml.tokens").size(), 49152u);
  EXPECT_EQ(f.get_int_array("tokenizer.ggml.token_type").size(), 49152u);
  EXPECT_EQ(f.tensors().size(), 272u);
  const auto& emb = f.tensor("token_embd.weight");
  EXPECT_EQ(emb.ne, (std::vector<int64_t>{576, 49152}));
  EXPECT_EQ(emb.type, GGMLType::Q8_0);
  EXPECT_EQ(f.tensor("blk.0.attn_q.weight").type, GGMLType::Q4_1);
  EXPECT_EQ(f.tensor("output_norm.weight").type, GGMLType::F32);
}

TEST(GgufReal, Gemma3Metadata) {
  FOCUS_NEED_FILE(focus::test::gemma3_path());
  GGUFFile f(focus::test::gemma3_path());
  EXPECT_EQ(f.get_string("general.architecture"), "gemma3");
  EXPECT_EQ(f.get_int("gemma3.block_count"), 18);
  EXPECT_EQ(f.get_int("gemma3.attention.sliding_window"), 512);
  EXPECT_EQ(f.get_int("gemma3.attention.head_count"), 4);
  EXPECT_EQ(f.get_int("gemma3.attention.head_count_kv"), 1);
  EXPECT_EQ(f.get_int("gemma3.attention.key_length"), 256);
  EXPECT_EQ(f.get_int("gemma3.embedding_length"), 640);
  EXPECT_EQ(f.get_float_array("tokenizer.ggml.scores").size(), 262144u);
  EXPECT_EQ(f.tensors().size(), 236u);
  std::map<std::string, int> types;
  for (const auto& t : f.tensors()) types[focus::io::type_name(t.type)]++;
  EXPECT_EQ(types, (std::map<std::string, int>{{"F32", 109}, {"Q4_K", 27}, {"Q5_0", 81}, {"Q6_K", 9}, {"Q8_0", 10}}));
}
