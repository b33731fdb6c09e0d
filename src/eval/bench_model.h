// End-to-end model benchmark, measured the way llama-bench measures: prefill of P random tokens
// into an empty cache (tokens/s, logits of the last row included), and generation of n tokens
// one at a time after a cache filled to depth d (tokens/s of the decode steps only). Medians of
// repetitions; the process's peak resident memory is reported too.
#pragma once
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <vector>

#include "model/model.h"

namespace focus {

struct ModelBenchOptions {
  std::vector<int64_t> prefill = {512, 2048};  // prompt lengths (empty: none)
  std::vector<int64_t> depth = {0, 4096};      // cache depths for generation (empty: none)
  int64_t gen = 64;                            // generated tokens per generation test
  int reps = 3;                                // timed repetitions (median) after one warm-up
  uint64_t seed = 1;
  bool json = false;
  cpu::KvType kv_type = cpu::KvType::F32;  // the KV cache's element type
  // With a plan: every test also runs the model's own dense attention, the two alternating
  // repetition by repetition (each on its own cache), so that both see the same state of a noisy
  // machine; the speedup reported is the median of the ratios of adjacent repetitions.
  bool against_dense = false;
};

// Runs on the threads the caller set; `plan` null: the model's own attention. Prints a table
// (and with opt.json a JSON line last); returns 0, or 1 after printing an error.
int run_model_bench(const Model& m, const AttentionPlan* plan, const std::string& attention,
                    const ModelBenchOptions& opt, nlohmann::json* result = nullptr);

}  // namespace focus
