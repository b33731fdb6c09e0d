#include "io/safetensors.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>

#include "core/error.h"

namespace focus::io {

namespace {

using json = nlohmann::json;

// IEEE binary16 -> binary32; every half value (subnormals, infinities, NaN payloads) is exact.
float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: mant * 2^-24, normalise into a binary32 normal number
      uint32_t m = mant;
      int e = -14;
      while ((m & 0x400u) == 0) {
        m <<= 1;
        --e;
      }
      bits = sign | (static_cast<uint32_t>(e + 127) << 23) | ((m & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // infinity or NaN (payload kept)
  } else {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// bfloat16 is the upper half of a binary32.
float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint64_t read_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

uint16_t read_le16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

// A JSON value as a non-negative int64, or fail naming what it is.
int64_t nonneg_int(const std::string& path, const std::string& what, const json& v) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      fail(path, ": ", what, " is too large: ", u);
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) {
    const int64_t i = v.get<int64_t>();
    if (i < 0) fail(path, ": ", what, " is negative: ", i);
    return i;
  }
  fail(path, ": ", what, " is not an integer: ", v.dump());
}

}  // namespace

size_t safetensors_dtype_size(const std::string& d) {
  static const std::map<std::string, size_t> sizes = {
      {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"F8_E4M3", 1}, {"F8_E5M2", 1},
      {"I64", 8}, {"I32", 4}, {"I16", 2}, {"I8", 1},   {"U64", 8},     {"U32", 4},
      {"U16", 2}, {"U8", 1},  {"BOOL", 1}};
  auto it = sizes.find(d);
  return it == sizes.end() ? 0 : it->second;
}

int64_t STTensor::n_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // validated at load: no overflow
  return n;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : file_(path) {
  const uint8_t* base = file_.data();
  const size_t size = file_.size();
  if (size < 8)
    fail(path, ": truncated safetensors file: ", size, " bytes, need at least 8 for the header length");
  const uint64_t header_len = read_le64(base);
  if (header_len > size - 8)
    fail(path, ": safetensors header length ", header_len, " exceeds the file (", size - 8,
         " bytes after the length field)");
  const uint8_t* data = base + 8 + header_len;
  const uint64_t data_size = size - 8 - header_len;

  json header;
  try {
    header = json::parse(base + 8, base + 8 + header_len);
  } catch (const json::exception& e) {
    fail(path, ": safetensors header is not valid JSON: ", e.what());
  }
  if (!header.is_object()) fail(path, ": safetensors header is not a JSON object");

  struct Range {
    uint64_t begin, end;
    size_t tensor;
  };
  std::vector<Range> ranges;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) fail(path, ": __metadata__ is not a JSON object");
      for (auto m = v.begin(); m != v.end(); ++m)
        if (!m.value().is_string())
          fail(path, ": __metadata__ entry '", m.key(), "' is not a string");
      metadata_ = v;
      continue;
    }
    const std::string where = "tensor '" + name + "'";
    if (!v.is_object()) fail(path, ": ", where, ": entry is not a JSON object");
    if (!v.contains("dtype") || !v["dtype"].is_string())
      fail(path, ": ", where, ": missing or non-string 'dtype'");
    if (!v.contains("shape") || !v["shape"].is_array())
      fail(path, ": ", where, ": missing or non-array 'shape'");
    if (!v.contains("data_offsets") || !v["data_offsets"].is_array() || v["data_offsets"].size() != 2)
      fail(path, ": ", where, ": 'data_offsets' must be an array [begin, end]");

    STTensor t;
    t.name = name;
    t.dtype = v["dtype"].get<std::string>();
    const size_t esize = safetensors_dtype_size(t.dtype);
    if (esize == 0) fail(path, ": ", where, ": unknown dtype '", t.dtype, "'");

    uint64_t n = 1;
    for (const json& d : v["shape"]) {
      const int64_t dim = nonneg_int(path, where + " dimension", d);
      t.shape.push_back(dim);
      if (__builtin_mul_overflow(n, static_cast<uint64_t>(dim), &n))
        fail(path, ": ", where, ": shape element count overflows");
    }
    uint64_t expect = 0;
    if (n > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
        __builtin_mul_overflow(n, static_cast<uint64_t>(esize), &expect))
      fail(path, ": ", where, ": shape byte size overflows");

    const uint64_t begin = static_cast<uint64_t>(nonneg_int(path, where + " data_offsets[0]", v["data_offsets"][0]));
    const uint64_t end = static_cast<uint64_t>(nonneg_int(path, where + " data_offsets[1]", v["data_offsets"][1]));
    if (begin > end) fail(path, ": ", where, ": data_offsets begin ", begin, " > end ", end);
    if (end > data_size)
      fail(path, ": ", where, ": data_offsets [", begin, ", ", end, "] past the end of the data section (",
           data_size, " bytes)");
    if (end - begin != expect)
      fail(path, ": ", where, ": data_offsets span ", end - begin, " bytes but dtype ", t.dtype, " and shape ",
           shape_str(t.shape), " need ", expect);
    t.data = data + begin;
    t.nbytes = static_cast<size_t>(expect);
    ranges.push_back({begin, end, tensors_.size()});
    tensors_.push_back(std::move(t));
  }

  // Order tensors by position in the file and reject overlapping byte ranges.
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  for (size_t i = 1; i < ranges.size(); ++i)
    if (ranges[i].begin < ranges[i - 1].end)
      fail(path, ": tensors '", tensors_[ranges[i - 1].tensor].name, "' and '", tensors_[ranges[i].tensor].name,
           "' overlap in the data section");
  std::vector<STTensor> ordered;
  ordered.reserve(tensors_.size());
  for (const Range& r : ranges) ordered.push_back(std::move(tensors_[r.tensor]));
  tensors_ = std::move(ordered);
  for (size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
}

const STTensor* SafetensorsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const STTensor& SafetensorsFile::tensor(const std::string& name) const {
  const STTensor* t = find(name);
  if (!t) fail(path(), ": no tensor named '", name, "'");
  return *t;
}

std::vector<float> SafetensorsFile::to_float(const STTensor& t) const {
  const size_t n = static_cast<size_t>(t.n_elements());
  std::vector<float> out(n);
  const uint8_t* p = t.data;
  if (t.dtype == "F32") {
    if (n) std::memcpy(out.data(), p, n * 4);  // safetensors is little-endian, as is the host
  } else if (t.dtype == "F16") {
    for (size_t i = 0; i < n; ++i) out[i] = half_to_float(read_le16(p + 2 * i));
  } else if (t.dtype == "BF16") {
    for (size_t i = 0; i < n; ++i) out[i] = bf16_to_float(read_le16(p + 2 * i));
  } else {
    fail(path(), ": tensor '", t.name, "': dtype ", t.dtype, " cannot be converted to float (F32, F16, BF16 only)");
  }
  return out;
}

const STTensor* SafetensorsModel::find(const std::string& name) const {
  auto it = index.find(name);
  return it == index.end() ? nullptr : files[it->second]->find(name);
}

const STTensor& SafetensorsModel::tensor(const std::string& name) const {
  const STTensor* t = find(name);
  if (!t) fail(dir, ": no tensor named '", name, "' in the model");
  return *t;
}

const SafetensorsFile& SafetensorsModel::owner(const std::string& name) const {
  auto it = index.find(name);
  if (it == index.end()) fail(dir, ": no tensor named '", name, "' in the model");
  return *files[it->second];
}

std::vector<float> SafetensorsModel::to_float(const std::string& name) const {
  return owner(name).to_float(tensor(name));
}

SafetensorsModel load_safetensors_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  SafetensorsModel m;
  m.dir = dir;
  if (!fs::is_directory(dir)) fail(dir, ": not a directory (expected a model folder with config.json)");

  const std::string config_path = (fs::path(dir) / "config.json").string();
  if (!fs::exists(config_path)) fail(config_path, ": missing (a safetensors model folder needs config.json)");
  try {
    m.config = json::parse(read_file(config_path));
  } catch (const json::exception& e) {
    fail(config_path, ": not valid JSON: ", e.what());
  }
  if (!m.config.is_object()) fail(config_path, ": not a JSON object");

  auto add_file = [&](const std::string& p) -> size_t {
    m.files.push_back(std::make_unique<SafetensorsFile>(p));
    return m.files.size() - 1;
  };

  const std::string single = (fs::path(dir) / "model.safetensors").string();
  const std::string index_path = (fs::path(dir) / "model.safetensors.index.json").string();
  if (fs::exists(index_path)) {
    json idx;
    try {
      idx = json::parse(read_file(index_path));
    } catch (const json::exception& e) {
      fail(index_path, ": not valid JSON: ", e.what());
    }
    if (!idx.is_object() || !idx.contains("weight_map") || !idx["weight_map"].is_object())
      fail(index_path, ": missing 'weight_map' object");
    std::map<std::string, size_t> shard_index;  // shard file name -> index into files
    for (auto it = idx["weight_map"].begin(); it != idx["weight_map"].end(); ++it) {
      if (!it.value().is_string()) fail(index_path, ": weight_map entry '", it.key(), "' is not a string");
      const std::string shard = it.value().get<std::string>();
      if (shard.empty() || shard.find('/') != std::string::npos || shard == "." || shard == "..")
        fail(index_path, ": weight_map entry '", it.key(), "' names an invalid shard file '", shard, "'");
      auto s = shard_index.find(shard);
      if (s == shard_index.end()) s = shard_index.emplace(shard, add_file((fs::path(dir) / shard).string())).first;
      if (!m.files[s->second]->find(it.key()))
        fail(index_path, ": tensor '", it.key(), "' is listed in shard ", shard, " but ", m.files[s->second]->path(),
             " does not contain it");
      m.index.emplace(it.key(), s->second);
    }
    // Tensors present in a shard but missing from the weight map are still reachable.
    for (size_t f = 0; f < m.files.size(); ++f)
      for (const STTensor& t : m.files[f]->tensors()) {
        auto [pos, inserted] = m.index.emplace(t.name, f);
        if (!inserted && pos->second != f)
          fail(m.files[f]->path(), ": tensor '", t.name, "' also appears in ", m.files[pos->second]->path());
      }
  } else if (fs::exists(single)) {
    const size_t f = add_file(single);
    for (const STTensor& t : m.files[f]->tensors()) m.index.emplace(t.name, f);
  } else {
    fail(dir, ": no model.safetensors or model.safetensors.index.json found");
  }
  return m;
}

}  // namespace focus::io
