// focus bench attention: dense causal vs Focus fused vs two-call attention on random inputs.
#include "cli/setup.h"
#include "eval/bench_attention.h"

namespace focus::cli {

Command add_bench(CLI::App& app) {
  auto bo = std::make_shared<AttnBenchOptions>();
  auto* bench = app.add_subcommand("bench", "benchmarks");
  bench->require_subcommand(1);
  auto* ba = bench->add_subcommand("attention", "dense causal vs Focus fused vs two-call attention on random inputs");
  ba->add_option("--n", bo->n, "tokens");
  ba->add_option("--heads", bo->heads, "query heads H");
  ba->add_option("--kv-heads", bo->kv_heads, "key/value heads (default: --heads)");
  ba->add_option("--dim", bo->dim, "head dimension");
  ba->add_option("--window", bo->local_window, "Focus local window");
  ba->add_option("--groups", bo->groups, "groups G");
  ba->add_option("--topk", bo->topk, "groups per token (1 or 2)");
  ba->add_option("--sinks", bo->sinks, "sink tokens");
  ba->add_option("--reps", bo->reps, "timed repetitions (median, after a warm-up)");
  ba->add_option("--dense-reps", bo->dense_reps, "dense repetitions (-1: as --reps, 0: skip dense)");
  ba->add_flag("!--no-dense-tiles", bo->dense_tiles, "skip the dense run on the sparse tile engine (dense-t)");
  ba->add_option("--decode", bo->decode, "also time decoding the last N positions from a cache (0: skip; default 32)");
  ba->add_option("--seed", bo->seed, "seed of the random inputs and router");
  ba->add_flag("--json", bo->json, "last stdout line is a JSON object");
  return {bench, [bo, ba] {
            AttnBenchOptions o = *bo;
            if (!ba->count("--kv-heads")) o.kv_heads = o.heads;
            return run_attention_bench(o);
          }};
}

}  // namespace focus::cli
