// Writes F32 tensors as a safetensors file, atomically (temporary file, fsync, rename), so a
// reader never sees a half-written file and an interrupted write leaves the old one intact.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace focus::io {

struct F32Tensor {
  std::vector<int64_t> shape;
  std::vector<float> data;
};

void save_safetensors(const std::string& path, const std::map<std::string, F32Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// Writes bytes to path atomically (path.tmp, fsync, rename).
void write_file_atomic(const std::string& path, const std::string& bytes);

}  // namespace focus::io
