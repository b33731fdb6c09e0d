// safetensors reader: hand-written files with known values (F32, F16, BF16), model folders
// (single file and sharded), and malformed files that must fail with an Error naming the file.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/safetensors.h"
#include "test_util.h"

namespace fs = std::filesystem;
using focus::io::load_safetensors_dir;
using focus::io::SafetensorsFile;

namespace {

std::string temp_dir(const std::string& name) {
  const std::string p = ::testing::TempDir() + "/focus_safetensors/" + name;
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

// A safetensors file: length, header JSON, data.
std::string st_bytes(const std::string& header, const std::string& data) {
  return le64(header.size()) + header + data;
}

template <typename T>
std::string raw(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

// Runs fn, expects focus::Error whose message starts with `path` and contains `needle`.
void expect_error(const std::function<void()>& fn, const std::string& path, const std::string& needle) {
  try {
    fn();
  } catch (const focus::Error& e) {
    const std::string msg = e.what();
    focus::test::record_error(msg);
    EXPECT_EQ(msg.rfind(path, 0), 0u) << "message does not start with the path: " << msg;
    EXPECT_NE(msg.find(needle), std::string::npos) << "message lacks '" << needle << "': " << msg;
    return;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected focus::Error, got another exception: " << e.what();
    return;
  }
  ADD_FAILURE() << "expected focus::Error mentioning '" << needle << "'";
}

// Writes a malformed file and checks that opening it fails naming the file and the problem.
void expect_bad_file(const std::string& name, const std::string& bytes, const std::string& needle) {
  const std::string p = temp_dir("bad") + "/" + name + ".safetensors";
  write_bytes(p, bytes);
  expect_error([&] { SafetensorsFile f(p); }, p, needle);
}

// Reference binary16 decoding straight from the definition.
double half_reference(uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  const double sign = s ? -1.0 : 1.0;
  if (e == 0) return sign * std::ldexp(static_cast<double>(m), -24);
  if (e == 31) return m ? std::nan("") : sign * INFINITY;
  return sign * std::ldexp(1.0 + m / 1024.0, e - 15);
}

}  // namespace

TEST(Safetensors, F32ValuesShapesAndMetadata) {
  const std::string d = temp_dir("f32");
  const std::vector<float> a = {1.5f, -2.25f, 3.0f, 0.0f, 1e-30f, -7.0e30f};
  const std::vector<float> b = {42.0f};
  const std::string header =
      R"({"__metadata__":{"format":"pt"},)"
      R"("b":{"dtype":"F32","shape":[],"data_offsets":[24,28]},)"
      R"("a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
      R"("empty":{"dtype":"F32","shape":[0,5],"data_offsets":[28,28]}})";
  write_bytes(d + "/x.safetensors", st_bytes(header, raw(a) + raw(b)));

  SafetensorsFile f(d + "/x.safetensors");
  ASSERT_EQ(f.tensors().size(), 3u);
  EXPECT_EQ(f.tensors()[0].name, "a");  // data-offset order
  EXPECT_EQ(f.metadata().at("format"), "pt");

  const auto* ta = f.find("a");
  ASSERT_NE(ta, nullptr);
  EXPECT_EQ(ta->dtype, "F32");
  EXPECT_EQ(ta->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(ta->n_elements(), 6);
  EXPECT_EQ(ta->nbytes, 24u);
  EXPECT_EQ(f.to_float(*ta), a);

  const auto* tb = f.find("b");
  ASSERT_NE(tb, nullptr);
  EXPECT_TRUE(tb->shape.empty());
  EXPECT_EQ(tb->n_elements(), 1);
  EXPECT_EQ(f.to_float(*tb), b);

  const auto* te = f.find("empty");
  ASSERT_NE(te, nullptr);
  EXPECT_EQ(te->n_elements(), 0);
  EXPECT_TRUE(f.to_float(*te).empty());

  EXPECT_EQ(f.find("missing"), nullptr);
  expect_error([&] { f.tensor("missing"); }, f.path(), "missing");
}

TEST(Safetensors, F16AllValuesExact) {
  const std::string d = temp_dir("f16");
  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  const std::string header = R"({"h":{"dtype":"F16","shape":[256,256],"data_offsets":[0,131072]}})";
  write_bytes(d + "/h.safetensors", st_bytes(header, raw(all)));

  SafetensorsFile f(d + "/h.safetensors");
  const std::vector<float> v = f.to_float(f.tensor("h"));
  ASSERT_EQ(v.size(), 65536u);
  for (uint32_t i = 0; i < 65536; ++i) {
    const double want = half_reference(static_cast<uint16_t>(i));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(v[i])) << "half 0x" << std::hex << i;
    } else {
      ASSERT_EQ(static_cast<double>(v[i]), want) << "half 0x" << std::hex << i;
      ASSERT_EQ(std::signbit(v[i]), (i & 0x8000) != 0) << "half 0x" << std::hex << i;
    }
  }
  // A few landmarks.
  EXPECT_EQ(v[0x3c00], 1.0f);
  EXPECT_EQ(v[0xc000], -2.0f);
  EXPECT_EQ(v[0x7bff], 65504.0f);
  EXPECT_EQ(v[0x0001], std::ldexp(1.0f, -24));
  EXPECT_EQ(v[0x0400], std::ldexp(1.0f, -14));
  EXPECT_EQ(v[0x3555], 0.333251953125f);
  EXPECT_TRUE(std::isinf(v[0x7c00]) && v[0x7c00] > 0);
}

TEST(Safetensors, BF16Exact) {
  const std::string d = temp_dir("bf16");
  const std::vector<uint16_t> bits = {0x3f80, 0xc040, 0x0000, 0x8000, 0x7f80, 0xff80, 0x3eab, 0x0001, 0x7fc0};
  const std::string header = R"({"w":{"dtype":"BF16","shape":[3,3],"data_offsets":[0,18]}})";
  write_bytes(d + "/b.safetensors", st_bytes(header, raw(bits)));

  SafetensorsFile f(d + "/b.safetensors");
  const std::vector<float> v = f.to_float(f.tensor("w"));
  ASSERT_EQ(v.size(), 9u);
  for (size_t i = 0; i < bits.size(); ++i) {
    const uint32_t want_bits = static_cast<uint32_t>(bits[i]) << 16;
    uint32_t got_bits;
    std::memcpy(&got_bits, &v[i], 4);
    EXPECT_EQ(got_bits, want_bits) << i;
  }
  EXPECT_EQ(v[0], 1.0f);
  EXPECT_EQ(v[1], -3.0f);
  EXPECT_EQ(v[6], 0.333984375f);
  EXPECT_EQ(v[7], std::ldexp(1.0f, -133));  // bf16 subnormal
}

TEST(Safetensors, OtherKnownDtypesLoadButDoNotConvert) {
  const std::string d = temp_dir("i64");
  const std::vector<int64_t> ids = {1, 2, 3};
  const std::string header = R"({"ids":{"dtype":"I64","shape":[3],"data_offsets":[0,24]}})";
  const std::string p = d + "/i.safetensors";
  write_bytes(p, st_bytes(header, raw(ids)));
  SafetensorsFile f(p);
  EXPECT_EQ(f.tensor("ids").nbytes, 24u);
  expect_error([&] { f.to_float(f.tensor("ids")); }, p, "I64");
}

TEST(Safetensors, HeaderWithTrailingSpacesAndUnalignedData) {
  const std::string d = temp_dir("pad");
  const std::vector<float> a = {1.0f, 2.0f};
  // Header length 61 (odd) so the data section is not 4-byte aligned in the file.
  std::string header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  header.append(61 - header.size(), ' ');
  write_bytes(d + "/p.safetensors", st_bytes(header, raw(a)));
  SafetensorsFile f(d + "/p.safetensors");
  EXPECT_EQ(f.to_float(f.tensor("a")), a);
}

TEST(Safetensors, ModelDirSingleFile) {
  const std::string d = temp_dir("model_single");
  write_bytes(d + "/config.json", R"({"model_type":"gpt2","n_embd":2})");
  const std::vector<float> w = {0.5f, -0.5f};
  write_bytes(d + "/model.safetensors",
              st_bytes(R"({"wte.weight":{"dtype":"F32","shape":[1,2],"data_offsets":[0,8]}})", raw(w)));
  auto m = load_safetensors_dir(d);
  EXPECT_EQ(m.config.at("model_type"), "gpt2");
  ASSERT_EQ(m.files.size(), 1u);
  ASSERT_NE(m.find("wte.weight"), nullptr);
  EXPECT_EQ(m.find("nope"), nullptr);
  EXPECT_EQ(m.to_float("wte.weight"), w);
  EXPECT_EQ(&m.owner("wte.weight"), m.files[0].get());
  expect_error([&] { m.owner("nope"); }, d, "nope");
}

TEST(Safetensors, ModelDirSharded) {
  const std::string d = temp_dir("model_sharded");
  write_bytes(d + "/config.json", R"({"model_type":"llama"})");
  const std::vector<float> a = {1.0f, 2.0f, 3.0f};
  const std::vector<uint16_t> b = {0x3c00, 0x4000};  // F16 1, 2
  write_bytes(d + "/model-00001-of-00002.safetensors",
              st_bytes(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}})", raw(a)));
  write_bytes(d + "/model-00002-of-00002.safetensors",
              st_bytes(R"({"b":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}})", raw(b)));
  write_bytes(d + "/model.safetensors.index.json",
              R"({"metadata":{"total_size":16},"weight_map":{"a":"model-00001-of-00002.safetensors",)"
              R"("b":"model-00002-of-00002.safetensors"}})");
  auto m = load_safetensors_dir(d);
  ASSERT_EQ(m.files.size(), 2u);
  EXPECT_EQ(m.to_float("a"), a);
  EXPECT_EQ(m.to_float("b"), (std::vector<float>{1.0f, 2.0f}));
  EXPECT_NE(m.owner("a").path(), m.owner("b").path());
  EXPECT_EQ(m.owner("b").path(), d + "/model-00002-of-00002.safetensors");
}

// ---- malformed files ----

TEST(SafetensorsBad, EmptyFile) { expect_bad_file("empty", "", "truncated"); }

TEST(SafetensorsBad, TruncatedHeaderLength) { expect_bad_file("trunc_len", std::string("\x10\x00\x00", 3), "truncated"); }

TEST(SafetensorsBad, HeaderLengthBeyondFile) {
  const std::string h = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  expect_bad_file("len_beyond", le64(h.size() + 100) + h + "abcd", "exceeds the file");
  expect_bad_file("len_huge", le64(~0ull) + h, "exceeds the file");
}

TEST(SafetensorsBad, BadJson) {
  expect_bad_file("bad_json", st_bytes(R"({"a":{"dtype":"F32",)", ""), "not valid JSON");
  expect_bad_file("not_object", st_bytes(R"([1,2,3])", ""), "not a JSON object");
}

TEST(SafetensorsBad, OffsetsPastEnd) {
  expect_bad_file("past_end", st_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", "abcd"),
                  "past the end");
}

TEST(SafetensorsBad, SizeMismatchVsShape) {
  expect_bad_file("mismatch",
                  st_bytes(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", std::string(12, '\0')),
                  "need 12");
}

TEST(SafetensorsBad, UnknownDtypeNamesTensorAndDtype) {
  const std::string bytes =
      st_bytes(R"({"layer.w":{"dtype":"Q7_Z","shape":[1],"data_offsets":[0,1]}})", std::string(1, '\0'));
  expect_bad_file("dtype", bytes, "unknown dtype 'Q7_Z'");
  expect_bad_file("dtype2", bytes, "layer.w");
}

TEST(SafetensorsBad, NegativeDimension) {
  expect_bad_file("neg_dim", st_bytes(R"({"a":{"dtype":"F32","shape":[-1,4],"data_offsets":[0,0]}})", ""),
                  "negative");
}

TEST(SafetensorsBad, NonIntegerDimension) {
  expect_bad_file("float_dim", st_bytes(R"({"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", "abcd"),
                  "not an integer");
}

TEST(SafetensorsBad, ShapeOverflow) {
  expect_bad_file(
      "overflow",
      st_bytes(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,4]}})", "abcd"),
      "overflows");
  expect_bad_file("overflow_bytes",
                  st_bytes(R"({"a":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,4]}})", "abcd"),
                  "overflows");
}

TEST(SafetensorsBad, BeginAfterEndAndBadOffsets) {
  expect_bad_file("begin_end", st_bytes(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[4,2]}})", "abcd"),
                  "begin 4 > end 2");
  expect_bad_file("three_offsets", st_bytes(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1,2]}})", "abcd"),
                  "data_offsets");
  expect_bad_file("missing_dtype", st_bytes(R"({"a":{"shape":[1],"data_offsets":[0,1]}})", "abcd"), "dtype");
}

TEST(SafetensorsBad, OverlappingTensors) {
  expect_bad_file("overlap",
                  st_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                           R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                           std::string(12, '\0')),
                  "overlap");
}

TEST(SafetensorsBad, BadMetadata) {
  expect_bad_file("meta", st_bytes(R"({"__metadata__":{"format":1}})", ""), "__metadata__");
}

TEST(SafetensorsBad, MissingFile) {
  const std::string p = temp_dir("missing") + "/nope.safetensors";
  expect_error([&] { SafetensorsFile f(p); }, p, "cannot open");
}

TEST(SafetensorsBad, DirMissingConfig) {
  const std::string d = temp_dir("no_config");
  write_bytes(d + "/model.safetensors", st_bytes("{}", ""));
  expect_error([&] { load_safetensors_dir(d); }, d + "/config.json", "missing");
}

TEST(SafetensorsBad, DirBadConfig) {
  const std::string d = temp_dir("bad_config");
  write_bytes(d + "/config.json", "{nope");
  write_bytes(d + "/model.safetensors", st_bytes("{}", ""));
  expect_error([&] { load_safetensors_dir(d); }, d + "/config.json", "JSON");
}

TEST(SafetensorsBad, DirWithoutWeights) {
  const std::string d = temp_dir("no_weights");
  write_bytes(d + "/config.json", "{}");
  expect_error([&] { load_safetensors_dir(d); }, d, "model.safetensors");
}

TEST(SafetensorsBad, NotADirectory) {
  const std::string d = temp_dir("not_dir") + "/file";
  write_bytes(d, "x");
  expect_error([&] { load_safetensors_dir(d); }, d, "not a directory");
}

TEST(SafetensorsBad, ShardedIndexErrors) {
  const std::string d = temp_dir("bad_index");
  write_bytes(d + "/config.json", "{}");
  write_bytes(d + "/s1.safetensors", st_bytes(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "x"));
  write_bytes(d + "/model.safetensors.index.json", R"({"weight_map":{"zz":"s1.safetensors"}})");
  expect_error([&] { load_safetensors_dir(d); }, d + "/model.safetensors.index.json", "zz");

  write_bytes(d + "/model.safetensors.index.json", R"({"weight_map":{"a":"../s1.safetensors"}})");
  expect_error([&] { load_safetensors_dir(d); }, d + "/model.safetensors.index.json", "invalid shard");

  write_bytes(d + "/model.safetensors.index.json", R"({"weight_map":{"a":"missing.safetensors"}})");
  expect_error([&] { load_safetensors_dir(d); }, d + "/missing.safetensors", "cannot open");

  write_bytes(d + "/model.safetensors.index.json", R"({"nothing":1})");
  expect_error([&] { load_safetensors_dir(d); }, d + "/model.safetensors.index.json", "weight_map");

  // The shard itself is malformed: the error names the shard.
  write_bytes(d + "/s1.safetensors", le64(1000) + "{}");
  write_bytes(d + "/model.safetensors.index.json", R"({"weight_map":{"a":"s1.safetensors"}})");
  expect_error([&] { load_safetensors_dir(d); }, d + "/s1.safetensors", "exceeds");
}
