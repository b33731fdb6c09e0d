// focus bench attention: dense causal vs Focus fused vs two-call attention on random inputs.
// focus bench model: prefill and generation speed of a model, as llama-bench measures them.
#include "cli/setup.h"
#include "eval/bench_attention.h"
#include "eval/bench_model.h"

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
  auto mo = std::make_shared<ModelBenchOptions>();
  auto ms = std::make_shared<ModelSetup>();
  auto* bm = bench->add_subcommand("model", "prefill and generation tokens/s of a model (random tokens, like llama-bench)");
  ms->add_model(bm);
  ms->add_focus(bm);
  ms->add_kv_type(bm);
  bm->add_option("--prefill", mo->prefill, "prompt lengths to time (comma separated; default 512,2048; 0: none)")->delimiter(',');
  bm->add_option("--depth", mo->depth, "cache depths to generate at (comma separated; default 0,4096)")->delimiter(',');
  bm->add_option("--gen", mo->gen, "tokens generated per generation test (default 64)");
  bm->add_option("--reps", mo->reps, "timed repetitions (median, after a warm-up)");
  bm->add_option("--seed", mo->seed, "seed of the random tokens");
  bm->add_flag("--against-dense", mo->against_dense,
               "with --focus or --attention: also time the dense model, alternating repetitions, and report the speedup");
  bm->add_flag("--json", mo->json, "last stdout line is a JSON object");
  return {bench, [bo, ba, bm, mo, ms] {
            if (bm->parsed()) {
              Loaded l = ms->load();
              if (mo->gen > 0) l.check_decodes("bench model");
              ModelBenchOptions o = *mo;
              o.kv_type = ms->kv();
              return run_model_bench(*l.model, l.attention(), l.describe(), o);
            }
            AttnBenchOptions o = *bo;
            if (!ba->count("--kv-heads")) o.kv_heads = o.heads;
            return run_attention_bench(o);
          }};
}

}  // namespace focus::cli
