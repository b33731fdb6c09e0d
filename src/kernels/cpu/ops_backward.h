// Backward passes of the dense CPU ops (ops.h), for activation gradients through a frozen model:
// no weight gradients are formed. Every function writes (=) its input gradient unless its name
// or comment says it accumulates. Shapes as in ops.h.
#pragma once
#include <cstdint>

#include "kernels/cpu/ops.h"

namespace focus::cpu {

// For y[M, N] = x[M, K] W[N, K]^T: dx[M, K] (+)= dy[M, N] W[N, K]. accumulate=false overwrites.
void linear_backward_input(const float* dy, const float* W, float* dx, int64_t M, int64_t K, int64_t N,
                           bool accumulate);

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
