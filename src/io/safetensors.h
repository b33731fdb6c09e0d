// safetensors reader: an 8-byte little-endian header length, a JSON header naming each tensor's
// dtype, shape and byte range, then the raw data. The file is memory-mapped; every offset and
// size is checked against the file before use. Errors are focus::Error starting with the path.
//
// All dtypes of the format are recognised (so a file holding, say, an I64 buffer still loads);
// to_float converts F32, F16 and BF16 exactly and rejects the others.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/mapped_file.h"

namespace focus::io {

struct STTensor {
  std::string name;
  std::string dtype;           // as written in the header: "F32", "F16", "BF16", ...
  std::vector<int64_t> shape;  // row-major, last dimension contiguous
  const uint8_t* data;         // points into the mapping (not necessarily aligned)
  size_t nbytes;               // == n_elements() * element size, checked
  int64_t n_elements() const;
};

// Bytes per element of a safetensors dtype name; 0 when the name is not a safetensors dtype.
size_t safetensors_dtype_size(const std::string& dtype);

class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);  // parses and validates; throws Error

  const std::string& path() const { return file_.path(); }
  const std::vector<STTensor>& tensors() const { return tensors_; }  // in data-offset order
  const STTensor* find(const std::string& name) const;              // nullptr if absent
  const STTensor& tensor(const std::string& name) const;            // throws Error if absent

  // Copy of a tensor as float32 (F32 / F16 / BF16, exact); throws Error for other dtypes.
  std::vector<float> to_float(const STTensor& t) const;

  // The header's "__metadata__" object (string -> string), or an empty object.
  const nlohmann::json& metadata() const { return metadata_; }

 private:
  MappedFile file_;
  nlohmann::json metadata_ = nlohmann::json::object();
  std::vector<STTensor> tensors_;
  std::unordered_map<std::string, size_t> index_;
};

// A Hugging Face model folder: config.json plus model.safetensors, or the shards listed in
// model.safetensors.index.json ("weight_map": tensor name -> shard file).
struct SafetensorsModel {
  std::string dir;
  nlohmann::json config;
  std::vector<std::unique_ptr<SafetensorsFile>> files;

  const STTensor* find(const std::string& name) const;         // nullptr if absent
  const STTensor& tensor(const std::string& name) const;       // throws Error if absent
  const SafetensorsFile& owner(const std::string& name) const; // throws Error if absent
  std::vector<float> to_float(const std::string& name) const;  // owner(name).to_float(...)

  // tensor name -> index into files (filled by load_safetensors_dir)
  std::unordered_map<std::string, size_t> index;
};

SafetensorsModel load_safetensors_dir(const std::string& dir);

}  // namespace focus::io
