// GGUF file tests: metadata of every value type, and malformed files, each of which must fail
// with focus::Error naming the file and the problem.
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
