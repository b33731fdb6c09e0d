// The flash-style dense kernel against the obviously-correct reference.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/cpu/attention.h"

using focus::cpu::AttnShape;

namespace {

struct Case {
  int64_t n_q, n_kv, heads, kv_heads, hd, window;
};

void run_case(const Case& c) {
  std::mt19937 rng(1234 + c.n_q * 7 + c.hd);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int64_t q_stride = c.heads * c.hd, kv_stride = c.kv_heads * c.hd;
  std::vector<float> q(c.n_q * q_stride), k(c.n_kv * kv_stride), v(c.n_kv * kv_stride);
  for (auto& x : q) x = nd(rng);
  for (auto& x : k) x = nd(rng);
  for (auto& x : v) x = nd(rng);
  AttnShape s{c.n_q, c.n_kv, c.n_kv - c.n_q, c.heads, c.kv_heads, c.hd, q_stride, kv_stride, q_stride,
              1.0f / std::sqrt((float)c.hd), c.window};
  std::vector<float> o1(q.size()), o2(q.size()), l1(c.heads * c.n_q), l2(c.heads * c.n_q);
  focus::cpu::flash_attention(q.data(), k.data(), v.data(), o1.data(), l1.data(), s);
  focus::cpu::attention_reference(q.data(), k.data(), v.data(), o2.data(), l2.data(), s);
  double max_err = 0;
  for (size_t i = 0; i < o1.size(); ++i) max_err = std::max(max_err, (double)std::fabs(o1[i] - o2[i]));
  EXPECT_LT(max_err, 2e-5) << "n_q " << c.n_q << " n_kv " << c.n_kv << " hd " << c.hd << " window " << c.window;
  for (size_t i = 0; i < l1.size(); ++i) ASSERT_NEAR(l1[i], l2[i], 1e-4 * (1 + std::fabs(l2[i])));
}

}  // namespace

TEST(FlashAttention, MatchesReferenceAcrossShapes) {
  for (int64_t n : {1, 7, 63, 64, 65, 130, 300})
    for (int64_t hd : {8, 64, 80})
      for (int64_t w : {0, 1, 16, 100}) run_case({n, n, 4, 2, hd, w});
}

TEST(FlashAttention, GqaMqaAndDecodeRows) {
  run_case({200, 200, 8, 1, 64, 0});     // MQA
  run_case({200, 200, 8, 8, 64, 0});     // MHA
  run_case({1, 500, 9, 3, 64, 0});       // one decode row against a long cache
  run_case({5, 300, 4, 1, 256, 128});    // Gemma-sized heads, sliding window
}
