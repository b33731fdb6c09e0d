#include "eval/bench_model.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>

#include "core/error.h"
#include "core/progress.h"
#include "core/threads.h"

namespace focus {
namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

std::vector<int32_t> random_ids(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> d(0, (int32_t)vocab - 1);
  std::vector<int32_t> ids(n);
  for (auto& t : ids) t = d(rng);
  return ids;
}

double peak_rss_mb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss / 1024.0;  // kilobytes on Linux
}

}  // namespace

int run_model_bench(const Model& m, const AttentionPlan* plan, const std::string& attention,
                    const ModelBenchOptions& o, nlohmann::json* result) {
  const ModelConfig& c = m.cfg;
  FOCUS_CHECK(o.reps >= 1, "bench model: --reps must be >= 1");
  FOCUS_CHECK(!o.against_dense || plan, "bench model: --against-dense needs an attention to compare (--focus or --attention)");
  FOCUS_CHECK(o.gen >= 1 || o.depth.empty(), "bench model: --gen must be >= 1");
  for (int64_t p : o.prefill) FOCUS_CHECK(p >= 0 && p <= c.max_ctx, "bench model: prefill ", p, " outside 1..", c.max_ctx);
  for (int64_t d : o.depth)
    FOCUS_CHECK(d >= 0 && d + o.gen <= c.max_ctx, "bench model: depth ", d, " + ", o.gen, " generated tokens exceed the ",
                "model's context ", c.max_ctx);
  int64_t longest = 0, widest = 1;
  for (int64_t p : o.prefill) longest = std::max(longest, p), widest = std::max(widest, p);
  for (int64_t d : o.depth) longest = std::max(longest, d + o.gen), widest = std::max(widest, d);
  // Paired with dense generation, a second cache is held.
  const int64_t caches = o.against_dense && plan && !o.depth.empty() ? 2 : 1;
  check_inference_memory("bench model", c, caches * longest, widest, o.kv_type, 1, "lower --prefill / --depth",
                         o.depth.empty() ? 0 : decode_kv_copies(c, plan));
  nlohmann::json j;
  j["model"] = m.path;
  j["weights"] = m.w.weights_mode;
  j["matrix_bytes"] = m.w.matrix_bytes();
  j["threads"] = num_threads();
  j["attention"] = attention;
  j["kv_type"] = cpu::to_string(o.kv_type);
  j["against_dense"] = o.against_dense && plan;
  std::printf("model %s, weights %s (%.1f MB of matrices), KV cache %s, %d threads, attention %s\n",
              m.path.c_str(), m.w.weights_mode.c_str(), m.w.matrix_bytes() / 1e6, cpu::to_string(o.kv_type).c_str(),
              num_threads(), attention.c_str());
  const bool pair = o.against_dense && plan;
  if (pair)
    std::printf("%-8s %8s %8s %12s %10s %12s %10s %8s\n", "test", "tokens", "depth", "tok/s", "seconds", "dense tok/s",
                "dense s", "speedup");
  else
    std::printf("%-8s %8s %8s %12s %10s\n", "test", "tokens", "depth", "tok/s", "seconds");
  std::vector<float> logits(c.vocab);
  nlohmann::json rows = nlohmann::json::array();
  // One test: after a warm-up of each variant, o.reps timed repetitions of run(variant) (variant 0
  // the plan's attention, 1 the dense model's when paired), the variants' order swapped every
  // repetition; prints and records the medians (and the median ratio of each repetition's pair).
  auto measure = [&](const char* test, int64_t tokens, int64_t depth, const std::function<double(int)>& run) {
    const int variants = pair ? 2 : 1;
    std::vector<double> t[2], ratio;
    for (int r = 0; r <= o.reps && !interrupted(); ++r) {
      double s[2] = {0, 0};
      for (int x = 0; x < variants && !interrupted(); ++x) {
        const int v = r % 2 ? variants - 1 - x : x;
        s[v] = run(v);
      }
      if (r == 0 || interrupted()) continue;  // the first round warms up
      for (int v = 0; v < variants; ++v) t[v].push_back(s[v]);
      if (pair) ratio.push_back(s[1] / s[0]);
    }
    if (t[0].empty()) return false;
    const double s0 = median(t[0]);
    nlohmann::json row = {{"test", test}, {"tokens", tokens}, {"depth", depth}, {"tok_per_s", tokens / s0}, {"seconds", s0}};
    if (pair) {
      const double s1 = median(t[1]), sp = median(ratio);
      std::printf("%-8s %8lld %8lld %12.1f %10.4f %12.1f %10.4f %7.2fx\n", test, (long long)tokens, (long long)depth,
                  tokens / s0, s0, tokens / s1, s1, sp);
      row["dense_tok_per_s"] = tokens / s1;
      row["dense_seconds"] = s1;
      row["speedup"] = sp;
      row["speedup_each"] = ratio;
    } else {
      std::printf("%-8s %8lld %8lld %12.1f %10.4f\n", test, (long long)tokens, (long long)depth, tokens / s0, s0);
    }
    rows.push_back(row);
    return true;
  };
  auto plan_of = [&](int v) { return v == 0 ? plan : nullptr; };
  for (int64_t P : o.prefill) {
    if (P == 0) continue;  // --prefill 0: no prefill test
    const std::vector<int32_t> ids = random_ids(P, c.vocab, o.seed + (uint64_t)P);
    std::vector<float> hidden(P * c.dim);
    const bool done = measure("prefill", P, 0, [&](int v) {
      KVCache cache;
      cache.init(c, P, o.kv_type);
      const double t0 = now();
      forward(m, ids.data(), P, cache, hidden.data(), plan_of(v));
      compute_logits(m, hidden.data() + (P - 1) * c.dim, 1, logits.data());
      return now() - t0;
    });
    if (!done) break;
  }
  for (int64_t D : o.depth) {
    const std::vector<int32_t> ids = random_ids(D + o.gen, c.vocab, o.seed + 7 * (uint64_t)D + 1);
    KVCache caches[2];
    std::vector<float> hidden(std::max<int64_t>(D, 1) * c.dim);
    for (int v = 0; v < (pair ? 2 : 1); ++v) {
      caches[v].init(c, D + o.gen, o.kv_type);
      if (D > 0) forward(m, ids.data(), D, caches[v], hidden.data(), plan_of(v));  // untimed: fills the cache
    }
    const bool done = measure("generate", o.gen, D, [&](int v) {
      KVCache& cache = caches[v];
      cache.truncate(D);
      const double t0 = now();
      for (int64_t i = 0; i < o.gen; ++i) {
        forward(m, &ids[D + i], 1, cache, hidden.data(), plan_of(v));
        compute_logits(m, hidden.data(), 1, logits.data());
      }
      return now() - t0;
    });
    if (!done) break;
  }
  j["results"] = rows;
  j["peak_rss_mb"] = peak_rss_mb();
  j["interrupted"] = interrupted();
  std::printf("peak resident memory %.1f MB\n", peak_rss_mb());
  if (o.json) std::printf("%s\n", j.dump().c_str());
  if (result) *result = j;
  return 0;
}

}  // namespace focus
