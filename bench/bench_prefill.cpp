// Prefill throughput of a real model and the machine's sgemm rate, measured in one run, with
// model FLOP utilisation of the GEMM part of prefill against that sgemm peak; and the router
// training step (Focus soft forward + backward through the frozen model) at --train-ctx, with its
// useful-FLOP utilisation against the same sgemm peak; and the soft-mode Focus attention kernels
// alone at --soft-attn tokens (bench_soft_attention.h); and the grouped Focus attention kernel
// against dense attention at --grouped-attn tokens (bench_grouped_attention.h). With
// --quant-matvec [full], only the quantised matrix-vector kernels; with --quant-gemm M, only the
// prefill GEMM of M rows against dequantised tiles + sgemm (bench_quant_matvec.h).
//   focus_bench [--model smollm2] [--ctx 512,2048] [--train-ctx 1024] [--soft-attn 2048]
//               [--grouped-attn 8192] [--reps 3] [--threads T] [--json FILE]
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cli/process.h"
#include "core/error.h"
#include "core/threads.h"
#include "kernels/cpu/ops.h"
#include "model/model.h"
#include "train/backward.h"
#include "bench_grouped_attention.h"
#include "bench_quant_matvec.h"
#include "bench_soft_attention.h"

using namespace focus;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  focus::cli::reexec_for_blas_kernels(argv);
  std::string model = "smollm2", json_path;
  std::vector<int64_t> ctxs = {512, 2048};
  int reps = 3, threads = 0;
  int64_t train_ctx = 1024, soft_attn = 2048, grouped_attn = 0;
  std::string quant_matvec;  // "", "models" or "full"
  int64_t quant_gemm = 0;    // rows of the prefill GEMM benchmark (0: not run)
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "missing value for %s\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--model") model = next();
    else if (a == "--json") json_path = next();
    else if (a == "--reps") reps = std::stoi(next());
    else if (a == "--threads") threads = std::stoi(next());
    else if (a == "--train-ctx") train_ctx = std::stoll(next());
    else if (a == "--soft-attn") soft_attn = std::stoll(next());
    else if (a == "--grouped-attn") grouped_attn = std::stoll(next());
    else if (a == "--quant-gemm") quant_gemm = std::stoll(next());
    else if (a == "--quant-matvec") quant_matvec = (i + 1 < argc && std::string(argv[i + 1]) == "full") ? next() : "models";
    else if (a == "--ctx") {
      ctxs.clear();
      std::stringstream ss(next());
      for (std::string p; std::getline(ss, p, ',');) ctxs.push_back(std::stoll(p));
    } else {
      std::fprintf(stderr, "usage: focus_bench [--model M] [--ctx 512,2048] [--train-ctx N (0: skip)] "
                           "[--soft-attn N (0: skip)] [--grouped-attn N (0: skip)] [--reps N] [--threads T] "
                           "[--json FILE] [--quant-matvec [full]] [--quant-gemm M]\n");
      return 2;
    }
  }
  try {
    set_threads(threads);
    nlohmann::json out;
    if (!quant_matvec.empty() || quant_gemm > 0) {
      if (!quant_matvec.empty()) out["quant_matvec"] = bench_quant_matvec(quant_matvec == "full");
      if (quant_gemm > 0) out["quant_gemm"] = bench_quant_gemm(quant_gemm);
      if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
      return 0;
    }
    out["threads"] = num_threads();
    const double peak_sq = focus::cpu::sgemm_gflops(2048, 2048, 2048, reps);
    std::printf("sgemm 2048^3: %.1f GFLOP/s (%d threads)\n", peak_sq, num_threads());
    out["sgemm_gflops_2048"] = peak_sq;
    if (soft_attn > 0) out["soft_attention"] = bench_soft_attention(soft_attn, reps);
    if (grouped_attn > 0) out["grouped_attention"] = bench_grouped_attention(grouped_attn, reps);

    LoadOptions lo;
    lo.need_tokenizer = false;
    auto m = load_model(model, lo);
    const ModelConfig& c = m->cfg;
    out["model"] = m->path;
    std::vector<nlohmann::json> rows;
    for (int64_t ctx : ctxs) {
      // The sgemm rate on this model's own prefill shape (M = ctx, the FFN projection).
      const double peak_shape = focus::cpu::sgemm_gflops((int)ctx, (int)c.ffn, (int)c.dim, reps);
      std::vector<int32_t> ids(ctx);
      std::mt19937 rng(7);
      for (auto& x : ids) x = (int32_t)(rng() % c.vocab);
      KVCache cache;
      cache.init(c, ctx);
      std::vector<float> hidden(ctx * c.dim);
      std::vector<double> tt, tg, fg;
      for (int r = 0; r < reps + 1; ++r) {
        cache.clear();
        cpu::reset_gemm_stats();
        auto t0 = Clock::now();
        forward(*m, ids.data(), ctx, cache, hidden.data());
        const double t = seconds_since(t0);
        if (r == 0) continue;  // warm-up
        tt.push_back(t);
        tg.push_back(cpu::gemm_stats().seconds);
        fg.push_back(cpu::gemm_stats().flops);
      }
      const double t = median(tt), tgemm = median(tg), flops = fg[0];
      const double gemm_rate = flops / tgemm / 1e9;
      nlohmann::json row{{"ctx", ctx},
                         {"prefill_tok_per_s", ctx / t},
                         {"prefill_ms", t * 1e3},
                         {"gemm_ms", tgemm * 1e3},
                         {"gemm_share", tgemm / t},
                         {"gemm_gflops", gemm_rate},
                         {"sgemm_gflops_same_shape", peak_shape},
                         {"mfu_gemm_vs_2048", gemm_rate / peak_sq},
                         {"mfu_gemm_vs_shape", gemm_rate / peak_shape},
                         {"mfu_total_vs_2048", flops / t / 1e9 / peak_sq}};
      std::printf(
          "ctx %5lld: prefill %8.1f tok/s (%.1f ms) | GEMM %.1f GFLOP/s = %.0f%% of sgemm 2048^3, %.0f%% of sgemm at "
          "[%lld x %lld x %lld] (%.1f GFLOP/s) | GEMM share of time %.0f%%\n",
          (long long)ctx, ctx / t, t * 1e3, gemm_rate, 100 * gemm_rate / peak_sq, 100 * gemm_rate / peak_shape,
          (long long)ctx, (long long)c.ffn, (long long)c.dim, peak_shape, 100 * tgemm / t);
      rows.push_back(row);
    }
    out["prefill"] = rows;

    if (train_ctx > 0) {
      // One router-training window: Focus soft attention on every global layer, loss over all
      // rows, gradients of the routers only. Useful FLOPs: the GEMMs (forward and input-gradient
      // backward, counted by the GEMM wrapper) plus attention, 4*Dh per causal pair and head
      // forward and 8*Dh backward.
      FocusSettings fs;
      fs.local_window = 64;
      fs.groups = 16;
      FocusRouters f = focus_init(c, fs, 1);
      const int64_t T = train_ctx;
      std::vector<int32_t> ids(T), tg(T);
      std::mt19937 rng(9);
      for (auto& x : ids) x = (int32_t)(rng() % c.vocab);
      for (int64_t t = 0; t < T; ++t) tg[t] = t + 1 < T ? ids[t + 1] : -1;
      std::vector<std::vector<float>> grads(f.routers.size());
      std::vector<double> tt, tg_s, fg;
      for (int r = 0; r < reps + 1; ++r) {
        for (size_t i = 0; i < grads.size(); ++i) grads[i].assign(f.routers[i].params.size(), 0.f);
        cpu::reset_gemm_stats();
        auto t0 = Clock::now();
        focus_router_loss_and_grad(*m, f, TrainWindow{ids.data(), T, tg.data()}, 1.f / T, &grads);
        const double t = seconds_since(t0);
        if (r == 0) continue;
        tt.push_back(t);
        tg_s.push_back(cpu::gemm_stats().seconds);
        fg.push_back(cpu::gemm_stats().flops);
      }
      double pairs = 0;
      for (int64_t l = 0; l < c.layers; ++l) {
        const int64_t w = c.layer_sliding_window[l];
        for (int64_t i = 0; i < T; ++i) pairs += (double)(w > 0 ? std::min<int64_t>(w, i + 1) : i + 1);
      }
      const double attn_flops = 12.0 * c.head_dim * c.heads * pairs;
      const double t = median(tt), useful = fg[0] + attn_flops;
      nlohmann::json tr{{"ctx", T},
                        {"train_tok_per_s", (T - 1) / t},
                        {"step_ms", t * 1e3},
                        {"gemm_share", median(tg_s) / t},
                        {"useful_gflop", useful / 1e9},
                        {"useful_gflops", useful / t / 1e9},
                        {"utilisation_vs_sgemm_2048", useful / t / 1e9 / peak_sq}};
      std::printf("router training ctx %lld: %.1f tok/s (%.0f ms per window) | useful %.1f GFLOP/s = %.0f%% of sgemm "
                  "2048^3 | GEMM share of time %.0f%%\n",
                  (long long)T, (T - 1) / t, t * 1e3, useful / t / 1e9, 100 * useful / t / 1e9 / peak_sq,
                  100 * median(tg_s) / t);
      out["train"] = tr;
    }
    if (!json_path.empty()) {
      std::ofstream f(json_path);
      f << out.dump(2) << "\n";
    }
    std::printf("%s\n", out.dump().c_str());
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
