// Weights held in the model file's format (--weights native), dequantised (f32) or as BF16: the
// linear layers' tiled prefill path against a float64 reference, BF16 rounding, and the real
// models in every mode (views of the mapped file, prefill identical to the exact path, decoding
// through the quantised kernels close to it).
#include <gtest/gtest.h>

#include <bit>
#include <cstring>
#include <cmath>
#include <random>
#include <vector>

#include "core/error.h"
#include "core/mapped_file.h"
#include "io/ggml_types.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/quant_matvec.h"
#include "eval/perplexity.h"
#include "model/model.h"
#include "test_models.h"
#include "test_util.h"

using namespace focus;
using focus::io::GGMLType;

namespace {

// A valid Q8_0 matrix [rows, cols]: per 32 weights an fp16 scale and 32 int8 values.
std::vector<uint8_t> random_q8_0(int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> q(-127, 127);
  std::uniform_real_distribution<float> d(0.001f, 0.02f);
  const int64_t blocks = rows * cols / 32;
  std::vector<uint8_t> out(blocks * 34);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint16_t h = io::fp32_to_fp16(d(rng));
    std::memcpy(&out[b * 34], &h, 2);
    for (int i = 0; i < 32; ++i) out[b * 34 + 2 + i] = (uint8_t)(int8_t)q(rng);
  }
  return out;
}

std::vector<float> random_vec(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d;
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

}  // namespace

TEST(Weights, Bf16RoundsToNearestEven) {
  EXPECT_EQ(io::fp32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(io::fp32_to_bf16(-2.0f), 0xc000);
  // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  EXPECT_EQ(io::fp32_to_bf16(std::bit_cast<float>(0x3f808000u)), 0x3f80);
  // 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: to the even one (1 + 2^-6).
  EXPECT_EQ(io::fp32_to_bf16(std::bit_cast<float>(0x3f818000u)), 0x3f82);
  EXPECT_EQ(io::fp32_to_bf16(std::bit_cast<float>(0x3f808001u)), 0x3f81);  // above half: up
  EXPECT_EQ(io::fp32_to_bf16(INFINITY), 0x7f80);
  EXPECT_TRUE(std::isnan(io::bf16_to_fp32(io::fp32_to_bf16(NAN))));
  // Every bf16 value converts back to itself.
  for (uint32_t h = 0; h < 0x10000; h += 7) {
    const float f = io::bf16_to_fp32((uint16_t)h);
    if (!std::isnan(f)) {
      EXPECT_EQ(io::fp32_to_bf16(f), h);
    }
  }
}

// Sets linear()'s prefill GEMM for one scope.
struct PrefillGemmGuard {
  cpu::PrefillGemm saved = cpu::prefill_gemm();
  explicit PrefillGemmGuard(cpu::PrefillGemm m) { cpu::set_prefill_gemm(m); }
  ~PrefillGemmGuard() { cpu::set_prefill_gemm(saved); }
};

// The prefill paths of a quantised weight. Dequant: tiles of W dequantised into sgemm, over
// several tiles (8 MB of float32 per tile: 256 rows of 8192), with a bias, and the input gradient.
// Int8 (where the CPU has it): the integer GEMM plus the bias, within the activation-rounding
// bound of quant_matvec.h (sum over 32-blocks of d_b / 2 times the block's sum of |W|).
TEST(Weights, QuantisedLinearTilesMatchAFloat64Reference) {
  const int64_t N = 600, K = 8192, M = 13;
  const std::vector<uint8_t> bytes = random_q8_0(N, K, 1);
  const Weight W{GGMLType::Q8_0, N, K, bytes.data()};
  const std::vector<float> Wf = dequantize_all(W);
  const std::vector<float> x = random_vec(M * K, 2), bias = random_vec(N, 3), dy = random_vec(M * N, 4);
  std::vector<float> y(M * N), y8(M * N), dx(M * K, 1.0f);
  {
    PrefillGemmGuard g(cpu::PrefillGemm::Dequant);
    cpu::linear(x.data(), W, bias.data(), y.data(), M, K, N);
  }
  const bool int8 = cpu::quant_gemm_supported(W);
  if (int8) {
    PrefillGemmGuard g(cpu::PrefillGemm::Int8);
    cpu::linear(x.data(), W, bias.data(), y8.data(), M, K, N);
  }
  cpu::linear_backward_input(dy.data(), W, dx.data(), M, K, N, /*accumulate=*/true);
  double worst = 0, worst_dx = 0, worst8 = 0;
  std::vector<float> d(K / cpu::kQuantActBlock);
  for (int64_t m = 0; m < M; ++m) {
    cpu::quantize_activation_scales(x.data() + m * K, K, d.data());
    for (int64_t n = 0; n < N; ++n) {
      double ref = bias[n], mag = std::fabs(bias[n]), qb = 0;
      for (int64_t k = 0; k < K; ++k) {
        ref += (double)x[m * K + k] * Wf[n * K + k];
        mag += std::fabs((double)x[m * K + k] * Wf[n * K + k]);
        qb += d[k / cpu::kQuantActBlock] / 2.0 * std::fabs(Wf[n * K + k]);
      }
      worst = std::max(worst, std::fabs(y[m * N + n] - ref) / mag);
      if (int8) worst8 = std::max(worst8, std::fabs(y8[m * N + n] - ref) / (qb + 1e-5 * mag));
    }
    for (int64_t k = 0; k < K; k += 97) {
      double ref = 1.0, mag = 1.0;
      for (int64_t n = 0; n < N; ++n) {
        ref += (double)dy[m * N + n] * Wf[n * K + k];
        mag += std::fabs((double)dy[m * N + n] * Wf[n * K + k]);
      }
      worst_dx = std::max(worst_dx, std::fabs(dx[m * K + k] - ref) / mag);
    }
  }
  // float32 accumulation over K terms: well inside 1e-5 of the sum of magnitudes.
  EXPECT_LT(worst, 1e-5);
  EXPECT_LT(worst_dx, 1e-5);
  EXPECT_LE(worst8, 1.0);  // within the bound (0 where the CPU has no integer GEMM)
  EXPECT_THROW(cpu::linear(x.data(), W, nullptr, y.data(), M, K + 32, N), Error);  // shape checked
}

// llama2.c checkpoints are float32: every mode but bf16 views the same floats.
TEST(Weights, Llama2cNativeViewsTheFile) {
  FOCUS_NEED_FILE(test::stories());
  LoadOptions native{"", false}, f32{"", false}, bf16{"", false};
  f32.weights = WeightsMode::F32;
  bf16.weights = WeightsMode::BF16;
  auto a = load_model(test::stories(), native), b = load_model(test::stories(), f32),
       c = load_model(test::stories(), bf16);
  EXPECT_EQ(a->w.weights_mode, "native");
  EXPECT_EQ(c->w.layers[0].wq.type, GGMLType::BF16);
  EXPECT_EQ(c->w.matrix_bytes() * 2, a->w.matrix_bytes());
  const std::vector<int32_t> ids = {1, 403, 407, 261, 378, 293, 15, 9, 400};
  const std::vector<float> ha = test::hidden_of(*a, ids, nullptr), hb = test::hidden_of(*b, ids, nullptr),
                           hc = test::hidden_of(*c, ids, nullptr);
  EXPECT_EQ(ha, hb);
  EXPECT_GT(test::max_abs_diff(ha, hc), 0.0);   // bf16 rounds the weights ...
  EXPECT_LT(test::max_abs_diff(ha, hc), 0.1);   // ... by a little (hidden states are O(1))
}

namespace {

// Log-probabilities of ids[i + 1] for i < ids.size() - 1 from one prefill of all of ids.
std::vector<double> prefill_logprobs(const Model& m, const std::vector<int32_t>& ids) {
  const int64_t T = (int64_t)ids.size();
  KVCache cache;
  cache.init(m.cfg, T);
  std::vector<float> h(T * m.cfg.dim), logits((T - 1) * m.cfg.vocab);
  forward(m, ids.data(), T, cache, h.data());
  compute_logits(m, h.data(), T - 1, logits.data());
  std::vector<double> lp;
  for (int64_t i = 0; i + 1 < T; ++i) lp.push_back(cpu::log_prob(logits.data() + i * m.cfg.vocab, m.cfg.vocab, ids[i + 1]));
  return lp;
}

// Mean |la - lb| and the relative change of the summed NLL.
std::pair<double, double> logprob_change(const std::vector<double>& la, const std::vector<double>& lb) {
  double mean_abs = 0, sum_a = 0, sum_b = 0;
  for (size_t i = 0; i < la.size(); ++i) {
    mean_abs += std::fabs(la[i] - lb[i]) / la.size();
    sum_a += la[i];
    sum_b += lb[i];
  }
  return {mean_abs, std::fabs(sum_a - sum_b) / std::fabs(sum_b)};
}

// Log-probabilities of ids[i + 1] for i in [P - 1, ids.size() - 1): prefill of P tokens, then
// one token at a time (the decoding path: quantised kernels in native mode).
std::vector<double> decode_logprobs(const Model& m, const std::vector<int32_t>& ids, int64_t P) {
  KVCache cache;
  cache.init(m.cfg, (int64_t)ids.size());
  std::vector<float> h(ids.size() * m.cfg.dim), logits(m.cfg.vocab);
  std::vector<double> lp;
  forward(m, ids.data(), P, cache, h.data());
  compute_logits(m, h.data() + (P - 1) * m.cfg.dim, 1, logits.data());
  lp.push_back(cpu::log_prob(logits.data(), m.cfg.vocab, ids[P]));
  for (size_t i = P; i + 1 < ids.size(); ++i) {
    forward(m, &ids[i], 1, cache, h.data());
    compute_logits(m, h.data(), 1, logits.data());
    lp.push_back(cpu::log_prob(logits.data(), m.cfg.vocab, ids[i + 1]));
  }
  return lp;
}

void check_real_model(const std::string& path, GGMLType q_type) {
  LoadOptions native, f32;
  f32.weights = WeightsMode::F32;
  auto a = load_model(path, native), b = load_model(path, f32);
  EXPECT_EQ(a->w.layers[0].wq.type, q_type);
  EXPECT_EQ(b->w.layers[0].wq.type, GGMLType::F32);
  EXPECT_LT(a->w.matrix_bytes() * 3, b->w.matrix_bytes());  // at most a third of float32
  // 112 tokens of a held-out book (Dracula, from its 20,000th character); 48 with the smaller shapes.
  const std::string book = read_file(test::book("pg-345-dracula.txt"));
  ASSERT_GT(book.size(), 30000u);
  std::vector<int32_t> ids = a->tok->encode(book.substr(20000, 4000), true);
  ids.resize(test::small_shapes() ? 48 : 112);
  // Prefill (more than kMatvecMaxRows rows) through dequantised tiles: the same weights as the
  // exact path.
  {
    PrefillGemmGuard g(cpu::PrefillGemm::Dequant);
    const std::vector<float> ha = test::hidden_of(*a, ids, nullptr), hb = test::hidden_of(*b, ids, nullptr);
    EXPECT_LT(test::max_abs_diff(ha, hb), 1e-3);
  }
  // Decoding, and prefill through the integer GEMM: activations quantised to int8 per block of 32
  // move the log-probabilities a little (measured over 300 tokens of decoding: mean |change| 0.066
  // nats, NLL +0.8% for SmolLM2; 0.046, +0.4% for Gemma 3). A kernel error (a dropped min or
  // offset term) moves them by whole nats.
  const int64_t P = test::small_shapes() ? 24 : 12;  // prefill P tokens, then decode the rest
  const std::vector<double> lb = decode_logprobs(*b, ids, P);
  const auto [mean_abs, rel] = logprob_change(decode_logprobs(*a, ids, P), lb);
  EXPECT_LT(mean_abs, 0.1) << path;
  EXPECT_LT(rel, 0.02) << path;  // the window's NLL within 2%
  if (cpu::quant_gemm_supported(a->w.layers[0].wq)) {
    PrefillGemmGuard g(cpu::PrefillGemm::Int8);
    const auto [pf_abs, pf_rel] = logprob_change(prefill_logprobs(*a, ids), prefill_logprobs(*b, ids));
    EXPECT_GT(pf_abs, 0.0) << path;  // the integer GEMM ran
    EXPECT_LT(pf_abs, 0.1) << path;
    EXPECT_LT(pf_rel, 0.02) << path;
  }
}

}  // namespace

TEST(Weights, SmolLM2NativeMatchesTheExactPath) {
  FOCUS_NEED_FILE(test::smollm2_path());
  check_real_model(test::smollm2_path(), GGMLType::Q4_1);
}

TEST(Weights, Gemma3NativeMatchesTheExactPath) {
  FOCUS_NEED_FILE(test::gemma3_path());
  check_real_model(test::gemma3_path(), GGMLType::Q5_0);
}

// eval --decode scores through the decoding path; with float32 weights it must agree with the
// prefill scoring up to float rounding (the same computation, one row at a time).
TEST(Weights, DecodeScoringAgreesWithPrefillOnTheExactPath) {
  FOCUS_NEED_FILE(test::stories());
  auto m = load_model(test::stories(), LoadOptions{test::tok512()});
  std::vector<int32_t> ids;
  for (int i = 0; i < 150; ++i) ids.push_back((i * 37 + 11) % (int)m->cfg.vocab);
  PplOptions o;
  o.ctx = 64;
  o.progress = false;
  const PplResult a = perplexity(*m, ids, o);
  o.decode = true;
  const PplResult b = perplexity(*m, ids, o);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.windows, b.windows);
  EXPECT_NEAR(a.nll(), b.nll(), 1e-5);
  EXPECT_GT(a.nll(), 1.0);
}
