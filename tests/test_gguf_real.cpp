// GGUF tests on the cached real models: compared tensor by tensor with the `gguf` Python package
// (scripts/gguf_reference.py), and their metadata.
#include <gtest/gtest.h>
#include <unistd.h>

#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>
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
  // Cached across test processes (the script writes atomically) in the shared temporary base.
  const char* shared = std::getenv("FOCUS_SHARED_TMPDIR");
  const fs::path dir = (shared && *shared ? fs::path(shared) : fs::temp_directory_path()) / "focus_gguf_reference";
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
