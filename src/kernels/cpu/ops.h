// Dense CPU ops on float32 row-major buffers, each op's backward beside its forward. Shapes are
// given in the comments as [rows, cols]. The backward passes form activation gradients (no
// weight gradients); each writes (=) its input gradient unless its name or comment says it
// accumulates.
#pragma once
#include <cstdint>

#include "kernels/cpu/weight.h"

namespace focus::cpu {

// y[M, N] = x[M, K] * W[N, K]^T (+ bias[N] if not null). W is stored (out, in) like a Linear.
void linear(const float* x, const float* W, const float* bias, float* y, int64_t M, int64_t K, int64_t N);
// Same for a weight in any type (W.rows == N, W.cols == K, checked). F32 weights take the float path
// above. Otherwise a few rows (decoding: M <= kMatvecMaxRows) go through the quantised
// matrix-vector kernels (quant_matvec.h), and more rows (prefill) as prefill_gemm() says.
constexpr int64_t kMatvecMaxRows = 8;
void linear(const float* x, const Weight& W, const float* bias, float* y, int64_t M, int64_t K, int64_t N);
// Several linear layers of the same x[M, K] (a layer's q/k/v, or gate/up): outs[i].y = x W_i^T
// (+ bias), each equal to what linear() gives. While decoding (M <= kMatvecMaxRows, no F32
// weight) they run as one quant_matvec_multi call: one parallel region instead of one per layer.
struct LinearOut {
  const Weight* W;
  const float* bias;  // [W->rows] or null
  float* y;           // [M, W->rows]
};
void linear_multi(const float* x, const LinearOut* outs, int n, int64_t M, int64_t K);

// How linear() multiplies a quantised weight by more than kMatvecMaxRows rows (prefill, scoring):
// Int8: the integer GEMM (quant_gemm: int8 activations, as decoding uses them) where the CPU and
// the weight type allow it, else Dequant; Dequant: tiles of W dequantised into float32 through
// sgemm (the float32 weights' result up to rounding). Process-wide; the default is Int8.
enum class PrefillGemm { Int8, Dequant };
void set_prefill_gemm(PrefillGemm mode);
PrefillGemm prefill_gemm();
// Same, accumulating: y += x * W^T.
void linear_acc(const float* x, const float* W, float* y, int64_t M, int64_t K, int64_t N);

// out[r, :] = x[r, :] / rms(x[r, :]) * w  (w may be null: no scale). In place allowed.
void rmsnorm(const float* x, const float* w, float* out, int64_t rows, int64_t dim, float eps);
// out[r, :] = (x - mean) / sqrt(var + eps) * w + b. In place allowed.
void layernorm(const float* x, const float* w, const float* b, float* out, int64_t rows, int64_t dim, float eps);

enum class RopeStyle { Interleaved, SplitHalf };
// Rotates x[T, H, hd] in place; token t sits at position pos0 + t. The first rot_dim
// dims of each head are rotated (rot_dim even, <= hd).
void rope(float* x, int64_t T, int64_t H, int64_t hd, int64_t rot_dim, int64_t pos0, float theta, RopeStyle style);

// gate[i] = act(gate[i]) * up[i] for n elements (SwiGLU / GeGLU).
void silu_mul(float* gate, const float* up, int64_t n);
void gelu_tanh_mul(float* gate, const float* up, int64_t n);
void gelu_tanh(float* x, int64_t n);

// Time and FLOPs spent in linear(), linear_acc() and linear_backward_input() since the last reset (for benchmarks' utilisation figures).
struct GemmStats {
  double seconds = 0;
  double flops = 0;
};
GemmStats gemm_stats();
void reset_gemm_stats();
// Median GFLOP/s of `reps` calls of C[M, N] = A[M, K] B[N, K]^T (the layout linear() uses) on the
// current threads, after one warm-up call: the sgemm peak that utilisation figures divide by.
double sgemm_gflops(int M, int N, int K, int reps);

// x[i] += y[i]
void add_inplace(float* x, const float* y, int64_t n);

// Log-softmax of one row at `target`: logits[target] - logsumexp(logits).
double log_prob(const float* logits, int64_t n, int64_t target);
// log_softmax(x W^T)[m, targets[m]] into lp[m] for x [M, K] and a weight of any type, without
// holding all M x N logits: each tile of W's rows is dequantised once and multiplied by every row
// of x in chunks through sgemm, and the tiles' maxima and sums of exponentials are merged in order.
// Targets outside [0, N) are refused.
void linear_log_prob(const float* x, const Weight& W, int64_t M, const int32_t* targets, double* lp);
// Its two passes: the largest of x[0 .. n) (NaN never wins; -inf for n == 0), and the sum of
// exp(x[i] - shift) (float32 vector exponentials, summed in float64; NaN in, NaN out).
float max_of(const float* x, int64_t n);
// Whether x[0 .. n) holds no NaN and no infinity.
bool all_finite(const float* x, int64_t n);
double sum_exp(const float* x, int64_t n, float shift);

// ---- Backward passes.
// For y[M, N] = x[M, K] W[N, K]^T: dx[M, K] (+)= dy[M, N] W[N, K]. accumulate=false overwrites.
void linear_backward_input(const float* dy, const float* W, float* dx, int64_t M, int64_t K, int64_t N,
                           bool accumulate);
// Same for a weight in any type (dequantised a tile at a time).
void linear_backward_input(const float* dy, const Weight& W, float* dx, int64_t M, int64_t K, int64_t N,
                           bool accumulate);

// Parameter gradients of y[M, N] = x[M, K] W[N, K]^T + b: dW[N, K] += dy^T x and, when db is not
// null, db[N] += the column sums of dy.
void linear_backward_weight(const float* dy, const float* x, float* dW, float* db, int64_t M, int64_t K, int64_t N);
// dw[dim] += sum over rows of dy * x r (the normalised input), for y = rmsnorm(x) * w.
void rmsnorm_backward_weight(const float* x, const float* dy, float* dw, int64_t rows, int64_t dim, float eps);
// dw[dim] += sum of dy * xhat and, when db is not null, db[dim] += sum of dy, for
// y = layernorm(x) * w + b.
void layernorm_backward_weight(const float* x, const float* dy, float* dw, float* db, int64_t rows, int64_t dim,
                               float eps);

// For y = rmsnorm(x) * w (w may be null): dx (+)= dL/dx given dy. x is the norm's input.
void rmsnorm_backward(const float* x, const float* w, const float* dy, float* dx, int64_t rows, int64_t dim,
                      float eps, bool accumulate);
// For y = layernorm(x) * w + b: dx (+)= dL/dx given dy.
void layernorm_backward(const float* x, const float* w, const float* dy, float* dx, int64_t rows, int64_t dim,
                        float eps, bool accumulate);

// RoPE is a rotation, so its backward is the inverse rotation of the gradient, in place.
void rope_backward(float* dx, int64_t T, int64_t H, int64_t hd, int64_t rot_dim, int64_t pos0, float theta,
                   RopeStyle style);

// out = act(gate) * up: dgate, dup from dout (gate, up are the forward inputs).
void silu_mul_backward(const float* gate, const float* up, const float* dout, float* dgate, float* dup, int64_t n);
void gelu_tanh_mul_backward(const float* gate, const float* up, const float* dout, float* dgate, float* dup,
                            int64_t n);
// out = gelu_tanh(x): dx from dout.
void gelu_tanh_backward(const float* x, const float* dout, float* dx, int64_t n);

}  // namespace focus::cpu
