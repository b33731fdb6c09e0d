// A weight matrix as the linear layers take it: its element type (any GGML type the engine reads:
// F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, ...), its shape and its bytes, which may live
// in a memory-mapped model file. Rows are stored one after another, each row_bytes() long, in the
// type's block layout (GGUF / ggml), so quantised files are used as they are on disk.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "io/ggml_types.h"

namespace focus {

struct Weight {
  io::GGMLType type = io::GGMLType::F32;
  int64_t rows = 0, cols = 0;  // [out, in] like a Linear layer
  const void* data = nullptr;

  static Weight f32(const float* p, int64_t rows, int64_t cols) { return {io::GGMLType::F32, rows, cols, p}; }
  explicit operator bool() const { return data != nullptr; }
  bool is_f32() const { return type == io::GGMLType::F32; }
  // The float32 data of an F32 weight; nullptr for any other type.
  const float* f32_data() const { return is_f32() ? static_cast<const float*>(data) : nullptr; }
  size_t row_bytes() const { return io::row_bytes(type, cols); }
  size_t bytes() const { return row_bytes() * (size_t)rows; }
  const uint8_t* row(int64_t r) const { return static_cast<const uint8_t*>(data) + (size_t)r * row_bytes(); }
};

// Rows [r0, r0 + n) of W as float32 into out[n, cols] (exact: ggml's dequantisation).
void dequantize_rows(const Weight& W, int64_t r0, int64_t n, float* out);
// The whole matrix as float32.
std::vector<float> dequantize_all(const Weight& W);

}  // namespace focus
