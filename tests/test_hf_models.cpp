// safetensors checkpoints (GPT-2, Llama, Gemma 3 layouts) against an independent numpy forward
// pass: scripts/make_tiny_models.py writes small random models in the Hugging Face layout with
// float64 reference logits computed by its own implementation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/mapped_file.h"
#include "eval/perplexity.h"
#include "model/model.h"
#include "test_util.h"

using namespace focus;

namespace {

// Builds the tiny models once per test run; empty string when python3/numpy are unavailable.
std::string tiny_dir() {
  static const std::string dir = [] {
    const std::string d = ::testing::TempDir() + "/focus_tiny_models";
    const std::string cmd = "python3 " + std::string(FOCUS_SOURCE_DIR) + "/scripts/make_tiny_models.py " + d +
                            " >/dev/null 2>&1";
    return std::system(cmd.c_str()) == 0 ? d : std::string();
  }();
  return dir;
}

void check_model(const std::string& name, Arch arch) {
  if (tiny_dir().empty()) {
    if (test::require_data()) FAIL() << "python3 with numpy is needed to build the tiny reference models";
    GTEST_SKIP() << "python3 with numpy unavailable";
  }
  const std::string d = tiny_dir() + "/" + name;
  auto m = load_model(d, LoadOptions{"", false});
  EXPECT_EQ(m->cfg.arch, arch);
  auto ref = nlohmann::json::parse(read_file(d + "/reference_logits.json"));
  std::vector<int32_t> ids = ref["ids"].get<std::vector<int32_t>>();
  const int64_t T = (int64_t)ids.size(), V = m->cfg.vocab;
  KVCache c;
  c.init(m->cfg, T);
  std::vector<float> h(T * m->cfg.dim), logits(T * V);
  forward(*m, ids.data(), T, c, h.data());
  compute_logits(*m, h.data(), T, logits.data());
  double max_err = 0, max_abs = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t v = 0; v < V; ++v) {
      const double r = ref["logits"][t][v].get<double>();
      max_err = std::max(max_err, std::fabs(logits[t * V + v] - r));
      max_abs = std::max(max_abs, std::fabs(r));
    }
  EXPECT_LT(max_err, 2e-4 * std::max(1.0, max_abs)) << name << ": max |logit error| " << max_err;
}

}  // namespace

TEST(HfSafetensors, Gpt2MatchesNumpyReference) { check_model("gpt2-tiny", Arch::GPT2); }
TEST(HfSafetensors, LlamaShardedF16MatchesNumpyReference) { check_model("llama-tiny", Arch::Llama); }
TEST(HfSafetensors, Gemma3Bf16MatchesNumpyReference) { check_model("gemma3-tiny", Arch::Gemma3); }
TEST(HfSafetensors, DeepseekV2LatentAttentionMatchesNumpyReference) {
  check_model("deepseek-v2-tiny", Arch::DeepseekV2);
}
// DeepSeek-V2's full form: the queries through their own low-rank latent (q_a_proj, its norm, q_b_proj).
TEST(HfSafetensors, DeepseekV2LowRankQueriesMatchNumpyReference) {
  check_model("deepseek-v2-qlora-tiny", Arch::DeepseekV2);
}

// The latent KV cache: one row of RoPE key + latent per token and layer (no separate values), and
// decoding token by token over it scores what the prefill scores, in float32 and half caches.
TEST(HfSafetensors, DeepseekV2CacheHoldsTheLatentOnceAndDecodingMatchesPrefill) {
  if (tiny_dir().empty()) {
    if (test::require_data()) FAIL() << "python3 with numpy is needed to build the tiny reference models";
    GTEST_SKIP() << "python3 with numpy unavailable";
  }
  auto m = load_model(tiny_dir() + "/deepseek-v2-tiny", LoadOptions{"", false});
  const ModelConfig& c = m->cfg;
  ASSERT_TRUE(c.mla());
  EXPECT_EQ(c.kv_dim(), 8 + 16);
  KVCache cache;
  cache.init(c, 40);
  EXPECT_EQ(cache.bytes(), c.layers * 40 * (8 + 16) * 4);
  EXPECT_EQ(cache.bytes(), inference_memory(c, 40, 1, cpu::KvType::F32, 0).parts[0].second);
  auto ref = nlohmann::json::parse(read_file(tiny_dir() + "/deepseek-v2-tiny/reference_logits.json"));
  std::vector<int32_t> ids = ref["ids"].get<std::vector<int32_t>>();
  ids.resize(40);
  std::vector<int32_t> targets(ids.begin() + 1, ids.end());
  targets.push_back(-1);
  for (cpu::KvType kv : {cpu::KvType::F32, cpu::KvType::F16}) {
    int64_t n1 = 0, n2 = 0;
    const double prefill = window_nll(*m, ids, targets, nullptr, nullptr, &n1, kv);
    const double decode = window_nll_decode(*m, ids, targets, nullptr, nullptr, &n2, kv);
    EXPECT_EQ(n1, n2);
    EXPECT_NEAR(decode, prefill, 1e-4 * std::abs(prefill)) << cpu::to_string(kv);
  }
}
