// The quantised matrix-vector and prefill GEMM benchmarks inside focus_bench (bench_quant_matvec.cpp).
#pragma once
#include <nlohmann/json.hpp>

namespace focus {

// Times cpu::quant_matvec with M = 1 (median of repetitions) per weight type, instruction set and
// thread count (1 and 2) on the decoding shapes of SmolLM2-135M and Gemma 3 270M, against
// cblas_sgemv on the same weights dequantised to float32; prints a table (microseconds, GB/s of
// weight bytes read, speedup over sgemv) and returns the rows as JSON. full = false keeps the
// shapes and types the two models' files use.
nlohmann::json bench_quant_matvec(bool full);

// Times prefill products of M rows on the same models' matrix shapes (not the output matrices),
// in their files' types and a few others: cpu::quant_gemm (int8 activations, integer products)
// against linear() through dequantised float32 tiles and sgemm, on the threads in use (median of
// repetitions); prints
// GOP/s (2 M N K per product) and the speedup, and returns the rows as JSON. Needs AVX-512 VNNI
// (an empty array otherwise).
nlohmann::json bench_quant_gemm(int64_t M);

}  // namespace focus
