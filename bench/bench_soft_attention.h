// The soft-mode Focus attention kernels' benchmark inside focus_bench (bench_soft_attention.cpp).
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>

namespace focus {

// Times soft_attention_forward / _backward (median of reps, after a warm-up run) on random inputs
// of n tokens at the SmolLM2-135M shape, without and with the router bias; prints one line per
// case and returns the timings and GFLOP/s as JSON.
nlohmann::json bench_soft_attention(int64_t n, int reps);

}  // namespace focus
