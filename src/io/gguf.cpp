// GGUF reader. Layout (all little-endian):
//   "GGUF" u32 version, u64 tensor_count, u64 kv_count,
//   kv_count x { string key, u32 value_type, value },
//   tensor_count x { string name, u32 n_dims, u64 ne[n_dims], u32 type, u64 offset },
//   padding to `general.alignment` (default 32), then the tensor data.
// A string is a u64 length followed by that many bytes; an array is u32 element type, u64 count,
// then the elements. Every read is checked against the file size first.
#include "io/gguf.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>

#include "core/error.h"

namespace focus::io {

namespace {

// Metadata value types.
enum ValueType : uint32_t {
  UINT8 = 0, INT8 = 1, UINT16 = 2, INT16 = 3, UINT32 = 4, INT32 = 5, FLOAT32 = 6, BOOL = 7,
  STRING = 8, ARRAY = 9, UINT64 = 10, INT64 = 11, FLOAT64 = 12,
};

// Encoded size of a scalar value type; 0 for strings, arrays and unknown types.
size_t scalar_size(uint32_t t) {
  switch (t) {
    case UINT8: case INT8: case BOOL: return 1;
    case UINT16: case INT16: return 2;
    case UINT32: case INT32: case FLOAT32: return 4;
    case UINT64: case INT64: case FLOAT64: return 8;
    default: return 0;
  }
}

// Smallest encoding of one value of type t (a string is at least its length field).
size_t min_value_size(uint32_t t) {
  if (t == STRING) return 8;
  if (t == ARRAY) return 12;
  return scalar_size(t);
}

constexpr size_t kMaxDims = 4;
constexpr uint64_t kDefaultAlignment = 32;

// Bounds-checked cursor over the mapped file. `where` describes what is being parsed, for errors.
class Reader {
 public:
  Reader(const std::string& path, const uint8_t* data, size_t size) : path_(path), data_(data), size_(size) {}

  size_t pos() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }

  // Pointer to the next n bytes, advancing past them.
  const uint8_t* take(uint64_t n, const char* what, const std::string& where) {
    if (n > remaining())
      fail(path_, ": truncated file: ", what, " of ", where, " needs ", n, " bytes at offset ", pos_,
           " but the file has ", size_, " bytes");
    const uint8_t* p = data_ + pos_;
    pos_ += (size_t)n;
    return p;
  }

  template <typename T>
  T get(const char* what, const std::string& where) {
    T v;
    std::memcpy(&v, take(sizeof(T), what, where), sizeof(T));
    return v;
  }

  std::string str(const char* what, const std::string& where) {
    const uint64_t len = get<uint64_t>(what, where);
    if (len > remaining())
      fail(path_, ": ", what, " of ", where, " has string length ", len, " at offset ", pos_ - 8,
           ", more than the ", remaining(), " bytes left in the file (truncated or corrupt file)");
    const uint8_t* p = take(len, what, where);
    return std::string(reinterpret_cast<const char*>(p), (size_t)len);
  }

  // Fails unless `count` items of at least `min_size` bytes each can fit in the rest of the file.
  void check_count(uint64_t count, size_t min_size, const char* what, const std::string& where) {
    if (min_size && count > remaining() / min_size)
      fail(path_, ": ", what, " ", count, " of ", where, " is impossible: ", count, " entries of at least ",
           min_size, " bytes cannot fit in the ", remaining(), " bytes left in the file");
  }

 private:
  const std::string& path_;
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

std::string quoted_key(const std::string& key) { return "key '" + key + "'"; }

// One scalar of type t (known to be a scalar type), as the variant alternative it widens to.
GGUFValue read_scalar(Reader& r, uint32_t t, const std::string& where) {
  switch (t) {
    case UINT8: return (uint64_t)r.get<uint8_t>("value", where);
    case INT8: return (int64_t)r.get<int8_t>("value", where);
    case UINT16: return (uint64_t)r.get<uint16_t>("value", where);
    case INT16: return (int64_t)r.get<int16_t>("value", where);
    case UINT32: return (uint64_t)r.get<uint32_t>("value", where);
    case INT32: return (int64_t)r.get<int32_t>("value", where);
    case UINT64: return r.get<uint64_t>("value", where);
    case INT64: return r.get<int64_t>("value", where);
    case FLOAT32: return (double)r.get<float>("value", where);
    case FLOAT64: return r.get<double>("value", where);
    case BOOL: return r.get<uint8_t>("value", where) != 0;
    default: return int64_t{0};  // unreachable: callers check the type
  }
}

// Integer array elements, widened to int64 (uint64 values keep their bit pattern).
std::vector<int64_t> read_int_array(Reader& r, uint32_t t, uint64_t n, const std::string& where) {
  std::vector<int64_t> out((size_t)n);
  const size_t sz = scalar_size(t);
  const uint8_t* p = r.take(n * sz, "array data", where);  // n * sz <= remaining, checked by caller
  for (size_t i = 0; i < out.size(); ++i, p += sz) {
    switch (t) {
      case UINT8: out[i] = p[0]; break;
      case INT8: out[i] = (int8_t)p[0]; break;
      case BOOL: out[i] = p[0] != 0; break;
      case UINT16: { uint16_t v; std::memcpy(&v, p, 2); out[i] = v; break; }
      case INT16: { int16_t v; std::memcpy(&v, p, 2); out[i] = v; break; }
      case UINT32: { uint32_t v; std::memcpy(&v, p, 4); out[i] = v; break; }
      case INT32: { int32_t v; std::memcpy(&v, p, 4); out[i] = v; break; }
      case UINT64: { uint64_t v; std::memcpy(&v, p, 8); out[i] = (int64_t)v; break; }
      case INT64: { int64_t v; std::memcpy(&v, p, 8); out[i] = v; break; }
    }
  }
  return out;
}

GGUFValue read_value(Reader& r, const std::string& path, uint32_t t, const std::string& where) {
  if (t == STRING) return r.str("string value", where);
  if (t == ARRAY) {
    const uint32_t et = r.get<uint32_t>("array element type", where);
    const uint64_t n = r.get<uint64_t>("array count", where);
    if (et == ARRAY) fail(path, ": nested arrays (arrays of arrays) are not supported, in ", where);
    const size_t min_size = min_value_size(et);
    if (min_size == 0) fail(path, ": unknown array element type ", et, " in ", where);
    r.check_count(n, min_size, "array count", where);
    if (et == STRING) {
      std::vector<std::string> v;
      v.reserve((size_t)std::min<uint64_t>(n, 1u << 20));  // n is bounded by the file, but may be garbage
      for (uint64_t i = 0; i < n; ++i) v.push_back(r.str("array string", where));
      return v;
    }
    if (et == FLOAT32 || et == FLOAT64) {
      std::vector<double> v((size_t)n);
      const uint8_t* p = r.take(n * min_size, "array data", where);
      for (size_t i = 0; i < v.size(); ++i) {
        if (et == FLOAT32) {
          float f;
          std::memcpy(&f, p + 4 * i, 4);
          v[i] = f;
        } else {
          std::memcpy(&v[i], p + 8 * i, 8);
        }
      }
      return v;
    }
    return read_int_array(r, et, n, where);
  }
  if (scalar_size(t) == 0) fail(path, ": unknown metadata value type ", t, " for ", where);
  return read_scalar(r, t, where);
}

// Human name of the value's kind, for "wrong kind" errors.
const char* kind_name(const GGUFValue& v) {
  static const char* names[] = {"an integer", "an unsigned integer", "a float", "a bool",
                                "a string", "an integer array", "a float array", "a string array"};
  return names[v.index()];
}

bool mul_overflows(uint64_t a, uint64_t b, uint64_t& out) { return __builtin_mul_overflow(a, b, &out); }
bool add_overflows(uint64_t a, uint64_t b, uint64_t& out) { return __builtin_add_overflow(a, b, &out); }

std::string shape_str(const std::vector<int64_t>& ne) {
  std::string s = "[";
  for (size_t i = 0; i < ne.size(); ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
  return s + "]";
}

}  // namespace

int64_t GGUFTensor::n_elements() const {
  int64_t n = 1;
  for (int64_t d : ne) n *= d;  // validated at load: no overflow
  return n;
}

GGUFFile::GGUFFile(const std::string& path) : file_(path) {
  const std::string& p = file_.path();
  const size_t size = file_.size();
  const uint8_t* base = file_.data();
  if (size == 0) fail(p, ": empty file, not a GGUF file");
  if (size < 4 || std::memcmp(base, "GGUF", 4) != 0) {
    std::string magic;
    for (size_t i = 0; i < std::min<size_t>(size, 4); ++i) {
      const char c = (char)base[i];
      char hex[8];
      std::snprintf(hex, sizeof(hex), "\\x%02x", (unsigned)(unsigned char)c);
      magic += (c >= 32 && c < 127) ? std::string(1, c) : std::string(hex);
    }
    fail(p, ": not a GGUF file (bad magic '", magic, "', expected 'GGUF')");
  }

  Reader r(p, base, size);
  r.take(4, "magic", "header");
  version_ = r.get<uint32_t>("version", "header");
  if (version_ == 1) fail(p, ": GGUF version 1 is not supported (only versions 2 and 3)");
  if (version_ != 2 && version_ != 3) {
    const uint32_t swapped = __builtin_bswap32(version_);
    if (swapped == 2 || swapped == 3) fail(p, ": big-endian GGUF files are not supported");
    fail(p, ": unsupported GGUF version ", version_, " (supported: 2 and 3)");
  }
  const uint64_t n_tensors = r.get<uint64_t>("tensor count", "header");
  const uint64_t n_kv = r.get<uint64_t>("kv count", "header");
  // Minimal encodings: a kv is key length + type + 1 byte; a tensor info is name length + n_dims
  // + one dimension + type + offset.
  r.check_count(n_kv, 8 + 4 + 1, "kv count", "header");
  r.check_count(n_tensors, 8 + 4 + 8 + 4 + 8, "tensor count", "header");

  // ---- metadata
  for (uint64_t i = 0; i < n_kv; ++i) {
    const std::string where_key = "metadata entry " + std::to_string(i);
    std::string key = r.str("key", where_key);
    const std::string where = "metadata " + quoted_key(key);
    const uint32_t t = r.get<uint32_t>("value type", where);
    GGUFValue v = read_value(r, p, t, where);
    if (kv_.count(key)) fail(p, ": duplicate metadata key '", key, "'");
    kv_.emplace(std::move(key), std::move(v));
  }

  // ---- alignment
  if (auto it = kv_.find("general.alignment"); it != kv_.end()) {
    const GGUFValue& v = it->second;
    int64_t a = 0;
    if (const auto* u = std::get_if<uint64_t>(&v)) {
      a = *u > (uint64_t)std::numeric_limits<int64_t>::max() ? -1 : (int64_t)*u;
    } else if (const auto* s = std::get_if<int64_t>(&v)) {
      a = *s;
    } else {
      fail(p, ": general.alignment is ", kind_name(v), ", expected an integer");
    }
    if (a <= 0 || (a & (a - 1)) != 0 || a > (int64_t(1) << 30))
      fail(p, ": invalid general.alignment ", a, " (must be a nonzero power of two, at most 2^30)");
    alignment_ = (size_t)a;
  } else {
    alignment_ = kDefaultAlignment;
  }

  // ---- tensor infos
  tensors_.reserve((size_t)std::min<uint64_t>(n_tensors, 1u << 16));
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GGUFTensor t;
    t.name = r.str("name", "tensor info " + std::to_string(i));
    const std::string where = "tensor '" + t.name + "'";
    const uint32_t n_dims = r.get<uint32_t>("n_dims", where);
    if (n_dims == 0 || n_dims > kMaxDims)
      fail(p, ": ", where, " has ", n_dims, " dimensions (must be 1 to ", kMaxDims, ")");
    uint64_t count = 1;
    bool overflow = false;
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t ne = r.get<uint64_t>("dimension", where);
      if (ne > (uint64_t)std::numeric_limits<int64_t>::max())
        fail(p, ": ", where, " has invalid dimension ne[", d, "] = ", (int64_t)ne, " (negative)");
      t.ne.push_back((int64_t)ne);
      overflow = overflow || mul_overflows(count, ne, count);
    }
    if (overflow || count > (uint64_t)std::numeric_limits<int64_t>::max())
      fail(p, ": ", where, " shape ", shape_str(t.ne), ": element count overflows");
    const uint32_t type_id = r.get<uint32_t>("type", where);
    t.type = static_cast<GGMLType>(type_id);
    const size_t blk = type_block_elems(t.type), blk_bytes = type_block_bytes(t.type);
    if (blk == 0) fail(p, ": ", where, " has unknown tensor type id ", type_id);
    if (t.ne[0] % (int64_t)blk != 0)
      fail(p, ": ", where, " shape ", shape_str(t.ne), ": row size ", t.ne[0], " is not a multiple of the ",
           type_name(t.type), " block size ", blk);
    uint64_t nbytes = 0;
    if (mul_overflows(count / blk, blk_bytes, nbytes))
      fail(p, ": ", where, " shape ", shape_str(t.ne), ": byte size overflows");
    t.nbytes = (size_t)nbytes;
    t.offset = r.get<uint64_t>("offset", where);
    if (t.offset % alignment_ != 0)
      fail(p, ": ", where, " offset ", t.offset, " is misaligned (not a multiple of the alignment ", alignment_, ")");
    if (index_.count(t.name)) fail(p, ": duplicate tensor name '", t.name, "'");
    index_.emplace(t.name, tensors_.size());
    tensors_.push_back(std::move(t));
  }

  // ---- data section
  uint64_t data_start = r.pos();
  if (data_start % alignment_) data_start += alignment_ - data_start % alignment_;  // alignment <= 2^30
  for (GGUFTensor& t : tensors_) {
    uint64_t begin = 0, end = 0;
    if (add_overflows(data_start, t.offset, begin))
      fail(p, ": tensor '", t.name, "' data [offset ", data_start, " + ", t.offset, ", ", t.nbytes,
           " bytes] runs past end of file (size ", size, ")");
    if (add_overflows(begin, t.nbytes, end) || end > size)
      fail(p, ": tensor '", t.name, "' data [offset ", begin, ", ", t.nbytes, " bytes] runs past end of file (size ",
           size, ")");
    t.data = base + begin;
  }
}

const GGUFValue& GGUFFile::get(const std::string& key) const {
  auto it = kv_.find(key);
  if (it == kv_.end()) fail(path(), ": missing metadata key '", key, "'");
  return it->second;
}

int64_t GGUFFile::get_int(const std::string& key) const {
  const GGUFValue& v = get(key);
  if (const auto* s = std::get_if<int64_t>(&v)) return *s;
  if (const auto* u = std::get_if<uint64_t>(&v)) {
    FOCUS_CHECK(*u <= (uint64_t)std::numeric_limits<int64_t>::max(), path(), ": metadata key '", key,
                "' value ", *u, " is too large");
    return (int64_t)*u;
  }
  if (const auto* b = std::get_if<bool>(&v)) return *b ? 1 : 0;
  fail(path(), ": metadata key '", key, "' is ", kind_name(v), ", expected an integer");
}

int64_t GGUFFile::get_int(const std::string& key, int64_t def) const { return has(key) ? get_int(key) : def; }

double GGUFFile::get_float(const std::string& key) const {
  const GGUFValue& v = get(key);
  if (const auto* d = std::get_if<double>(&v)) return *d;
  if (const auto* s = std::get_if<int64_t>(&v)) return (double)*s;
  if (const auto* u = std::get_if<uint64_t>(&v)) return (double)*u;
  fail(path(), ": metadata key '", key, "' is ", kind_name(v), ", expected a number");
}

double GGUFFile::get_float(const std::string& key, double def) const { return has(key) ? get_float(key) : def; }

std::string GGUFFile::get_string(const std::string& key) const {
  const GGUFValue& v = get(key);
  if (const auto* s = std::get_if<std::string>(&v)) return *s;
  fail(path(), ": metadata key '", key, "' is ", kind_name(v), ", expected a string");
}

std::string GGUFFile::get_string(const std::string& key, const std::string& def) const {
  return has(key) ? get_string(key) : def;
}

const std::vector<std::string>& GGUFFile::get_string_array(const std::string& key) const {
  const GGUFValue& v = get(key);
  if (const auto* a = std::get_if<std::vector<std::string>>(&v)) return *a;
  fail(path(), ": metadata key '", key, "' is ", kind_name(v), ", expected a string array");
}

std::vector<double> GGUFFile::get_float_array(const std::string& key) const {
  const GGUFValue& v = get(key);
  if (const auto* a = std::get_if<std::vector<double>>(&v)) return *a;
  if (const auto* a = std::get_if<std::vector<int64_t>>(&v)) return std::vector<double>(a->begin(), a->end());
  fail(path(), ": metadata key '", key, "' is ", kind_name(v), ", expected a numeric array");
}

std::vector<int64_t> GGUFFile::get_int_array(const std::string& key) const {
  const GGUFValue& v = get(key);
  if (const auto* a = std::get_if<std::vector<int64_t>>(&v)) return *a;
  fail(path(), ": metadata key '", key, "' is ", kind_name(v), ", expected an integer array");
}

const GGUFTensor* GGUFFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const GGUFTensor& GGUFFile::tensor(const std::string& name) const {
  const GGUFTensor* t = find(name);
  if (!t) fail(path(), ": missing tensor '", name, "'");
  return *t;
}

std::vector<float> GGUFFile::to_float(const GGUFTensor& t) const {
  if (!type_supported(t.type))
    fail(path(), ": tensor '", t.name, "' has type ", type_name(t.type), ", which cannot be dequantised");
  const int64_t n = t.n_elements();
  std::vector<float> out((size_t)n);
  if (n == 0) return out;
  const int64_t row = t.ne[0], rows = n / row;
  const size_t rb = row_bytes(t.type, row);
  // Rows are independent: convert them in parallel chunks of about 64K elements.
  const int64_t per_chunk = std::max<int64_t>(1, (int64_t(1) << 16) / row);
  const int64_t chunks = (rows + per_chunk - 1) / per_chunk;
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t r0 = c * per_chunk, r1 = std::min(rows, r0 + per_chunk);
    dequantize(t.type, t.data + (size_t)r0 * rb, out.data() + r0 * row, (r1 - r0) * row);
  }
  return out;
}

}  // namespace focus::io
