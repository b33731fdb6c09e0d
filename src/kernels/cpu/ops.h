// Dense CPU ops on float32 row-major buffers. Shapes are given in the comments as [rows, cols].
#pragma once
#include <cstdint>

namespace focus::cpu {

// y[M, N] = x[M, K] * W[N, K]^T (+ bias[N] if not null). W is stored (out, in) like a Linear.
void linear(const float* x, const float* W, const float* bias, float* y, int64_t M, int64_t K, int64_t N);
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

// x[i] += y[i]
void add_inplace(float* x, const float* y, int64_t n);

// Log-softmax of one row at `target`: logits[target] - logsumexp(logits).
double log_prob(const float* logits, int64_t n, int64_t target);

}  // namespace focus::cpu
