// Matrix-vector (and small matrix-matrix) products with weights kept in their GGUF block formats:
// the decoding path of the linear layers. One binary carries several implementations and picks
// the best one this CPU runs (AVX-512 VNNI, AVX2 + FMA + F16C, or portable code).
#pragma once
#include <cstdint>
#include <string>

#include "kernels/cpu/weight.h"

namespace focus::cpu {

// y[m, n] = sum_k x[m, k] * W[n, k] for m < M, n < W.rows; x is [M, W.cols] row-major and y is
// [M, W.rows] row-major (overwritten; must not overlap x). M is meant to be small (1 when
// decoding, up to ~16).
//
// Quantised weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) are multiplied by
// an int8 copy of each row of x: every kQuantActBlock elements share one float32 scale
// d = absmax / 127 and q = round(x / d) (see quantize_activation_scales), and the products are
// summed in integers, one sub-block of the weight at a time (Q2_K and Q3_K by the portable code
// under every instruction set, the others by vector kernels). F32, F16 and BF16 weights multiply
// float32 x in float32. Any other supported type is dequantised a row at a time. Products are
// split over the OpenMP threads (in 16-row chunks) when the weight is over 96 KiB and the call is
// not already inside a parallel region.
//
// Error: for one output, |y - sum_k x[k] W[n,k]| <= sum_b (d_b / 2) * sum_{k in b} |W[n,k]| plus
// float32 rounding (a few ulps of the magnitudes summed), the first term being zero for the float
// types. Each output depends only on its own row of x and of W: the result for a row of x does not
// change with M, the thread count or the row chunking.
void quant_matvec(const float* x, const Weight& W, float* y, int64_t M);

// Several products of the same x (a layer's q, k and v projections, or its gate and up): for each
// i, outs[i].y = x W_i^T as quant_matvec gives it (the same bits), in one parallel region, x
// quantised once for each activation layout the weights' kernels read. Every W_i has x's width.
struct MatvecOut {
  const Weight* W;
  float* y;  // [M, W->rows]
};
void quant_matvec_multi(const float* x, const MatvecOut* outs, int n, int64_t M);

// The same products for many rows of x (prefill), as a GEMM in integers: x is quantised exactly as
// quant_matvec does (int8 per 32-element block), the weights are decoded into panels of 32 rows
// of signed bytes, and each output is sum_g A_g d_g (sum_{k in g} q_w q_x) + B_g s_g over the
// weight's scale groups g (16 or 32 elements): the same terms as quant_matvec, summed in another
// order, so the error bound above holds. With the AVX-512 VNNI or the AVX2 instruction set (the
// same integer sums and float steps) and for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K,
// Q3_K, Q4_K, Q5_K and Q6_K weights (quant_gemm_supported).
bool quant_gemm_supported(const Weight& W);
void quant_gemm(const float* x, const Weight& W, float* y, int64_t M);
// Scoring without the logits in memory: lp[m] = the log-softmax at targets[m] of row m of the
// logits x [M, K] W^T that quant_gemm computes (the same values), for large vocabularies: each
// 2048-row block of W is decoded once for all M rows (quant_gemm in row chunks decodes all of W
// per chunk) and only a running maximum and sum per row are kept. Deterministic for any thread
// count; a NaN or infinite logit or activation gives a NaN log-probability. (Here and in
// quant_gemm and quant_matvec, a row of x that holds a NaN or an infinity gives NaN outputs, as
// float arithmetic would, although its int8 rounding alone would be finite.)
void quant_gemm_log_softmax(const float* x, const Weight& W, int64_t M, const int32_t* targets, double* lp);

// Elements of x sharing one activation scale.
inline constexpr int64_t kQuantActBlock = 32;

// The activation scales quant_matvec uses for one row x[K] of x (K a multiple of kQuantActBlock):
// d[b] = max_{k in block b} |x[k]| / 127 in float32, for b < K / kQuantActBlock.
void quantize_activation_scales(const float* x, int64_t K, float* d);

// The instruction set in use: "avx512vnni", "avx2" or "generic".
const char* quant_isa();
// Forces one of those (for tests and benchmarks); returns false, changing nothing, when the name
// is unknown or this CPU cannot run it. "best" selects the fastest this CPU supports.
bool set_quant_isa(const std::string& name);
// True if this CPU can run the named instruction set.
bool quant_isa_supported(const std::string& name);

}  // namespace focus::cpu
