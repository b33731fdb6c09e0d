// Internal to quant_matvec*.cpp: the quantised activations as the kernels read them and the
// kernel table each instruction-set file provides. The instruction-set files are compiled with
// their own target flags, so this header holds plain data only (no inline functions that those
// files and the portable code could both instantiate).
#pragma once
#include <cstddef>
#include <cstdint>

#include "io/ggml_types.h"

namespace focus::cpu::qmv {

// Order of the int8 activations inside each group of 128 elements, as 16-element chunks taken
// from the natural order (the kernels load them as they unpack the weights' nibbles).
enum class ActLayout {
  Natural,  // 0, 16, 32, ..., 112
  Nib16,    // four 32-blocks a..d: low halves a, b, c, d then high halves (Q4_0 / Q4_1, 4 blocks a step)
  Nib16x2,  // pairs of 32-blocks: low halves a, b, high halves a, b, then the same for c, d
  Nib32,    // 32-element sub-blocks 0, 2, 1, 3 (Q4_K / Q5_K: low nibbles of two 64-chunks, then high)
};

// Per-lane copies of the block scales and sums, for kernels whose 16 float lanes per step cover
// four 32-blocks (Lanes4: lanes 4b..4b+3 belong to block b of the step) or two (Lanes8: 8b..8b+7).
// dl holds the block's d32 in each of its lanes, sl its s32 in the block's first lane and 0 in the
// others.
enum class ActLanes { None, Lanes4, Lanes8 };

// One call's activations: M rows, each padded with zeros to Kp elements (a multiple of 512).
struct Act {
  int64_t M, K, Kp;
  const int8_t* q;   // [M][Kp], in the kernel's layout
  const float* d32;  // [M][Kp / 32]: scale of each 32-block (0 in the padding)
  const float* s32;  // [M][Kp / 32]: d32 * (sum of the block's q)
  const float* d16;  // [M][Kp / 16]: the 32-block scale, once per 16 elements
  const float* s16;  // [M][Kp / 16]: d16 * (sum of the 16 q)
  const float* dl;   // [M][nl] per-lane scales (see ActLanes)
  const float* sl;   // [M][nl] per-lane sums
  int64_t nl;        // lanes per row: Kp / 8 (Lanes4) or Kp / 4 (Lanes8)
  const float* x;    // [M][K] the float activations (float kernels)
};

// The weight as the kernels see it. (These structs have no default member initialisers, so they
// have no implicit inline functions.)
struct Mat {
  io::GGMLType type;
  int64_t rows, cols;
  const uint8_t* data;
  size_t row_bytes;
};

// Computes y[m * ldy + n] for rows n in [r0, r1) and all m < a.M.
using RowsKernel = void (*)(const Mat& W, int64_t r0, int64_t r1, const Act& a, float* y, int64_t ldy);

struct Kernel {
  RowsKernel fn;
  ActLayout layout;
  bool quantised;  // reads a.q (else a.x)
  ActLanes lanes;
};

// Quantises x[K] (K a multiple of 32) to q[K] in natural order with d[K / 32] and the sums of each
// 16 q in sum16[K / 16]: d = max |x| / 127 over the 32-block, q = round-half-even(x / d) (0 when
// d = 0). Every instruction set's version gives the same bits.
using QuantizeRowFn = void (*)(const float* x, int64_t K, int8_t* q, float* d, int32_t* sum16);
void quantize_row_avx512(const float* x, int64_t K, int8_t* q, float* d, int32_t* sum16);
void quantize_row_avx2(const float* x, int64_t K, int8_t* q, float* d, int32_t* sum16);

// quant_gemm: a panel of 32 weight rows (rows beyond `rows` are zero) with w = A q + B per group
// of `group` elements (16 or 32); q is interleaved as [K / 4][32 rows][4 elements].
struct GemmPanel {
  int64_t K;
  int rows, group;
  bool has_b;
  int max_abs_q;            // the largest |q| the type holds (the AVX2 kernel's 16-bit sums depend on it)
  const int8_t* q;
  const float* A;           // [K / group][32]
  const float* B;           // [K / group][32] (read only when has_b)
  const int32_t* negcorr;   // [K / group][32]: -128 * (sum of the group's q)
};
// quant_gemm's activations: u = q + 128 (q the signed int8 values of quantize_row_*).
struct GemmAct {
  int64_t M, Kp, nb32, nb16;
  const uint8_t* u;   // [M][Kp]
  const float* d32;   // [M][nb32]: scale of each 32-block
  const float* s16;   // [M][nb16]: d32 * (sum of each 16 q)
};
// y[m * ldy + n0 + r] for m < a.M, r < p.rows.
void gemm_panel_avx512(const GemmPanel& p, const GemmAct& a, float* y, int64_t ldy, int64_t n0);
void gemm_panel_avx2(const GemmPanel& p, const GemmAct& a, float* y, int64_t ldy, int64_t n0);

// Kernels of each instruction set; fn == nullptr where the file has none for that type.
Kernel kernel_avx512(io::GGMLType t);
Kernel kernel_avx2(io::GGMLType t);

}  // namespace focus::cpu::qmv
