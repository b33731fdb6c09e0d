// The grouped (asymmetric) Focus attention kernel's benchmark inside focus_bench
// (bench_grouped_attention.cpp).
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>

namespace focus {

// Times grouped_attention against dense flash_attention (median of reps, after a warm-up run) on
// random inputs of n tokens at the SmolLM2-135M shape (9 heads, 3 kv heads, head_dim 64) with
// window 256, one sink, 32 groups of contiguous 256-key blocks, 4 slots per (row, head) and one
// routing per kv head: the prefill of n rows and one decoding row over n keys. Prints one line per
// case and returns the timings and the density as JSON.
nlohmann::json bench_grouped_attention(int64_t n, int reps);

}  // namespace focus
