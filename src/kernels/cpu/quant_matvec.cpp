// quant_matvec: instruction-set dispatch, activation quantisation, threading, and the portable
// kernels (every type; used as they are on CPUs without AVX2 and for the types the vector files
// do not cover).
#include "kernels/cpu/quant_matvec.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "core/error.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/quant_matvec_impl.h"

namespace focus::cpu {

using io::GGMLType;
using namespace qmv;

namespace {

enum Isa : int { Generic = 0, Avx2 = 1, Avx512 = 2 };
const char* const kIsaNames[] = {"generic", "avx2", "avx512vnni"};

bool cpu_has(Isa isa) {
  __builtin_cpu_init();
  switch (isa) {
    case Generic: return true;
    case Avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case Avx512:
      return cpu_has(Avx2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  }
  return false;
}

Isa best_isa() { return cpu_has(Avx512) ? Avx512 : cpu_has(Avx2) ? Avx2 : Generic; }

std::atomic<int>& current_isa() {
  static std::atomic<int> isa{(int)best_isa()};
  return isa;
}

int isa_index(const std::string& name) {
  if (name == "best") return (int)best_isa();
  for (int i = 0; i < 3; ++i)
    if (name == kIsaNames[i]) return i;
  return -1;
}

// ---------------------------------------------------------------- activation quantisation

constexpr int64_t kPad = 512;  // activations are padded with zeros to a multiple of this

// 16-element chunks of each 128-element group, in the order a layout stores them.
const int* layout_chunks(ActLayout l) {
  static const int natural[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  static const int nib16[8] = {0, 2, 4, 6, 1, 3, 5, 7};
  static const int nib32[8] = {0, 1, 4, 5, 2, 3, 6, 7};
  static const int nib16x2[8] = {0, 2, 1, 3, 4, 6, 5, 7};
  switch (l) {
    case ActLayout::Natural: return natural;
    case ActLayout::Nib16: return nib16;
    case ActLayout::Nib32: return nib32;
    case ActLayout::Nib16x2: return nib16x2;
  }
  return natural;
}

struct ActBuffers {
  std::vector<int8_t> q;
  std::vector<float> d32, s32, d16, s16, dl, sl;
  std::vector<int32_t> sum16;
};

void quantize_row_generic(const float* x, int64_t K, int8_t* q, float* d, int32_t* sum16) {
  for (int64_t b = 0; b < K / 32; ++b, x += 32, q += 32) {
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float db = amax / 127.f;
    int32_t s0 = 0, s1 = 0;
    for (int i = 0; i < 32; ++i) {
      // A non-finite x (its row's scales become NaN in quantize_rows) gives 0: converting NaN or
      // an infinity to int is undefined.
      const float r = db > 0.f ? x[i] / db : 0.f;
      const int v = std::isfinite(r) ? (int)std::nearbyint(r) : 0;
      q[i] = (int8_t)v;
      (i < 16 ? s0 : s1) += v;
    }
    d[b] = db;
    sum16[2 * b] = s0;
    sum16[2 * b + 1] = s1;
  }
}

// Quantises the M rows of x[M, K] into bufs (reused across calls) and describes them in a.
void quantize_rows(const float* x, int64_t M, int64_t K, ActLayout layout, ActLanes lanes, QuantizeRowFn qrow,
                   ActBuffers& bufs, Act& a) {
  const int64_t Kp = (K + kPad - 1) / kPad * kPad, nb = Kp / 32, nbk = K / 32;
  bufs.q.resize((size_t)(M * Kp));
  bufs.d32.resize((size_t)(M * nb));
  bufs.s32.resize((size_t)(M * nb));
  bufs.d16.resize((size_t)(M * nb * 2));
  bufs.s16.resize((size_t)(M * nb * 2));
  bufs.sum16.resize((size_t)(nb * 2));
  const int* chunks = layout_chunks(layout);
  for (int64_t m = 0; m < M; ++m) {
    int8_t* qr = bufs.q.data() + m * Kp;
    float *d32 = bufs.d32.data() + m * nb, *s32 = bufs.s32.data() + m * nb;
    float *d16 = bufs.d16.data() + m * nb * 2, *s16 = bufs.s16.data() + m * nb * 2;
    const int32_t* sum16 = bufs.sum16.data();
    qrow(x + m * K, K, qr, d32, bufs.sum16.data());
    // A NaN or an infinity would round to a finite int8: NaN scales keep the row's products NaN.
    if (!all_finite(x + m * K, K)) std::fill(d32, d32 + nbk, std::numeric_limits<float>::quiet_NaN());
    std::memset(qr + K, 0, (size_t)(Kp - K));
    for (int64_t b = 0; b < nb; ++b) {
      if (b >= nbk) {
        d32[b] = s32[b] = d16[2 * b] = d16[2 * b + 1] = s16[2 * b] = s16[2 * b + 1] = 0.f;
        continue;
      }
      const float d = d32[b];
      // (In 64 bits: a non-finite row's sums are garbage from the vector conversions, its d NaN.)
      s32[b] = d * (float)((int64_t)sum16[2 * b] + sum16[2 * b + 1]);
      d16[2 * b] = d16[2 * b + 1] = d;
      s16[2 * b] = d * (float)sum16[2 * b];
      s16[2 * b + 1] = d * (float)sum16[2 * b + 1];
    }
    if (layout != ActLayout::Natural) {
      alignas(64) int8_t nat[128];
      for (int64_t g = 0; g < K; g += 128) {
        std::memcpy(nat, qr + g, 128);
        for (int c = 0; c < 8; ++c) std::memcpy(qr + g + 16 * c, nat + 16 * chunks[c], 16);
      }
    }
  }
  const int64_t per = lanes == ActLanes::Lanes4 ? 4 : 8, nl = lanes == ActLanes::None ? 0 : nb * per;
  bufs.dl.resize((size_t)(M * nl));
  bufs.sl.resize((size_t)(M * nl));
  if (nl > 0)
    for (int64_t b = 0; b < M * nb; ++b) {
      float* dl = bufs.dl.data() + b * per;
      float* sl = bufs.sl.data() + b * per;
      for (int64_t l = 0; l < per; ++l) dl[l] = bufs.d32[b], sl[l] = 0.f;
      sl[0] = bufs.s32[b];
    }
  a.dl = bufs.dl.data();
  a.sl = bufs.sl.data();
  a.nl = nl;
  a.M = M;
  a.K = K;
  a.Kp = Kp;
  a.q = bufs.q.data();
  a.d32 = bufs.d32.data();
  a.s32 = bufs.s32.data();
  a.d16 = bufs.d16.data();
  a.s16 = bufs.s16.data();
  a.x = x;
}

// ---------------------------------------------------------------- portable kernels

inline uint16_t rd16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
// Half to float: one instruction where the build targets F16C (exact either way).
inline float h2f(const uint8_t* p) {
#if defined(__F16C__)
  return _cvtsh_ss(rd16(p));
#else
  return io::fp16_to_fp32(rd16(p));
#endif
}

// One row of a quantised weight as integers: W[k] = a[k / 16] * q[k] + b[k / 16] (exactly the
// products ggml's dequantisation forms).
struct IntRow {
  std::vector<int8_t> q;
  std::vector<float> a, b;
};

void k_scale_min(int j, const uint8_t* s, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

void decode_row(GGMLType t, const uint8_t* x, int64_t K, IntRow& r) {
  r.q.resize((size_t)K);
  r.a.resize((size_t)K / 16);
  r.b.resize((size_t)K / 16);
  int8_t* q = r.q.data();
  float *A = r.a.data(), *B = r.b.data();
  const int64_t bs = (int64_t)io::type_block_bytes(t);
  switch (t) {
    case GGMLType::Q4_0:
    case GGMLType::Q4_1:
    case GGMLType::Q5_0:
    case GGMLType::Q5_1:
    case GGMLType::Q8_0:
      for (int64_t i = 0; i < K / 32; ++i, x += bs, q += 32) {
        const float d = h2f(x);
        float m = 0.f;
        if (t == GGMLType::Q4_0) {
          for (int j = 0; j < 16; ++j) q[j] = (int8_t)((x[2 + j] & 15) - 8), q[j + 16] = (int8_t)((x[2 + j] >> 4) - 8);
        } else if (t == GGMLType::Q4_1) {
          m = h2f(x + 2);
          for (int j = 0; j < 16; ++j) q[j] = (int8_t)(x[4 + j] & 15), q[j + 16] = (int8_t)(x[4 + j] >> 4);
        } else if (t == GGMLType::Q5_0 || t == GGMLType::Q5_1) {
          const int off = t == GGMLType::Q5_0 ? 2 : 4;
          if (t == GGMLType::Q5_1) m = h2f(x + 2);
          uint32_t qh;
          std::memcpy(&qh, x + off, 4);
          const uint8_t* qs = x + off + 4;
          const int sub = t == GGMLType::Q5_0 ? 16 : 0;
          for (int j = 0; j < 16; ++j) {
            q[j] = (int8_t)(((qs[j] & 15) | (((qh >> j) & 1) << 4)) - sub);
            q[j + 16] = (int8_t)(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - sub);
          }
        } else {
          std::memcpy(q, x + 2, 32);
        }
        A[2 * i] = A[2 * i + 1] = d;
        B[2 * i] = B[2 * i + 1] = m;
      }
      break;
    case GGMLType::Q2_K:
      for (int64_t i = 0; i < K / 256; ++i, x += bs) {
        const uint8_t* sc = x;
        const uint8_t* qs = x + 16;
        const float d = h2f(x + 80), dmin = h2f(x + 82);
        int is = 0;
        for (int half = 0; half < 2; ++half, qs += 32)
          for (int shift = 0; shift < 8; shift += 2)
            for (int k = 0; k < 2; ++k, ++is, q += 16) {
              *A++ = d * (float)(sc[is] & 15);
              *B++ = -(dmin * (float)(sc[is] >> 4));
              for (int l = 0; l < 16; ++l) q[l] = (int8_t)((qs[16 * k + l] >> shift) & 3);
            }
      }
      break;
    case GGMLType::Q3_K:
      for (int64_t i = 0; i < K / 256; ++i, x += bs) {
        const uint8_t* hm = x;
        const uint8_t* qs = x + 32;
        const uint8_t* s = x + 96;
        const float d = h2f(x + 108);
        int is = 0;
        uint8_t mbit = 1;
        for (int half = 0; half < 2; ++half, qs += 32)
          for (int shift = 0; shift < 8; shift += 2, mbit = (uint8_t)(mbit << 1))
            for (int k = 0; k < 2; ++k, ++is, q += 16) {
              const int lo = is < 8 ? (s[is] & 15) : (s[is - 8] >> 4);
              const int hi = (s[8 + is % 4] >> (2 * (is / 4))) & 3;
              *A++ = d * (float)((lo | (hi << 4)) - 32);
              *B++ = 0.f;
              for (int l = 0; l < 16; ++l)
                q[l] = (int8_t)(((qs[16 * k + l] >> shift) & 3) - ((hm[16 * k + l] & mbit) ? 0 : 4));
            }
      }
      break;
    case GGMLType::Q4_K:
    case GGMLType::Q5_K:
      for (int64_t i = 0; i < K / 256; ++i, x += bs) {
        const float d = h2f(x), dmin = h2f(x + 2);
        const uint8_t* s = x + 4;
        const bool five = t == GGMLType::Q5_K;
        const uint8_t* qh = x + 16;
        const uint8_t* ql = x + (five ? 48 : 16);
        for (int j = 0; j < 8; ++j, q += 32) {
          int sc, mn;
          k_scale_min(j, s, sc, mn);
          A[2 * j] = A[2 * j + 1] = d * (float)sc;
          B[2 * j] = B[2 * j + 1] = -(dmin * (float)mn);
          const uint8_t* c = ql + 32 * (j / 2);
          for (int l = 0; l < 32; ++l) {
            int v = (j & 1) ? (c[l] >> 4) : (c[l] & 15);
            if (five) v |= ((qh[l] >> j) & 1) << 4;
            q[l] = (int8_t)v;
          }
        }
        A += 16;
        B += 16;
      }
      break;
    case GGMLType::Q6_K:
      for (int64_t i = 0; i < K / 256; ++i, x += bs) {
        const uint8_t* ql = x;
        const uint8_t* qh = x + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(x + 192);
        const float d = h2f(x + 208);
        for (int half = 0; half < 2; ++half, ql += 64, qh += 32, q += 128) {
          for (int l = 0; l < 32; ++l) {
            q[l] = (int8_t)(((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32);
            q[l + 32] = (int8_t)(((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32);
            q[l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
            q[l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
          }
        }
        for (int j = 0; j < 16; ++j) *A++ = d * (float)sc[j], *B++ = 0.f;
      }
      break;
    default: fail("quant_matvec: no integer kernel for ", io::type_name(t));
  }
}

// Integer kernel for every quantised type: decode a row, then per 16 elements
// y += a * (d * sum q_w q_x) + b * (d * sum q_x).
void generic_int_rows(const Mat& W, int64_t r0, int64_t r1, const Act& a, float* y, int64_t ldy) {
  thread_local IntRow row;
  const int64_t K = W.cols, ng = K / 16, nb16p = a.Kp / 16;
  for (int64_t n = r0; n < r1; ++n) {
    decode_row(W.type, W.data + (size_t)n * W.row_bytes, K, row);
    for (int64_t m = 0; m < a.M; ++m) {
      const int8_t* xq = a.q + m * a.Kp;
      const float *d16 = a.d16 + m * nb16p, *s16 = a.s16 + m * nb16p;
      float acc = 0.f;
      for (int64_t g = 0; g < ng; ++g) {
        int32_t is = 0;
        for (int l = 0; l < 16; ++l) is += (int32_t)row.q[16 * g + l] * (int32_t)xq[16 * g + l];
        acc += row.a[g] * (d16[g] * (float)is) + row.b[g] * s16[g];
      }
      y[m * ldy + n] = acc;
    }
  }
}

// Float dot product with eight partial sums.
float dot_f32(const float* w, const float* x, int64_t K) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= K; k += 8)
    for (int j = 0; j < 8; ++j) s[j] += w[k + j] * x[k + j];
  for (int j = 0; k < K; ++k, ++j) s[j] += w[k] * x[k];
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

// Float kernel: each row converted to float32 (F16, BF16 exactly; other types dequantised), then
// dotted with the float activations.
void generic_float_rows(const Mat& W, int64_t r0, int64_t r1, const Act& a, float* y, int64_t ldy) {
  thread_local std::vector<float> buf;
  const int64_t K = W.cols;
  buf.resize((size_t)K);
  for (int64_t n = r0; n < r1; ++n) {
    const uint8_t* src = W.data + (size_t)n * W.row_bytes;
    const float* w = buf.data();
    if (W.type == GGMLType::F32) w = reinterpret_cast<const float*>(src);
    else io::dequantize(W.type, src, buf.data(), K);
    for (int64_t m = 0; m < a.M; ++m) y[m * ldy + n] = dot_f32(w, a.x + m * K, K);
  }
}

bool is_int_type(GGMLType t) {
  switch (t) {
    case GGMLType::Q4_0: case GGMLType::Q4_1: case GGMLType::Q5_0: case GGMLType::Q5_1: case GGMLType::Q8_0:
    case GGMLType::Q2_K: case GGMLType::Q3_K: case GGMLType::Q4_K: case GGMLType::Q5_K: case GGMLType::Q6_K:
      return true;
    default: return false;
  }
}

Kernel pick_kernel(GGMLType t, int isa) {
  Kernel k{nullptr, ActLayout::Natural, false, ActLanes::None};
  if (isa >= Avx512) k = kernel_avx512(t);
  if (!k.fn && isa >= Avx2) k = kernel_avx2(t);
  if (k.fn) return k;
  if (is_int_type(t)) return {generic_int_rows, ActLayout::Natural, true, ActLanes::None};
  return {generic_float_rows, ActLayout::Natural, false, ActLanes::None};
}

// ---------------------------------------------------------------- int8 GEMM (many rows of x)

// Elements per scale group of a type quant_gemm takes (0: none).
int gemm_group(GGMLType t) {
  switch (t) {
    case GGMLType::Q4_0: case GGMLType::Q4_1: case GGMLType::Q5_0: case GGMLType::Q5_1: case GGMLType::Q8_0:
    case GGMLType::Q4_K: case GGMLType::Q5_K:
      return 32;
    case GGMLType::Q2_K: case GGMLType::Q3_K: case GGMLType::Q6_K: return 16;
    default: return 0;
  }
}
bool gemm_has_b(GGMLType t) {
  return t == GGMLType::Q4_1 || t == GGMLType::Q5_1 || t == GGMLType::Q2_K || t == GGMLType::Q4_K ||
         t == GGMLType::Q5_K;
}

// The largest |q| decode_row gives a type quant_gemm takes.
int gemm_max_abs_q(GGMLType t) {
  switch (t) {
    case GGMLType::Q2_K: return 3;
    case GGMLType::Q3_K: return 4;
    case GGMLType::Q4_0: return 8;
    case GGMLType::Q4_1: case GGMLType::Q4_K: return 15;
    case GGMLType::Q5_0: return 16;
    case GGMLType::Q5_1: case GGMLType::Q5_K: return 31;
    case GGMLType::Q6_K: return 32;
    default: return 128;  // Q8_0
  }
}

constexpr int kPanelRows = 32;

struct PanelBuf {
  std::vector<int8_t> q;
  std::vector<float> A, B;
  std::vector<int32_t> negcorr;
  IntRow row;
};

// Rows [n0, n0 + rows) of W decoded to integers and interleaved as the panel kernels read them.
void pack_panel(const Weight& W, int64_t n0, int rows, PanelBuf& pb, GemmPanel& p) {
  const int64_t K = W.cols;
  const int group = gemm_group(W.type);
  const int64_t ng = K / group;
  // Every entry of the rows present is written below; only a partial panel's missing rows need zeros.
  if (rows < kPanelRows) {
    pb.q.assign((size_t)(K * kPanelRows), 0);
    pb.A.assign((size_t)(ng * kPanelRows), 0.f);
    pb.B.assign((size_t)(ng * kPanelRows), 0.f);
    pb.negcorr.assign((size_t)(ng * kPanelRows), 0);
  } else {
    pb.q.resize((size_t)(K * kPanelRows));
    pb.A.resize((size_t)(ng * kPanelRows));
    pb.B.resize((size_t)(ng * kPanelRows));
    pb.negcorr.resize((size_t)(ng * kPanelRows));
  }
  for (int r = 0; r < rows; ++r) {
    decode_row(W.type, W.row(n0 + r), K, pb.row);
    const int8_t* q = pb.row.q.data();
    int8_t* dst = pb.q.data() + 4 * r;
    for (int64_t k = 0; k < K; k += 4, dst += 4 * kPanelRows) std::memcpy(dst, q + k, 4);
    for (int64_t g = 0; g < ng; ++g) {
      int32_t sum = 0;
      for (int i = 0; i < group; ++i) sum += q[g * group + i];
      pb.negcorr[(size_t)(g * kPanelRows + r)] = -128 * sum;
      pb.A[(size_t)(g * kPanelRows + r)] = pb.row.a[(size_t)(g * group / 16)];
      pb.B[(size_t)(g * kPanelRows + r)] = pb.row.b[(size_t)(g * group / 16)];
    }
  }
  p.K = K;
  p.rows = rows;
  p.group = group;
  p.has_b = gemm_has_b(W.type);
  p.max_abs_q = gemm_max_abs_q(W.type);
  p.q = pb.q.data();
  p.A = pb.A.data();
  p.B = pb.B.data();
  p.negcorr = pb.negcorr.data();
}

}  // namespace

void quantize_activation_scales(const float* x, int64_t K, float* d) {
  FOCUS_CHECK(K % kQuantActBlock == 0, "quantize_activation_scales: ", K, " is not a multiple of ", kQuantActBlock);
  for (int64_t b = 0; b < K / kQuantActBlock; ++b) {
    float amax = 0.f;
    for (int64_t i = 0; i < kQuantActBlock; ++i) amax = std::max(amax, std::fabs(x[b * kQuantActBlock + i]));
    d[b] = amax / 127.f;
  }
}

const char* quant_isa() { return kIsaNames[current_isa().load()]; }

bool quant_isa_supported(const std::string& name) {
  const int i = isa_index(name);
  return i >= 0 && cpu_has((Isa)i);
}

bool set_quant_isa(const std::string& name) {
  if (!quant_isa_supported(name)) return false;
  current_isa() = isa_index(name);
  return true;
}

bool quant_gemm_supported(const Weight& W) {
  return current_isa().load() >= Avx2 && gemm_group(W.type) > 0 && W.cols > 0 && W.cols % 32 == 0;
}

namespace {

// The integer GEMM's activations of x [M, K] in the calling thread's buffers (valid until its next
// call): int8 per 32 (the decoding kernels' quantisation) stored as q + 128, with the scales and
// the scaled sums of each 16. Rounding to int8 would turn a NaN or infinite input into a finite
// number: such a row gets NaN scales, so its products are NaN as in float arithmetic.
GemmAct quantize_gemm_acts(const float* x, int64_t M, int64_t K, bool par) {
  const QuantizeRowFn qrow = current_isa().load() == Avx512 ? quantize_row_avx512 : quantize_row_avx2;
  thread_local std::vector<uint8_t> ubuf;
  thread_local std::vector<float> dbuf, sbuf;
  ubuf.resize((size_t)(M * K));
  dbuf.resize((size_t)(M * K / 32));
  sbuf.resize((size_t)(M * K / 16));
  // Plain pointers inside the parallel region: each thread has its own thread_local objects.
  uint8_t* const u = ubuf.data();
  float *const d32 = dbuf.data(), *const s16 = sbuf.data();
#pragma omp parallel for schedule(static) if (par && M * K > 65536)
  for (int64_t m = 0; m < M; ++m) {
    thread_local std::vector<int32_t> sum16;
    sum16.resize((size_t)(K / 16));
    uint8_t* um = u + m * K;
    float* dm = d32 + m * (K / 32);
    qrow(x + m * K, K, reinterpret_cast<int8_t*>(um), dm, sum16.data());
    if (!all_finite(x + m * K, K)) std::fill(dm, dm + K / 32, std::numeric_limits<float>::quiet_NaN());
    for (int64_t k = 0; k < K; ++k) um[k] ^= 0x80;  // q + 128
    for (int64_t b = 0; b < K / 16; ++b) s16[m * (K / 16) + b] = dm[b / 2] * (float)sum16[(size_t)b];
  }
  return GemmAct{M, K, K / 32, K / 16, u, d32, s16};
}

// The panel kernel of the instruction set in use (quant_gemm_supported: AVX2 or AVX-512 VNNI).
using GemmPanelFn = void (*)(const GemmPanel& p, const GemmAct& a, float* y, int64_t ldy, int64_t n0);
GemmPanelFn gemm_panel_kernel() { return current_isa().load() == Avx512 ? gemm_panel_avx512 : gemm_panel_avx2; }

// The rows m0 .. m0 + n - 1 of a.
GemmAct act_rows(const GemmAct& a, int64_t m0, int64_t n) {
  return GemmAct{n, a.Kp, a.nb32, a.nb16, a.u + m0 * a.Kp, a.d32 + m0 * a.nb32, a.s16 + m0 * a.nb16};
}

}  // namespace

void quant_gemm(const float* x, const Weight& W, float* y, int64_t M) {
  FOCUS_CHECK(quant_gemm_supported(W), "quant_gemm: no integer GEMM for a ", io::type_name(W.type), " weight of ",
              W.cols, " columns on this CPU (", quant_isa(), ")");
  FOCUS_CHECK(M >= 0 && W.rows >= 0, "quant_gemm: bad shape");
  if (M == 0 || W.rows == 0) return;
  const int64_t K = W.cols, N = W.rows;
  const bool par = omp_get_max_threads() > 1 && !omp_in_parallel();
  const GemmAct a = quantize_gemm_acts(x, M, K, par);
  const GemmPanelFn gemm_panel = gemm_panel_kernel();
  const int64_t np = (N + kPanelRows - 1) / kPanelRows;
#pragma omp parallel for schedule(dynamic, 1) if (par && np > 1)
  for (int64_t i = 0; i < np; ++i) {
    thread_local PanelBuf pb;
    GemmPanel p{};
    const int64_t n0 = i * kPanelRows;
    pack_panel(W, n0, (int)std::min<int64_t>(kPanelRows, N - n0), pb, p);
    gemm_panel(p, a, y, N, n0);
  }
}

void quant_gemm_log_softmax(const float* x, const Weight& W, int64_t M, const int32_t* targets, double* lp) {
  FOCUS_CHECK(quant_gemm_supported(W), "quant_gemm_log_softmax: no integer GEMM for a ", io::type_name(W.type),
              " weight of ", W.cols, " columns on this CPU (", quant_isa(), ")");
  FOCUS_CHECK(M >= 0 && W.rows >= 1, "quant_gemm_log_softmax: bad shape");
  const int64_t K = W.cols, N = W.rows;
  for (int64_t m = 0; m < M; ++m)
    FOCUS_CHECK(targets[m] >= 0 && targets[m] < N, "quant_gemm_log_softmax: target ", targets[m], " of row ", m,
                " outside [0, ", N, ")");
  if (M == 0) return;
  const bool par = omp_get_max_threads() > 1 && !omp_in_parallel();
  const GemmAct a = quantize_gemm_acts(x, M, K, par);
  const GemmPanelFn gemm_panel = gemm_panel_kernel();
  // Blocks of kBlockPanels panels (2048 output rows); each is decoded once and multiplied by every
  // row, kRowChunk rows at a time (their logits stay in a thread's buffer). Per (block, row): the
  // block's largest logit and the sum of exp(logit - that), merged over the blocks in order at the
  // end, so the result does not depend on which thread did which block.
  constexpr int64_t kBlockPanels = 64, kRowChunk = 48, kBlockCols = kBlockPanels * kPanelRows;
  const int64_t np = (N + kPanelRows - 1) / kPanelRows, nblk = (np + kBlockPanels - 1) / kBlockPanels;
  std::vector<float> bmax((size_t)(nblk * M));
  std::vector<double> bsum((size_t)(nblk * M));
  std::vector<float> tgt((size_t)M);
  float* const bmax_p = bmax.data();
  double* const bsum_p = bsum.data();
  float* const tgt_p = tgt.data();
#pragma omp parallel if (par && nblk > 1)
  {
    std::vector<PanelBuf> pbs(kBlockPanels);
    std::vector<GemmPanel> ps(kBlockPanels);
    std::vector<float> y((size_t)(kRowChunk * kBlockCols));
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < nblk; ++b) {
      const int64_t p0 = b * kBlockPanels, pn = std::min(kBlockPanels, np - p0);
      const int64_t c0 = p0 * kPanelRows, width = std::min(N - c0, pn * kPanelRows);
      for (int64_t i = 0; i < pn; ++i) {
        const int64_t n0 = c0 + i * kPanelRows;
        pack_panel(W, n0, (int)std::min<int64_t>(kPanelRows, N - n0), pbs[(size_t)i], ps[(size_t)i]);
      }
      for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
        const int64_t mr = std::min(kRowChunk, M - m0);
        const GemmAct am = act_rows(a, m0, mr);
        for (int64_t i = 0; i < pn; ++i) gemm_panel(ps[(size_t)i], am, y.data(), kBlockCols, i * kPanelRows);
        for (int64_t r = 0; r < mr; ++r) {
          const float* row = y.data() + r * kBlockCols;
          const int64_t m = m0 + r;
          const float mx = max_of(row, width);
          bmax_p[b * M + m] = mx;
          bsum_p[b * M + m] = sum_exp(row, width, mx);
          if (targets[m] >= c0 && targets[m] < c0 + width) tgt_p[m] = row[targets[m] - c0];
        }
      }
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    float mx = -std::numeric_limits<float>::infinity();
    bool nan = false;
    for (int64_t b = 0; b < nblk; ++b) {
      mx = std::max(mx, bmax[(size_t)(b * M + m)]);
      nan = nan || std::isnan(bsum[(size_t)(b * M + m)]);
    }
    double s = nan ? std::numeric_limits<double>::quiet_NaN() : 0.0;
    for (int64_t b = 0; b < nblk && !nan; ++b) {
      const float bm = bmax[(size_t)(b * M + m)];
      if (bm != -std::numeric_limits<float>::infinity()) s += bsum[(size_t)(b * M + m)] * std::exp((double)bm - mx);
    }
    lp[m] = (double)tgt[(size_t)m] - mx - std::log(s);
  }
}

void quant_matvec(const float* x, const Weight& W, float* y, int64_t M) {
  const MatvecOut out{&W, y};
  quant_matvec_multi(x, &out, 1, M);
}

void quant_matvec_multi(const float* x, const MatvecOut* outs, int n, int64_t M) {
  FOCUS_CHECK(n >= 1 && M >= 0, "quant_matvec: bad shape");
  const int64_t K = outs[0].W->cols;
  for (int i = 0; i < n; ++i) {
    const Weight& W = *outs[i].W;
    FOCUS_CHECK(io::type_supported(W.type), "quant_matvec: unsupported weight type ", io::type_name(W.type));
    FOCUS_CHECK(W.rows >= 0 && W.cols == K, "quant_matvec: bad shape (weight ", i, " has ", W.cols,
                " columns, the first ", K, ")");
  }
  if (M == 0) return;
  if (K == 0) {
    for (int i = 0; i < n; ++i) std::fill(outs[i].y, outs[i].y + M * outs[i].W->rows, 0.f);
    return;
  }
  const int isa = current_isa().load();
  const QuantizeRowFn qrow = isa == Avx512 ? quantize_row_avx512 : isa == Avx2 ? quantize_row_avx2 : quantize_row_generic;
  // One product per weight; x is quantised once for each activation layout the kernels ask for.
  struct Job {
    Kernel k;
    Mat mat;
    int act;  // index into acts
    float* y;
  };
  thread_local std::vector<ActBuffers> bufs;
  thread_local std::vector<Act> acts;
  thread_local std::vector<Job> jobs;
  if ((int)bufs.size() < n) bufs.resize((size_t)n);
  acts.clear();
  jobs.clear();
  for (int i = 0; i < n; ++i) {
    const Weight& W = *outs[i].W;
    const Kernel k = pick_kernel(W.type, isa);
    int ai = -1;
    for (int j = 0; j < i && ai < 0; ++j) {
      const Kernel& kj = jobs[(size_t)j].k;
      if (kj.quantised == k.quantised && (!k.quantised || (kj.layout == k.layout && kj.lanes == k.lanes)))
        ai = jobs[(size_t)j].act;
    }
    if (ai < 0) {
      Act a{};
      if (k.quantised) {
        quantize_rows(x, M, K, k.layout, k.lanes, qrow, bufs[acts.size()], a);
      } else {
        a.M = M;
        a.K = a.Kp = K;
        a.x = x;
      }
      ai = (int)acts.size();
      acts.push_back(a);
    }
    jobs.push_back({k, Mat{W.type, W.rows, W.cols, static_cast<const uint8_t*>(W.data), W.row_bytes()}, ai, outs[i].y});
  }
  // Rows are shared out in chunks of kChunk, the chunks of all the products in one list split
  // into one contiguous run per thread of about equal bytes. Small products stay on the calling
  // thread, where starting the team would cost more than it saves.
  constexpr int64_t kChunk = 16;
  const double per_row_m = (double)(1 + (M - 1) / 4);
  double work = 0;
  int64_t n_chunks = 0;
  for (const Job& j : jobs) {
    work += (double)j.mat.row_bytes * (double)j.mat.rows * per_row_m;
    n_chunks += (j.mat.rows + kChunk - 1) / kChunk;
  }
  const Job* const jp = jobs.data();
  const Act* const ap = acts.data();
  const bool parallel = n_chunks > 1 && work >= 96.0 * 1024 && omp_get_max_threads() > 1 && !omp_in_parallel();
  if (!parallel) {
    for (int i = 0; i < n; ++i) jp[i].k.fn(jp[i].mat, 0, jp[i].mat.rows, ap[jp[i].act], jp[i].y, jp[i].mat.rows);
    return;
  }
#pragma omp parallel
  {
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    const double lo = work * t / nt, hi = work * (t + 1) / nt;
    // A chunk belongs to the thread whose share holds the chunk's first byte.
    double at = 0;
    for (int i = 0; i < n; ++i) {
      const Job& j = jp[i];
      const double row_cost = (double)j.mat.row_bytes * per_row_m;
      int64_t r0 = -1, r1 = -1;  // this thread's rows of this product
      for (int64_t c = 0; c < j.mat.rows; c += kChunk) {
        const double start = at + row_cost * (double)c;
        if (start >= lo && (start < hi || t == nt - 1)) {
          if (r0 < 0) r0 = c;
          r1 = std::min(j.mat.rows, c + kChunk);
        }
      }
      if (r0 >= 0) j.k.fn(j.mat, r0, r1, ap[j.act], j.y, j.mat.rows);
      at += row_cost * (double)j.mat.rows;
    }
  }
}

}  // namespace focus::cpu
