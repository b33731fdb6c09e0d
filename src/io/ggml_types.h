// Tensor element types as numbered by GGUF (ggml's type ids), and exact dequantisation.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace focus::io {

enum class GGMLType : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15,
  I8 = 24, I16 = 25, I32 = 26, I64 = 27, F64 = 28, BF16 = 30,
};

// True for the types this engine can turn into floats.
bool type_supported(GGMLType t);
// Name ("Q4_K"), or "type#N" for an unknown id.
std::string type_name(GGMLType t);
// Elements per block (1 for plain types) and bytes per block; 0 if unknown.
size_t type_block_elems(GGMLType t);
size_t type_block_bytes(GGMLType t);
// Bytes of a row of n elements; throws Error if n is not a multiple of the block size.
size_t row_bytes(GGMLType t, int64_t n);

// Dequantise n elements (n a multiple of the block size) from src into dst, exactly as ggml does.
void dequantize(GGMLType t, const void* src, float* dst, int64_t n);

// Half-precision helpers (exact).
float fp16_to_fp32(uint16_t h);
uint16_t fp32_to_fp16(float f);
float bf16_to_fp32(uint16_t h);
uint16_t fp32_to_bf16(float f);  // round to nearest even; NaN stays NaN

}  // namespace focus::io
