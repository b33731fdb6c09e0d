// Grouped Focus attention against dense attention at one shape: keys in contiguous blocks of 256
// positions, block b in group (b + 7 r) mod 32 under routing head r; every (row, head) reads 4
// groups drawn at random among those with keys beyond its window (fewer when fewer exist).
#include "bench_grouped_attention.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "bench_timing.h"
#include "core/error.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/grouped_attention.h"

namespace focus {
using bench::median_seconds;

nlohmann::json bench_grouped_attention(int64_t n, int reps) {
  FOCUS_CHECK(n >= 2 && reps >= 1, "grouped attention benchmark: need n >= 2 and reps >= 1");
  constexpr int64_t kBlock = 256, G = 32, RH = 3;
  constexpr int kq = 4;
  cpu::AttnShape s;
  s.n_q = s.n_kv = n;
  s.heads = 9;
  s.kv_heads = 3;
  s.head_dim = 64;
  s.q_stride = s.o_stride = s.heads * s.head_dim;
  s.kv_stride = s.kv_heads * s.head_dim;
  s.scale = 1.f / 8.f;
  s.local_window = 256;
  s.sinks = 1;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> q(n * s.q_stride), k(n * s.kv_stride), v(n * s.kv_stride), o(n * s.o_stride), lse(s.heads * n);
  for (auto& x : q) x = nd(rng);
  for (auto& x : k) x = nd(rng);
  for (auto& x : v) x = nd(rng);
  std::vector<int32_t> key_group(RH * n), query_groups(n * s.heads * kq, -1), eligible;
  for (int64_t r = 0; r < RH; ++r)
    for (int64_t j = 0; j < n; ++j) key_group[r * n + j] = (int32_t)((j / kBlock + 7 * r) % G);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t last = t - s.local_window;  // keys s.sinks .. last lie beyond the window
    for (int64_t h = 0; h < s.heads; ++h) {
      eligible.clear();
      const int64_t r = h / (s.heads / RH);
      for (int64_t b = 0; last >= s.sinks && b * kBlock <= last; ++b)
        if (std::max(b * kBlock, s.sinks) <= last) eligible.push_back((int32_t)((b + 7 * r) % G));
      std::sort(eligible.begin(), eligible.end());
      eligible.erase(std::unique(eligible.begin(), eligible.end()), eligible.end());
      std::shuffle(eligible.begin(), eligible.end(), rng);
      for (int c = 0; c < kq && c < (int)eligible.size(); ++c) query_groups[(t * s.heads + h) * kq + c] = eligible[c];
    }
  }
  const cpu::GroupedRouting routing{G, RH, key_group.data(), kq, query_groups.data()};
  cpu::GroupedKeyIndex idx;
  const double t_index = median_seconds([&] { idx.build(routing, n); }, reps);
  const double pairs = (double)cpu::grouped_pair_count(s, routing, idx);
  const double density = pairs / ((double)s.heads * n * (n + 1) / 2);
  const double t_grouped =
      median_seconds([&] { cpu::grouped_attention(q.data(), k.data(), v.data(), o.data(), lse.data(), s, routing, idx); },
                     reps);
  const double t_dense =
      median_seconds([&] { cpu::flash_attention(q.data(), k.data(), v.data(), o.data(), lse.data(), s); }, reps);
  // One decoding row at position n - 1 over the n keys.
  cpu::AttnShape d = s;
  d.q_pos0 = n - 1;
  d.n_q = 1;
  cpu::GroupedRouting dr = routing;
  dr.query_groups = query_groups.data() + (n - 1) * s.heads * kq;
  const float* qd = q.data() + (n - 1) * s.q_stride;
  const int dreps = std::max(reps, 50);
  const double t_grouped_dec = median_seconds(
      [&] { cpu::grouped_attention(qd, k.data(), v.data(), o.data(), lse.data(), d, dr, idx); }, dreps);
  const double t_dense_dec =
      median_seconds([&] { cpu::flash_attention(qd, k.data(), v.data(), o.data(), lse.data(), d); }, dreps);
  std::printf("grouped attention n %lld: density %.3f | prefill %.1f ms vs dense %.1f ms (%.2fx) | decode row %.3f ms "
              "vs dense %.3f ms (%.2fx) | index build %.2f ms\n",
              (long long)n, density, t_grouped * 1e3, t_dense * 1e3, t_dense / t_grouped, t_grouped_dec * 1e3,
              t_dense_dec * 1e3, t_dense_dec / t_grouped_dec, t_index * 1e3);
  return {{"n", n},
          {"density", density},
          {"prefill_ms", t_grouped * 1e3},
          {"dense_prefill_ms", t_dense * 1e3},
          {"decode_ms", t_grouped_dec * 1e3},
          {"dense_decode_ms", t_dense_dec * 1e3},
          {"index_build_ms", t_index * 1e3}};
}

}  // namespace focus
