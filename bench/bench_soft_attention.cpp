// Throughput of the soft-mode Focus attention kernels (forward and backward, with and without the
// router bias) at the router-training shape of SmolLM2-135M: H = 9, HKV = 3, Dh = 64, G = 16,
// window 64, one sink. FLOPs are counted on the visible causal pairs: forward 4 * Dh, backward
// 10 * Dh per pair and head.
#include "bench_soft_attention.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "bench_timing.h"
#include "core/error.h"
#include "kernels/cpu/soft_attention.h"

namespace focus {
using bench::median_seconds;

nlohmann::json bench_soft_attention(int64_t n, int reps) {
  FOCUS_CHECK(n >= 1 && reps >= 1, "soft attention benchmark: need n >= 1 and reps >= 1");
  cpu::AttnShape s;
  s.n_q = s.n_kv = n;
  s.heads = 9;
  s.kv_heads = 3;
  s.head_dim = 64;
  s.groups = 16;
  s.local_window = 64;
  s.sinks = 1;
  s.scale = 1.f / std::sqrt((float)s.head_dim);
  std::mt19937 rng(700);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> q(n * s.heads * s.head_dim), k(n * s.kv_heads * s.head_dim), v(k.size()), w(q.size());
  for (auto* t : {&q, &k, &v, &w})
    for (auto& x : *t) x = nd(rng);
  std::vector<float> p(n * s.groups);  // rows of a softmax over random logits, as the router produces
  for (int64_t i = 0; i < n; ++i) {
    double sum = 0;
    for (int64_t g = 0; g < s.groups; ++g) sum += p[i * s.groups + g] = std::exp(2.f * nd(rng));
    for (int64_t g = 0; g < s.groups; ++g) p[i * s.groups + g] = (float)(p[i * s.groups + g] / sum);
  }
  std::vector<float> o(q.size()), lse(s.heads * n), dq(q.size()), dk(k.size()), dv(v.size()), dp(p.size());
  const double pairs = (double)n * (n + 1) / 2 * s.heads;
  nlohmann::json rows = nlohmann::json::array();
  for (const bool bias : {false, true}) {
    const float* pp = bias ? p.data() : nullptr;
    const double tf = median_seconds(
        [&] { cpu::soft_attention_forward(q.data(), k.data(), v.data(), pp, o.data(), lse.data(), s); }, reps);
    const double tb = median_seconds(
        [&] {
          cpu::soft_attention_backward(q.data(), k.data(), v.data(), pp, o.data(), lse.data(), w.data(), dq.data(),
                                  dk.data(), dv.data(), bias ? dp.data() : nullptr, s);
        },
        reps);
    const double gf = 4.0 * s.head_dim * pairs / tf / 1e9, gb = 10.0 * s.head_dim * pairs / tb / 1e9;
    std::printf("soft attention %s N %lld H 9/3 Dh 64 G 16: forward %.1f ms (%.1f GFLOP/s), backward %.1f ms "
                "(%.1f GFLOP/s)\n",
                bias ? "with bias" : "no bias  ", (long long)n, tf * 1e3, gf, tb * 1e3, gb);
    rows.push_back({{"bias", bias},
                    {"forward_ms", tf * 1e3},
                    {"forward_gflops", gf},
                    {"backward_ms", tb * 1e3},
                    {"backward_gflops", gb}});
  }
  return {{"n", n}, {"heads", s.heads}, {"kv_heads", s.kv_heads}, {"head_dim", s.head_dim},
          {"groups", s.groups}, {"window", s.local_window}, {"sinks", s.sinks}, {"runs", rows}};
}

}  // namespace focus
