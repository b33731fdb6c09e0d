#include "kernels/cpu/ops.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "core/threads.h"
#include "kernels/cpu/quant_matvec.h"
#include "kernels/cpu/simd.h"

namespace focus::cpu {
namespace {
// Process-wide totals, updated by every thread that runs a linear layer (several may share a
// model): atomics, so concurrent inference does not race on them.
std::atomic<double> g_gemm_seconds{0}, g_gemm_flops{0};
struct GemmTimer {
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  double flops;
  explicit GemmTimer(double f) : flops(f) {}
  ~GemmTimer() {
    g_gemm_seconds.fetch_add(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                             std::memory_order_relaxed);
    g_gemm_flops.fetch_add(flops, std::memory_order_relaxed);
  }
};
}  // namespace

GemmStats gemm_stats() { return GemmStats{g_gemm_seconds.load(), g_gemm_flops.load()}; }

double sgemm_gflops(int M, int N, int K, int reps) {
  reps = std::max(reps, 1);
  std::vector<float> a((size_t)M * K), b((size_t)N * K), c((size_t)M * N);
  uint32_t x = 12345;
  for (auto* v : {&a, &b})
    for (float& f : *v) {
      x = x * 1664525u + 1013904223u;
      f = (float)((x >> 8) * (1.0 / 16777216.0)) * 2.f - 1.f;
    }
  std::vector<double> t;
  for (int r = 0; r < reps + 1; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.f, a.data(), K, b.data(), K, 0.f, c.data(), N);
    if (r > 0) t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return 2.0 * M * N * K / t[t.size() / 2] / 1e9;
}
void reset_gemm_stats() {
  g_gemm_seconds = 0;
  g_gemm_flops = 0;
}

void linear(const float* x, const float* W, const float* bias, float* y, int64_t M, int64_t K, int64_t N) {
  GemmTimer timer(2.0 * M * N * K);
  if (bias) {
#pragma omp parallel for schedule(static) if (M * N > 65536)
    for (int64_t r = 0; r < M; ++r)
      for (int64_t c = 0; c < N; ++c) y[r * N + c] = bias[c];
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)M, (int)N, (int)K, 1.0f, x, (int)K, W, (int)K,
              bias ? 1.0f : 0.0f, y, (int)N);
}

void linear_acc(const float* x, const float* W, float* y, int64_t M, int64_t K, int64_t N) {
  GemmTimer timer(2.0 * M * N * K);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)M, (int)N, (int)K, 1.0f, x, (int)K, W, (int)K, 1.0f, y,
              (int)N);
}

void linear_backward_input(const float* dy, const float* W, float* dx, int64_t M, int64_t K, int64_t N,
                           bool accumulate) {
  GemmTimer timer(2.0 * M * N * K);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)M, (int)K, (int)N, 1.0f, dy, (int)N, W, (int)K,
              accumulate ? 1.0f : 0.0f, dx, (int)K);
}

// Row sums over [rows, dim] into a per-column accumulator, split over columns so threads never
// share an output element: acc[i] += sum_r f(r, i).
template <class F>
static void column_sums(int64_t rows, int64_t dim, float* acc, F f) {
#pragma omp parallel for schedule(static) if (rows * dim > 65536)
  for (int64_t i0 = 0; i0 < dim; i0 += 16) {
    const int64_t i1 = std::min(dim, i0 + 16);
    double s[16] = {0};
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = i0; i < i1; ++i) s[i - i0] += f(r, i);
    for (int64_t i = i0; i < i1; ++i) acc[i] += (float)s[i - i0];
  }
}

void linear_backward_weight(const float* dy, const float* x, float* dW, float* db, int64_t M, int64_t K, int64_t N) {
  {
    GemmTimer timer(2.0 * M * N * K);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)N, (int)K, (int)M, 1.0f, dy, (int)N, x, (int)K, 1.0f, dW,
                (int)K);
  }
  if (db) column_sums(M, N, db, [&](int64_t r, int64_t i) { return (double)dy[r * N + i]; });
}

namespace {

void check_shape(const Weight& W, int64_t K, int64_t N) {
  FOCUS_CHECK(W.data && W.cols == K && W.rows == N, "linear: a ", W.rows, " x ", W.cols, " ", io::type_name(W.type),
              " weight used as ", N, " x ", K);
}

// y[r, :] += bias for r < M (nothing when bias is null).
void add_bias(float* y, const float* bias, int64_t M, int64_t N) {
  if (!bias) return;
  for (int64_t r = 0; r < M; ++r)
    for (int64_t c = 0; c < N; ++c) y[r * N + c] += bias[c];
}

// Rows of W per dequantised tile: about 8 MB of float32, at least one row.
int64_t tile_rows(const Weight& W) {
  return std::clamp<int64_t>((int64_t{8} << 20) / (int64_t)(sizeof(float) * std::max<int64_t>(W.cols, 1)), 1, W.rows);
}

// Rows [r0, r0 + n) of W as float32 into a buffer of the calling thread, dequantised in parallel.
const float* dequantized_tile(const Weight& W, int64_t r0, int64_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < (size_t)(n * W.cols)) buf.resize((size_t)(n * W.cols));
  float* out = buf.data();
#pragma omp parallel for schedule(static) if (n * W.cols > 32768)
  for (int64_t r = 0; r < n; ++r) dequantize_rows(W, r0 + r, 1, out + r * W.cols);
  return out;
}

}  // namespace

namespace {
std::atomic<int>& prefill_gemm_mode() {
  static std::atomic<int> mode{(int)PrefillGemm::Int8};
  return mode;
}
}  // namespace

void set_prefill_gemm(PrefillGemm mode) { prefill_gemm_mode() = (int)mode; }
PrefillGemm prefill_gemm() { return (PrefillGemm)prefill_gemm_mode().load(); }

void linear(const float* x, const Weight& W, const float* bias, float* y, int64_t M, int64_t K, int64_t N) {
  check_shape(W, K, N);
  if (W.is_f32()) return linear(x, W.f32_data(), bias, y, M, K, N);
  GemmTimer timer(2.0 * M * N * K);
  const bool int8_gemm = M > kMatvecMaxRows && prefill_gemm() == PrefillGemm::Int8 && quant_gemm_supported(W);
  if (M <= kMatvecMaxRows || int8_gemm) {
    if (int8_gemm) quant_gemm(x, W, y, M);
    else quant_matvec(x, W, y, M);
    add_bias(y, bias, M, N);
    return;
  }
  const int64_t R = tile_rows(W);
  for (int64_t n0 = 0; n0 < N; n0 += R) {
    const int64_t n = std::min(R, N - n0);
    const float* Wt = dequantized_tile(W, n0, n);
    if (bias)
      for (int64_t r = 0; r < M; ++r) std::copy(bias + n0, bias + n0 + n, y + r * N + n0);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)M, (int)n, (int)K, 1.0f, x, (int)K, Wt, (int)K,
                bias ? 1.0f : 0.0f, y + n0, (int)N);
  }
}

void linear_multi(const float* x, const LinearOut* outs, int n, int64_t M, int64_t K) {
  bool fused = M <= kMatvecMaxRows && n <= 8;
  int64_t N = 0;
  for (int i = 0; i < n; ++i) {
    check_shape(*outs[i].W, K, outs[i].W->rows);
    fused = fused && !outs[i].W->is_f32();
    N += outs[i].W->rows;
  }
  if (!fused) {
    for (int i = 0; i < n; ++i) linear(x, *outs[i].W, outs[i].bias, outs[i].y, M, K, outs[i].W->rows);
    return;
  }
  GemmTimer timer(2.0 * M * N * K);
  MatvecOut mo[8];
  for (int i = 0; i < n; ++i) mo[i] = {outs[i].W, outs[i].y};
  quant_matvec_multi(x, mo, n, M);
  for (int i = 0; i < n; ++i) add_bias(outs[i].y, outs[i].bias, M, outs[i].W->rows);
}

void linear_backward_input(const float* dy, const Weight& W, float* dx, int64_t M, int64_t K, int64_t N,
                           bool accumulate) {
  check_shape(W, K, N);
  if (W.is_f32()) return linear_backward_input(dy, W.f32_data(), dx, M, K, N, accumulate);
  GemmTimer timer(2.0 * M * N * K);
  const int64_t R = tile_rows(W);
  for (int64_t n0 = 0; n0 < N; n0 += R) {
    const int64_t n = std::min(R, N - n0);
    const float* Wt = dequantized_tile(W, n0, n);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)M, (int)K, (int)n, 1.0f, dy + n0, (int)N, Wt, (int)K,
                (accumulate || n0 > 0) ? 1.0f : 0.0f, dx, (int)K);
  }
}

namespace {
// sum_i x_i^2 in float64, in eight interleaved partial sums (so the compiler can vectorise it).
double sum_squares(const float* x, int64_t n) {
  double s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += (double)x[i + j] * x[i + j];
  for (int j = 0; i < n; ++i, ++j) s[j] += (double)x[i] * x[i];
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}
}  // namespace

void rmsnorm(const float* x, const float* w, float* out, int64_t rows, int64_t dim, float eps) {
  parallel_for(rows, rows > 16, [&](int64_t r) {
    const float* xr = x + r * dim;
    float* o = out + r * dim;
    const double ss = sum_squares(xr, dim);
    const float inv = (float)(1.0 / std::sqrt(ss / dim + eps));
    if (w)
      for (int64_t i = 0; i < dim; ++i) o[i] = xr[i] * inv * w[i];
    else
      for (int64_t i = 0; i < dim; ++i) o[i] = xr[i] * inv;
  });
}

// y_i = x_i r w_i with r = (mean(x^2) + eps)^-1/2. With g_i = w_i dy_i:
//   dx_i = r g_i - x_i r^3 (sum_j g_j x_j) / D
void rmsnorm_backward(const float* x, const float* w, const float* dy, float* dx, int64_t rows, int64_t dim,
                      float eps, bool accumulate) {
#pragma omp parallel for schedule(static) if (rows > 16)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    const float* g = dy + r * dim;
    float* o = dx + r * dim;
    const double ss = sum_squares(xr, dim);
    double gx = 0;
    for (int64_t i = 0; i < dim; ++i) gx += (double)g[i] * (w ? w[i] : 1.0f) * xr[i];
    const double inv = 1.0 / std::sqrt(ss / dim + eps);
    const float a = (float)inv, b = (float)(inv * inv * inv * gx / dim);
    for (int64_t i = 0; i < dim; ++i) {
      const float v = a * g[i] * (w ? w[i] : 1.0f) - b * xr[i];
      o[i] = accumulate ? o[i] + v : v;
    }
  }
}

void rmsnorm_backward_weight(const float* x, const float* dy, float* dw, int64_t rows, int64_t dim, float eps) {
  std::vector<float> inv(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    const double ss = sum_squares(xr, dim);
    inv[r] = (float)(1.0 / std::sqrt(ss / dim + eps));
  }
  column_sums(rows, dim, dw, [&](int64_t r, int64_t i) { return (double)dy[r * dim + i] * x[r * dim + i] * inv[r]; });
}

void layernorm_backward_weight(const float* x, const float* dy, float* dw, float* db, int64_t rows, int64_t dim,
                               float eps) {
  std::vector<float> mean(rows), inv(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    double s = 0;
    for (int64_t i = 0; i < dim; ++i) s += xr[i];
    const double mu = s / dim;
    double v = 0;
    for (int64_t i = 0; i < dim; ++i) v += (xr[i] - mu) * (xr[i] - mu);
    mean[r] = (float)mu;
    inv[r] = (float)(1.0 / std::sqrt(v / dim + eps));
  }
  column_sums(rows, dim, dw, [&](int64_t r, int64_t i) {
    return (double)dy[r * dim + i] * (x[r * dim + i] - mean[r]) * inv[r];
  });
  if (db) column_sums(rows, dim, db, [&](int64_t r, int64_t i) { return (double)dy[r * dim + i]; });
}

void layernorm(const float* x, const float* w, const float* b, float* out, int64_t rows, int64_t dim, float eps) {
  parallel_for(rows, rows > 16, [&](int64_t r) {
    const float* xr = x + r * dim;
    float* o = out + r * dim;
    double s = 0;
    for (int64_t i = 0; i < dim; ++i) s += xr[i];
    const double mean = s / dim;
    double v = 0;
    for (int64_t i = 0; i < dim; ++i) v += (xr[i] - mean) * (xr[i] - mean);
    const float inv = (float)(1.0 / std::sqrt(v / dim + eps));
    const float m = (float)mean;
    for (int64_t i = 0; i < dim; ++i) o[i] = (xr[i] - m) * inv * (w ? w[i] : 1.0f) + (b ? b[i] : 0.0f);
  });
}

// xhat = (x - mu) r; y = xhat w + b. With g = w dy: dx = r (g - mean(g) - xhat mean(g xhat)).
void layernorm_backward(const float* x, const float* w, const float* dy, float* dx, int64_t rows, int64_t dim,
                        float eps, bool accumulate) {
#pragma omp parallel for schedule(static) if (rows > 16)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    const float* d = dy + r * dim;
    float* o = dx + r * dim;
    double s = 0;
    for (int64_t i = 0; i < dim; ++i) s += xr[i];
    const double mean = s / dim;
    double v = 0;
    for (int64_t i = 0; i < dim; ++i) v += (xr[i] - mean) * (xr[i] - mean);
    const double inv = 1.0 / std::sqrt(v / dim + eps);
    double gs = 0, gxh = 0;
    for (int64_t i = 0; i < dim; ++i) {
      const double g = (double)d[i] * (w ? w[i] : 1.0f);
      gs += g;
      gxh += g * (xr[i] - mean) * inv;
    }
    const double mg = gs / dim, mgx = gxh / dim;
    for (int64_t i = 0; i < dim; ++i) {
      const double g = (double)d[i] * (w ? w[i] : 1.0f);
      const double xh = (xr[i] - mean) * inv;
      const float val = (float)(inv * (g - mg - xh * mgx));
      o[i] = accumulate ? o[i] + val : val;
    }
  }
}

namespace {
// cos and sin of every (position, pair) angle for one (theta, rot_dim), computed in double once
// and kept by the calling thread: positions [0, n_pos) as cs[(pos * half + i) * 2 + {0, 1}].
// Tables of the last few (theta, rot_dim) pairs are kept (a model has at most two thetas).
struct RopeTable {
  float theta = 0;
  int64_t rot_dim = 0, n_pos = 0;
  std::vector<float> cs;
};

const float* rope_table(float theta, int64_t rot_dim, int64_t pos_end) {
  thread_local std::vector<RopeTable> tables;
  RopeTable* t = nullptr;
  for (auto& x : tables)
    if (x.theta == theta && x.rot_dim == rot_dim) t = &x;
  if (!t) {
    if (tables.size() >= 4) tables.erase(tables.begin());
    tables.push_back(RopeTable{theta, rot_dim, 0, {}});
    t = &tables.back();
  }
  if (pos_end > t->n_pos) {
    const int64_t half = rot_dim / 2, n = std::max(pos_end, 2 * t->n_pos);
    t->cs.resize((size_t)(n * half * 2));
    for (int64_t p = t->n_pos; p < n; ++p)
      for (int64_t i = 0; i < half; ++i) {
        // Frequencies in double so every format and path agrees on the angle.
        const double freq = std::pow((double)theta, -2.0 * (double)i / (double)rot_dim);
        const double ang = (double)p * freq;
        t->cs[(p * half + i) * 2] = (float)std::cos(ang);
        t->cs[(p * half + i) * 2 + 1] = (float)std::sin(ang);
      }
    t->n_pos = n;
  }
  return t->cs.data();
}

// Rotates each pair (a, b) of the first rot_dim dims of every head by the position's angle,
// [[c, -s], [s, c]] for direction 1; direction -1 applies the transpose (the inverse rotation).
void rotate_pairs(float* x, int64_t T, int64_t H, int64_t hd, int64_t rot_dim, int64_t pos0, float theta,
                  RopeStyle style, float direction) {
  const int64_t half = rot_dim / 2;
  if (half == 0 || T <= 0) return;
  const float* table = rope_table(theta, rot_dim, pos0 + T);
  parallel_for(T, T > 4, [&](int64_t t) {
    const float* cs = table + (pos0 + t) * half * 2;
    for (int64_t i = 0; i < half; ++i) {
      const float c = cs[2 * i], s = direction * cs[2 * i + 1];
      for (int64_t h = 0; h < H; ++h) {
        float* v = x + (t * H + h) * hd;
        const int64_t a = style == RopeStyle::Interleaved ? 2 * i : i;
        const int64_t b = style == RopeStyle::Interleaved ? 2 * i + 1 : i + half;
        const float x0 = v[a], x1 = v[b];
        v[a] = x0 * c - x1 * s;
        v[b] = x0 * s + x1 * c;
      }
    }
  });
}
}  // namespace

void rope(float* x, int64_t T, int64_t H, int64_t hd, int64_t rot_dim, int64_t pos0, float theta, RopeStyle style) {
  rotate_pairs(x, T, H, hd, rot_dim, pos0, theta, style, 1.f);
}

void rope_backward(float* dx, int64_t T, int64_t H, int64_t hd, int64_t rot_dim, int64_t pos0, float theta,
                   RopeStyle style) {
  rotate_pairs(dx, T, H, hd, rot_dim, pos0, theta, style, -1.f);
}

namespace {
constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2/pi)
inline float silu(float v) { return v / (1.0f + std::exp(-v)); }
inline float gelu_t(float v) { return 0.5f * v * (1.0f + std::tanh(kGeluK * (v + 0.044715f * v * v * v))); }

// The forward activations on whole vectors: silu(v) = v / (1 + e^-v) and the tanh GELU as
// 0.5 v (1 + tanh(u)) = v / (1 + e^(-2u)) (no cancellation for large negative u), with the
// vector exp of simd.h (Cephes, ~1 ulp). Tails of fewer than kV elements take the scalar forms.
inline simd::vf silu_v(simd::vf v) { return v / (1.0f + simd::vexp_cephes(-v)); }
inline simd::vf gelu_v(simd::vf v) {
  return v / (1.0f + simd::vexp_cephes(v * (-2.0f * kGeluK) * (1.0f + 0.044715f * v * v)));
}
template <class VecF, class ScalarF>
void map_mul(float* x, const float* mul, int64_t n, VecF&& vf_fn, ScalarF&& sf_fn) {
  using simd::kV;
  const int64_t nv = n / kV * kV;
  parallel_for(nv / kV, n > 65536, [&](int64_t b) {
    const int64_t i = b * kV;
    simd::vf r = vf_fn(simd::load(x + i));
    if (mul) r *= simd::load(mul + i);
    simd::store(x + i, r);
  });
  for (int64_t i = nv; i < n; ++i) x[i] = sf_fn(x[i]) * (mul ? mul[i] : 1.0f);
}
inline float gelu_t_grad(float v) {
  const float t = std::tanh(kGeluK * (v + 0.044715f * v * v * v));
  return 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * kGeluK * (1.0f + 3.0f * 0.044715f * v * v);
}
}  // namespace

void silu_mul(float* gate, const float* up, int64_t n) { map_mul(gate, up, n, silu_v, silu); }
void silu_mul_backward(const float* gate, const float* up, const float* dout, float* dgate, float* dup, int64_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i], sg = 1.0f / (1.0f + std::exp(-g));
    dup[i] = dout[i] * g * sg;
    dgate[i] = dout[i] * up[i] * sg * (1.0f + g * (1.0f - sg));
  }
}

void gelu_tanh_mul(float* gate, const float* up, int64_t n) { map_mul(gate, up, n, gelu_v, gelu_t); }
void gelu_tanh_mul_backward(const float* gate, const float* up, const float* dout, float* dgate, float* dup,
                            int64_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    dup[i] = dout[i] * gelu_t(gate[i]);
    dgate[i] = dout[i] * up[i] * gelu_t_grad(gate[i]);
  }
}

void gelu_tanh(float* x, int64_t n) { map_mul(x, nullptr, n, gelu_v, gelu_t); }


void gelu_tanh_backward(const float* x, const float* dout, float* dx, int64_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) dx[i] = dout[i] * gelu_t_grad(x[i]);
}

void add_inplace(float* x, const float* y, int64_t n) {
  parallel_for(n, n > 65536, [&](int64_t i) { x[i] += y[i]; });
}

// The maximum in vectors (a NaN never wins a comparison, as in std::max), then the exponentials in
// float32 vectors (Cephes, about 1 ulp) summed in float64 lanes: the terms are positive, so the sum's
// relative error is that of the terms (a few 1e-7), where a scalar float64 exp per element made
// this the slowest part of scoring a large vocabulary (262,144 logits per row for Gemma 3).
float max_of(const float* x, int64_t n) {
  using simd::kV;
  const int64_t nv = n / kV * kV;
  float mx = -std::numeric_limits<float>::infinity();
  if (nv > 0) {
    simd::vf m = simd::load(x);
    for (int64_t i = kV; i < nv; i += kV) m = simd::vmax(m, simd::load(x + i));
    for (int j = 0; j < kV; ++j) mx = std::max(mx, m[j]);
  }
  for (int64_t i = nv; i < n; ++i) mx = std::max(mx, x[i]);
  return mx;
}

bool all_finite(const float* x, int64_t n) {
  using simd::kV;
  simd::vf acc{};  // x * 0 is exactly 0 for a finite x and NaN otherwise
  int64_t i = 0;
  for (; i + kV <= n; i += kV) acc += simd::load(x + i) * 0.f;
  float z = 0.f;
  for (int j = 0; j < kV; ++j) z += acc[j];
  for (; i < n; ++i) z += x[i] * 0.f;
  return z == 0.f;
}

double sum_exp(const float* x, int64_t n, float shift) {
  using simd::kV;
  const int64_t nv = n / kV * kV;
  const simd::vf vs = simd::bcast(shift);
  double acc[kV] = {};
  for (int64_t i = 0; i < nv; i += kV) {
    const simd::vf e = simd::vexp_cephes(simd::load(x + i) - vs);
    for (int j = 0; j < kV; ++j) acc[j] += (double)e[j];
  }
  double s = 0;
  for (int j = 0; j < kV; ++j) s += acc[j];
  for (int64_t i = nv; i < n; ++i) s += std::exp((double)x[i] - shift);
  return s;
}

double log_prob(const float* logits, int64_t n, int64_t target) {
  const float mx = max_of(logits, n);
  return (double)logits[target] - mx - std::log(sum_exp(logits, n, mx));
}

void linear_log_prob(const float* x, const Weight& W, int64_t M, const int32_t* targets, double* lp) {
  const int64_t K = W.cols, N = W.rows;
  FOCUS_CHECK(W.data && M >= 0 && N >= 1, "linear_log_prob: bad shape");
  for (int64_t m = 0; m < M; ++m)
    FOCUS_CHECK(targets[m] >= 0 && targets[m] < N, "linear_log_prob: target ", targets[m], " of row ", m,
                " outside [0, ", N, ")");
  if (M == 0) return;
  GemmTimer timer(2.0 * M * N * K);
  constexpr int64_t kRowChunk = 256;
  const int64_t R = W.is_f32() ? std::min<int64_t>(N, 4096) : tile_rows(W), nt = (N + R - 1) / R;
  std::vector<float> tmax((size_t)(nt * M)), tgt((size_t)M);
  std::vector<double> tsum((size_t)(nt * M));
  std::vector<float> y((size_t)(std::min(kRowChunk, M) * R));
  for (int64_t t = 0; t < nt; ++t) {
    const int64_t n0 = t * R, n = std::min(R, N - n0);
    const float* Wt = W.is_f32() ? W.f32_data() + n0 * K : dequantized_tile(W, n0, n);
    for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
      const int64_t mc = std::min(kRowChunk, M - m0);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)mc, (int)n, (int)K, 1.0f, x + m0 * K, (int)K, Wt,
                  (int)K, 0.0f, y.data(), (int)n);
      float* const yp = y.data();
#pragma omp parallel for schedule(static) if (mc * n > 65536)
      for (int64_t i = 0; i < mc; ++i) {
        const float* row = yp + i * n;
        const int64_t m = m0 + i;
        const float mx = max_of(row, n);
        tmax[(size_t)(t * M + m)] = mx;
        tsum[(size_t)(t * M + m)] = sum_exp(row, n, mx);
        if (targets[m] >= n0 && targets[m] < n0 + n) tgt[(size_t)m] = row[targets[m] - n0];
      }
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    float mx = -std::numeric_limits<float>::infinity();
    bool nan = false;
    for (int64_t t = 0; t < nt; ++t) {
      const float v = tmax[(size_t)(t * M + m)];
      nan = nan || std::isnan(v) || std::isnan(tsum[(size_t)(t * M + m)]);
      mx = std::max(mx, v);
    }
    double s = 0;
    for (int64_t t = 0; t < nt; ++t)
      if (tmax[(size_t)(t * M + m)] > -std::numeric_limits<float>::infinity())
        s += tsum[(size_t)(t * M + m)] * std::exp((double)tmax[(size_t)(t * M + m)] - mx);
    lp[m] = nan ? std::numeric_limits<double>::quiet_NaN() : (double)tgt[(size_t)m] - mx - std::log(s);
  }
}

}  // namespace focus::cpu
