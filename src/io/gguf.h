// GGUF v2/v3 reader: metadata, tensor table, alignment. Memory-mapped; every size and offset is
// checked against the file before use. Errors name the file and the problem.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "core/mapped_file.h"
#include "io/ggml_types.h"

namespace focus::io {

// A metadata value. Arrays hold their elements as one of the vector alternatives
// (integers of any width widen to int64 / uint64 as their sign says; bools to int64).
using GGUFValue = std::variant<int64_t, uint64_t, double, bool, std::string,
                               std::vector<int64_t>, std::vector<double>, std::vector<std::string>>;

struct GGUFTensor {
  std::string name;
  std::vector<int64_t> ne;   // ggml order: ne[0] is the contiguous (row) dimension
  GGMLType type;
  uint64_t offset;           // relative to the data section
  size_t nbytes;             // checked against the file
  const uint8_t* data;       // points into the mapping
  int64_t n_elements() const;
};

class GGUFFile {
 public:
  explicit GGUFFile(const std::string& path);  // parses and validates; throws Error

  const std::string& path() const { return file_.path(); }
  uint32_t version() const { return version_; }
  size_t alignment() const { return alignment_; }

  bool has(const std::string& key) const { return kv_.count(key) != 0; }
  const GGUFValue& get(const std::string& key) const;  // throws Error naming path and key
  const std::map<std::string, GGUFValue>& metadata() const { return kv_; }

  // Typed getters: throw Error (naming file and key) when missing or of the wrong kind.
  int64_t get_int(const std::string& key) const;
  int64_t get_int(const std::string& key, int64_t def) const;
  double get_float(const std::string& key) const;
  double get_float(const std::string& key, double def) const;
  std::string get_string(const std::string& key) const;
  std::string get_string(const std::string& key, const std::string& def) const;
  const std::vector<std::string>& get_string_array(const std::string& key) const;
  std::vector<double> get_float_array(const std::string& key) const;   // any numeric array
  std::vector<int64_t> get_int_array(const std::string& key) const;    // any integer array

  const std::vector<GGUFTensor>& tensors() const { return tensors_; }
  const GGUFTensor* find(const std::string& name) const;  // nullptr if absent
  const GGUFTensor& tensor(const std::string& name) const;  // throws Error if absent

  // Dequantised copy of a tensor as float32, row-major with ne[0] contiguous.
  std::vector<float> to_float(const GGUFTensor& t) const;

 private:
  MappedFile file_;
  uint32_t version_ = 0;
  size_t alignment_ = 32;
  std::map<std::string, GGUFValue> kv_;
  std::vector<GGUFTensor> tensors_;
  std::map<std::string, size_t> index_;
};

}  // namespace focus::io
