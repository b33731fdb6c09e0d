// Benchmark of hard-mode Focus attention against dense causal attention on random inputs with a
// balanced random router: times dense (cpu::flash_attention), fused and two-call in one run, and
// decoding (one new token over a filled cache): dense against the group-indexed Focus cache.
#pragma once
#include <cstdint>
#include <nlohmann/json_fwd.hpp>

namespace focus {

struct AttnBenchOptions {
  int64_t n = 16384;
  int64_t heads = 8;
  int64_t kv_heads = 8;
  int64_t dim = 64;       // head_dim
  int64_t local_window = 256;  // Focus local window
  int64_t groups = 16;
  int topk = 1;
  int64_t sinks = 0;
  int reps = 3;           // timed repetitions (median), after one warm-up run
  int dense_reps = -1;    // dense repetitions: -1 = reps, 0 = skip dense; 1 = one run, no warm-up
  bool dense_tiles = true;  // also time dense causal on the sparse kernels' tile engine
  int64_t decode = 32;    // also time decoding the last `decode` positions from a cache (0: skip)
  int64_t check_rows = 64;  // rows checked against the reference when n <= 8192 (0: no check)
  uint64_t seed = 1;
  bool json = false;      // print one JSON object as the last stdout line
};

// Runs on the threads the caller set (set_threads). Prints a table (and with opt.json the JSON
// line); stores the JSON in *result when given.
// Returns 0, or 1 after printing an error.
int run_attention_bench(const AttnBenchOptions& opt, nlohmann::json* result = nullptr);

}  // namespace focus
