#include "kernels/cpu/weight.h"

#include <cstring>

#include "core/error.h"

namespace focus {

void dequantize_rows(const Weight& W, int64_t r0, int64_t n, float* out) {
  FOCUS_CHECK(r0 >= 0 && n >= 0 && r0 + n <= W.rows, "dequantize_rows: rows ", r0, "..", r0 + n, " of a ", W.rows,
              "-row weight");
  if (W.is_f32()) {
    std::memcpy(out, W.f32_data() + r0 * W.cols, sizeof(float) * (size_t)(n * W.cols));
    return;
  }
  for (int64_t r = 0; r < n; ++r) io::dequantize(W.type, W.row(r0 + r), out + r * W.cols, W.cols);
}

std::vector<float> dequantize_all(const Weight& W) {
  std::vector<float> out((size_t)(W.rows * W.cols));
  dequantize_rows(W, 0, W.rows, out.data());
  return out;
}

}  // namespace focus
