// io::dequantize on arbitrary bytes: the first byte picks the type (among every type id the
// engine knows, supported or not), the rest is the block data (whole blocks only, as callers pass).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fuzz/fuzz_util.h"
#include "io/ggml_types.h"

using namespace focus;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const io::GGMLType t = static_cast<io::GGMLType>(data[0] % 32);
  const uint8_t* src = data + 1;
  const size_t n_bytes = size - 1;
  fuzz::guarded([&] {
    (void)io::type_name(t);
    if (!io::type_supported(t)) return;
    const size_t be = io::type_block_elems(t), bb = io::type_block_bytes(t);
    if (be == 0 || bb == 0) return;
    const size_t blocks = n_bytes / bb;
    const int64_t n = (int64_t)(blocks * be);
    if (blocks == 0) return;
    // A copy of exactly the blocks, so any read past them is caught by AddressSanitizer.
    std::vector<uint8_t> in(src, src + blocks * bb);
    std::vector<float> out((size_t)n);
    (void)io::row_bytes(t, n);
    io::dequantize(t, in.data(), out.data(), n);
  });
  // Half-precision helpers on the first bytes.
  if (size >= 3) {
    uint16_t h;
    std::memcpy(&h, data + 1, 2);
    (void)io::fp16_to_fp32(h);
    (void)io::bf16_to_fp32(h);
    float f;
    if (size >= 5) {
      std::memcpy(&f, data + 1, 4);
      (void)io::fp32_to_fp16(f);
      (void)io::fp32_to_bf16(f);
    }
  }
  return 0;
}
