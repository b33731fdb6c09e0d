// Helpers of the GGUF tests: a scratch directory, little-endian byte writing, a builder of GGUF
// files (any version, metadata, tensors, deliberately bad offsets) and the check that parsing a
// malformed file fails with focus::Error naming the file and the problem.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <bit>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/ggml_types.h"
#include "io/gguf.h"
#include "test_util.h"

namespace focus::test::gguf {

namespace fs = std::filesystem;
using focus::io::GGMLType;
using focus::io::GGUFFile;

inline fs::path scratch_dir() {
  fs::path d = fs::temp_directory_path() / ("focus_test_gguf_" + std::to_string(::getpid()));
  fs::create_directories(d);
  return d;
}

// A file in the scratch directory, removed when it goes out of scope.
struct TempFile {
  std::string path;
  TempFile(const std::string& name, const std::string& bytes) : path((scratch_dir() / name).string()) {
    std::ofstream(path, std::ios::binary).write(bytes.data(), (std::streamsize)bytes.size());
  }
  ~TempFile() {
    std::error_code ec;
    fs::remove(path, ec);
    fs::remove(fs::path(path).parent_path(), ec);  // only succeeds once the directory is empty
  }
};

// Little-endian byte writer.
struct Bytes {
  std::string b;
  template <typename T>
  Bytes& put(T v) {
    b.append(reinterpret_cast<const char*>(&v), sizeof(T));
    return *this;
  }
  Bytes& str(const std::string& s) {
    put<uint64_t>(s.size());
    b += s;
    return *this;
  }
};

enum VT : uint32_t {
  V_UINT8 = 0, V_INT8, V_UINT16, V_INT16, V_UINT32, V_INT32, V_FLOAT32, V_BOOL, V_STRING, V_ARRAY,
  V_UINT64, V_INT64, V_FLOAT64,
};

// Builds GGUF files. Tensor data offsets are laid out automatically (aligned) unless given.
struct Builder {
  uint32_t version = 3;
  uint64_t alignment = 32;  // layout only; add a general.alignment kv to change the file's
  std::string kvs;
  uint64_t n_kv = 0;
  struct Tensor {
    std::string name;
    std::vector<uint64_t> ne;
    uint32_t type;
    std::string data;
    std::optional<uint64_t> offset;  // automatic when absent
  };
  std::vector<Tensor> tensors;

  // Raw entry: key, value type, encoded value.
  Builder& kv_raw(const std::string& key, uint32_t type, const std::string& value) {
    Bytes w;
    w.str(key).put<uint32_t>(type);
    kvs += w.b + value;
    ++n_kv;
    return *this;
  }
  template <typename T>
  Builder& kv(const std::string& key, uint32_t type, T v) {
    return kv_raw(key, type, Bytes().put(v).b);
  }
  Builder& kv_str(const std::string& key, const std::string& v) { return kv_raw(key, V_STRING, Bytes().str(v).b); }
  template <typename T>
  Builder& kv_array(const std::string& key, uint32_t elem, const std::vector<T>& v) {
    Bytes w;
    w.put<uint32_t>(elem).put<uint64_t>(v.size());
    for (const T& x : v) w.put(x);
    return kv_raw(key, V_ARRAY, w.b);
  }
  Builder& kv_str_array(const std::string& key, const std::vector<std::string>& v) {
    Bytes w;
    w.put<uint32_t>(V_STRING).put<uint64_t>(v.size());
    for (const auto& s : v) w.str(s);
    return kv_raw(key, V_ARRAY, w.b);
  }
  Builder& tensor(const std::string& name, std::vector<uint64_t> ne, uint32_t type, std::string data,
                  std::optional<uint64_t> offset = std::nullopt) {
    tensors.push_back({name, std::move(ne), type, std::move(data), offset});
    return *this;
  }
  Builder& tensor(const std::string& name, std::vector<uint64_t> ne, GGMLType type, std::string data,
                  std::optional<uint64_t> offset = std::nullopt) {
    return tensor(name, std::move(ne), static_cast<uint32_t>(type), std::move(data), offset);
  }

  std::string build() const {
    Bytes w;
    w.b = "GGUF";
    w.put<uint32_t>(version).put<uint64_t>(tensors.size()).put<uint64_t>(n_kv);
    w.b += kvs;
    auto align = [&](uint64_t x) { return (x + alignment - 1) / alignment * alignment; };
    std::vector<uint64_t> offs;
    uint64_t off = 0;
    for (const Tensor& t : tensors) {
      const uint64_t o = t.offset.value_or(off);
      offs.push_back(o);
      off = align(o + t.data.size());
      w.str(t.name).put<uint32_t>((uint32_t)t.ne.size());
      for (uint64_t d : t.ne) w.put(d);
      w.put<uint32_t>(t.type).put<uint64_t>(o);
    }
    if (tensors.empty()) return w.b;  // no data section, no padding
    const size_t data_start = align(w.b.size());
    w.b.resize(data_start, '\0');
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (offs[i] > (1u << 30)) continue;  // deliberately bogus offset: no data written
      if (w.b.size() < data_start + offs[i]) w.b.resize(data_start + offs[i], '\0');
      w.b.replace(data_start + offs[i], tensors[i].data.size(), tensors[i].data);
    }
    return w.b;
  }
};

// Expects parsing `bytes` to throw focus::Error starting with the path and containing every phrase.
inline void expect_gguf_error(const std::string& name, const std::string& bytes, const std::vector<std::string>& phrases) {
  TempFile f(name, bytes);
  try {
    GGUFFile g(f.path);
    ADD_FAILURE() << name << ": parsed without error";
  } catch (const focus::Error& e) {
    const std::string m = e.what();
    focus::test::record_error(m, name);
    EXPECT_EQ(m.rfind(f.path + ": ", 0), 0u) << "message does not start with the path: " << m;
    for (const auto& p : phrases) EXPECT_NE(m.find(p), std::string::npos) << "missing '" << p << "' in: " << m;
  }
}

inline uint32_t fbits(float f) { return std::bit_cast<uint32_t>(f); }

}  // namespace focus::test::gguf
