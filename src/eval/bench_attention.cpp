#include "eval/bench_attention.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <vector>

#include "core/error.h"
#include "core/threads.h"
#include "focus/balancing.h"
#include "focus/focus_cache.h"
#include "focus/group_layout.h"
#include "kernels/cpu/cached_attention.h"
#include "kernels/cpu/sparse_attention.h"
#include "kernels/cpu/attention.h"

namespace focus {
namespace {

using Clock = std::chrono::steady_clock;

// Unit-variance uniform values, filled in parallel from per-chunk generators.
void fill_random(std::vector<float>& x, uint64_t seed) {
  const int64_t chunk = 1 << 16, n = (int64_t)x.size();
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < (n + chunk - 1) / chunk; ++c) {
    std::mt19937_64 rng(seed * 1000003 + c);
    std::uniform_real_distribution<float> u(-std::sqrt(3.f), std::sqrt(3.f));
    for (int64_t i = c * chunk; i < std::min(n, (c + 1) * chunk); ++i) x[i] = u(rng);
  }
}

// Balanced random routing: group of token i = perm[i] mod G (exactly balanced); with topk 2 a
// second, different group uniformly at random.
std::vector<int32_t> balanced_routing(int64_t n, int64_t G, int topk, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> perm(n);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> ids(n * topk);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t a = (int32_t)(perm[i] % G);
    if (topk == 1) {
      ids[i] = a;
    } else {
      const int32_t b = (int32_t)((a + 1 + rng() % (G - 1)) % G);
      ids[2 * i] = std::min(a, b);
      ids[2 * i + 1] = std::max(a, b);
    }
  }
  return ids;
}

// Median wall time in ms of f over reps runs, after `warmup` untimed runs.
template <class F>
double time_ms(F f, int reps, int warmup) {
  for (int i = 0; i < warmup; ++i) f();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    f();
    t.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

double peak_rss_mb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss / 1024.0;  // KiB on Linux
}

nlohmann::json num_or_null(double x, bool valid) { return valid ? nlohmann::json(x) : nlohmann::json(nullptr); }

}  // namespace

int run_attention_bench(const AttnBenchOptions& opt, nlohmann::json* result) {
  try {
    FOCUS_CHECK(opt.n >= 1 && opt.heads >= 1 && opt.kv_heads >= 1 && opt.dim >= 1 && opt.reps >= 1,
                "bench attention: n, heads, kv_heads, dim and reps must be positive");
    FOCUS_CHECK(opt.groups >= opt.topk, "bench attention: need groups >= topk");
    const int64_t n = opt.n, H = opt.heads, HKV = opt.kv_heads, D = opt.dim;

    std::vector<float> q(n * H * D), k(n * HKV * D), v(n * HKV * D), o(n * H * D), lse(H * n);
    fill_random(q, opt.seed * 3 + 0);
    fill_random(k, opt.seed * 3 + 1);
    fill_random(v, opt.seed * 3 + 2);
    const std::vector<int32_t> ids = balanced_routing(n, opt.groups, opt.topk, opt.seed);
    const Routing routing{ids.data(), opt.groups, opt.topk};
    const double load = group_load_stats(ids.data(), n, opt.topk, opt.groups).max_over_mean;

    cpu::AttnShape s;
    s.n_q = s.n_kv = n;
    s.heads = H;
    s.kv_heads = HKV;
    s.head_dim = D;
    s.q_stride = H * D;
    s.kv_stride = HKV * D;
    s.o_stride = H * D;
    s.scale = 1.f / std::sqrt((float)D);
    s.local_window = opt.local_window;
    s.sinks = opt.sinks;
    const cpu::AttnShape dense_shape{n, n, 0, H, HKV, D, H * D, HKV * D, H * D, s.scale, 0};

    const double causal_pairs = (double)n * (n + 1) / 2;
    const double pairs = (double)cpu::focus_pair_count(routing, n, opt.local_window, opt.sinks);
    const double density = pairs / causal_pairs;
    const double flop_per_pair = 4.0 * D * H;

    // Errors of one path on a subset of rows (all heads) against the reference.
    const bool check = n <= 8192 && opt.check_rows > 0;
    std::vector<int64_t> rows;
    for (int64_t x = 0; check && x < opt.check_rows; ++x) rows.push_back((n - 1) * x / std::max<int64_t>(1, opt.check_rows - 1));
    std::vector<float> ref(rows.size() * H * D);
    for (size_t x = 0; x < rows.size(); ++x)
      for (int64_t h = 0; h < H; ++h)
        cpu::focus_attention_reference_row(q.data(), k.data(), v.data(), ref.data() + (x * H + h) * D, s, routing,
                                           rows[x], h);
    auto max_err = [&]() {
      double e = 0;
      for (size_t x = 0; x < rows.size(); ++x)
        for (int64_t y = 0; y < H * D; ++y) e = std::max(e, (double)std::fabs(o[rows[x] * H * D + y] - ref[x * H * D + y]));
      return e;
    };

    const int dense_reps = opt.dense_reps < 0 ? opt.reps : opt.dense_reps;
    double dense_ms = 0;
    if (dense_reps > 0)
      dense_ms = time_ms([&] { cpu::flash_attention(q.data(), k.data(), v.data(), o.data(), lse.data(), dense_shape); },
                         dense_reps, dense_reps > 1 ? 1 : 0);
    // Dense causal through the tile engine of the sparse kernels (window = n): what a dense kernel
    // built on the same micro-kernels reaches, for comparing per-pair efficiency.
    double tiles_ms = 0;
    const bool have_tiles = dense_reps > 0 && opt.dense_tiles;
    if (have_tiles) {
      cpu::AttnShape sd = s;
      sd.local_window = n;
      sd.sinks = 0;
      tiles_ms = time_ms([&] { cpu::focus_window_attention(q.data(), k.data(), v.data(), o.data(), lse.data(), sd); },
                         dense_reps, dense_reps > 1 ? 1 : 0);
    }
    const double fused_ms = time_ms(
        [&] { cpu::focus_attention_fused(q.data(), k.data(), v.data(), o.data(), lse.data(), s, routing); }, opt.reps,
        1);
    const double err_fused = check ? max_err() : 0;
    const double two_ms = time_ms(
        [&] { cpu::focus_attention_two_call(q.data(), k.data(), v.data(), o.data(), lse.data(), s, routing); },
        opt.reps, 1);
    const double err_two = check ? max_err() : 0;

    // Decoding: each of the last `decode` positions as a new token over the cache of all earlier
    // ones; dense reads every cached key, Focus its window, the sinks and its groups' members.
    const int64_t n_dec = std::min(opt.decode, n);
    double dec_dense_ms = 0, dec_focus_ms = 0, dec_split_ms = 0, dec_keys = 0, err_dec = 0, err_split = 0;
    if (n_dec > 0) {
      FocusLayerCache fc;
      fc.reset(opt.groups, opt.topk);
      fc.append(ids.data(), nullptr, n);
      std::vector<float> od(H * D);
      int64_t keys = 0;
      dec_focus_ms = time_ms(
          [&] {
            keys = 0;
            for (int64_t i = n - n_dec; i < n; ++i)
              keys += cpu::focus_cached_attention(q.data() + i * H * D, k.data(), v.data(), od.data(), s, i, 1,
                                                  FocusMode::Hard, fc);
          },
          opt.reps, 1);
      dec_keys = (double)keys / (double)n_dec;
      std::vector<float> last(H * D);  // the last row, against the reference
      for (int64_t h = 0; h < H; ++h)
        cpu::focus_attention_reference_row(q.data(), k.data(), v.data(), last.data() + h * D, s, routing, n - 1, h);
      for (int64_t y = 0; y < H * D; ++y) err_dec = std::max(err_dec, (double)std::fabs(od[y] - last[y]));
      dec_dense_ms = time_ms(
          [&] {
            for (int64_t i = n - n_dec; i < n; ++i) {
              const cpu::AttnShape d{1, i + 1, i, H, HKV, D, H * D, HKV * D, H * D, s.scale, 0};
              cpu::flash_attention(q.data() + i * H * D, k.data(), v.data(), od.data(), nullptr, d);
            }
          },
          opt.reps, 1);
      // Dense on the Focus decode kernel itself (every key through the same split-key loop): the
      // speedup that comes from reading fewer keys alone.
      std::vector<float> od2(H * D);
      dec_split_ms = time_ms(
          [&] {
            for (int64_t i = n - n_dec; i < n; ++i)
              cpu::focus_cached_attention(q.data() + i * H * D, k.data(), v.data(), od2.data(), s, i, 1,
                                          FocusMode::Off, fc);
          },
          opt.reps, 1);
      for (int64_t y = 0; y < H * D; ++y) err_split = std::max(err_split, (double)std::fabs(od2[y] - od[y]));
    }
    const double dec_dense_us = n_dec > 0 ? 1e3 * dec_dense_ms / (double)n_dec : 0;
    const double dec_focus_us = n_dec > 0 ? 1e3 * dec_focus_ms / (double)n_dec : 0;
    const double dec_split_us = n_dec > 0 ? 1e3 * dec_split_ms / (double)n_dec : 0;

    const bool have_dense = dense_reps > 0;
    const double gf_dense = have_dense ? flop_per_pair * causal_pairs / dense_ms / 1e6 : 0;
    const double gf_tiles = have_tiles ? flop_per_pair * causal_pairs / tiles_ms / 1e6 : 0;
    const double gf_fused = flop_per_pair * pairs / fused_ms / 1e6, gf_two = flop_per_pair * pairs / two_ms / 1e6;
    const double rss = peak_rss_mb();

    std::printf("focus attention: n %lld, heads %lld/%lld, dim %lld, window %lld, groups %lld, topk %d, sinks %lld, "
                "threads %d\n",
                (long long)n, (long long)H, (long long)HKV, (long long)D, (long long)opt.local_window, (long long)opt.groups,
                opt.topk, (long long)opt.sinks, num_threads());
    std::printf("density %.4f (%.4g of %.4g causal pairs per head; 1/density %.2f), group load max/mean %.3f\n",
                density, pairs, causal_pairs, 1 / density, load);
    std::printf("%-9s %11s %9s %9s %11s\n", "path", "ms", "speedup", "GFLOP/s", "max_err");
    auto line = [&](const char* name, double ms, double gf, bool have_err, double err) {
      char e[32] = "-", sp[32] = "-";
      if (have_err) std::snprintf(e, sizeof e, "%.2e", err);
      if (have_dense) std::snprintf(sp, sizeof sp, "%.2fx", dense_ms / ms);
      std::printf("%-9s %11.2f %9s %9.1f %11s\n", name, ms, sp, gf, e);
    };
    if (have_dense) line("dense", dense_ms, gf_dense, false, 0);
    if (have_tiles) line("dense-t", tiles_ms, gf_tiles, false, 0);
    line("fused", fused_ms, gf_fused, check, err_fused);
    line("two-call", two_ms, gf_two, check, err_two);
    if (n_dec > 0)
      std::printf("decode (last %lld positions, per token): dense %.1f us, Focus cache %.1f us (%.2fx), "
                  "%.0f of %lld keys read, max_err %.2e\n",
                  (long long)n_dec, dec_dense_us, dec_focus_us, dec_dense_us / dec_focus_us, dec_keys, (long long)n,
                  err_dec);
    if (n_dec > 0)
      std::printf("decode, every key through the Focus decode kernel: %.1f us (Focus %.2fx faster), "
                  "max diff to dense %.2e\n",
                  dec_split_us, dec_split_us / dec_focus_us, err_split);
    std::printf("dense = cpu::flash_attention; dense-t = dense causal on the sparse kernels' tile engine\n");
    std::printf("GFLOP/s count 4*dim*heads per computed pair (dense: causal pairs); peak RSS %.0f MB\n", rss);

    nlohmann::json j{{"n", n},
                     {"heads", H},
                     {"kv_heads", HKV},
                     {"dim", D},
                     {"window", opt.local_window},
                     {"groups", opt.groups},
                     {"topk", opt.topk},
                     {"sinks", opt.sinks},
                     {"threads", num_threads()},
                     {"dense_ms", num_or_null(dense_ms, have_dense)},
                     {"fused_ms", fused_ms},
                     {"twocall_ms", two_ms},
                     {"density", density},
                     {"speedup_fused", num_or_null(dense_ms / fused_ms, have_dense)},
                     {"speedup_twocall", num_or_null(dense_ms / two_ms, have_dense)},
                     {"gflops_dense", num_or_null(gf_dense, have_dense)},
                     {"dense_tiles_ms", num_or_null(tiles_ms, have_tiles)},
                     {"gflops_dense_tiles", num_or_null(gf_tiles, have_tiles)},
                     {"gflops_fused", gf_fused},
                     {"gflops_twocall", gf_two},
                     {"max_err_fused", num_or_null(err_fused, check)},
                     {"max_err_twocall", num_or_null(err_two, check)},
                     {"decode_tokens", n_dec},
                     {"decode_dense_us", num_or_null(dec_dense_us, n_dec > 0)},
                     {"decode_focus_us", num_or_null(dec_focus_us, n_dec > 0)},
                     {"speedup_decode", num_or_null(dec_dense_us / dec_focus_us, n_dec > 0)},
                     {"decode_dense_split_us", num_or_null(dec_split_us, n_dec > 0)},
                     {"speedup_decode_same_kernel", num_or_null(dec_split_us / dec_focus_us, n_dec > 0)},
                     {"max_err_decode_dense_split", num_or_null(err_split, n_dec > 0)},
                     {"decode_keys_per_token", num_or_null(dec_keys, n_dec > 0)},
                     {"max_err_decode", num_or_null(err_dec, n_dec > 0)},
                     {"load_max_over_mean", load},
                     {"peak_rss_mb", rss}};
    if (opt.json) std::printf("%s\n", j.dump().c_str());
    if (result) *result = j;
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

}  // namespace focus
