// Helpers shared by the libFuzzer harnesses: a private scratch folder per process, writing the
// input (or parts of it) to files there, and splitting one input into several files.
//
// A harness calls the reader under test inside guarded(): focus::Error is the expected outcome
// for a malformed input and is swallowed; any other exception escapes, and libFuzzer reports it
// (as a crash) together with every sanitizer report, timeout and excessive allocation.
#pragma once
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace focus::fuzz {

// A folder private to this process ($TMPDIR or /tmp, then focus-fuzz-<pid>), removed at exit.
inline const std::string& scratch_dir() {
  static const std::string dir = [] {
    const char* t = std::getenv("TMPDIR");
    std::filesystem::path base = (t && *t) ? t : "/tmp";
    std::filesystem::path d = base / ("focus-fuzz-" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    static const std::string keep = d.string();
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(keep, ec);
    });
    return d.string();
  }();
  return dir;
}

// A sub-folder of the scratch folder, emptied.
inline std::string fresh_dir(const std::string& name) {
  const std::filesystem::path d = std::filesystem::path(scratch_dir()) / name;
  std::error_code ec;
  std::filesystem::remove_all(d, ec);
  std::filesystem::create_directories(d);
  return d.string();
}

// Writes bytes to path (replacing it); aborts if the write fails (a harness problem, not a finding).
inline void write_bytes(const std::string& path, std::string_view bytes) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) {
    std::perror(path.c_str());
    std::abort();
  }
  if (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) std::abort();
  std::fclose(f);
}

// Writes the input to a file named `name` in the scratch folder and returns its path.
inline std::string write_input(const std::string& name, const uint8_t* data, size_t size) {
  const std::string p = scratch_dir() + "/" + name;
  write_bytes(p, std::string_view(reinterpret_cast<const char*>(data), size));
  return p;
}

// Splits an input into parts at each occurrence of the separator line "\n=====\n" (so a seed is
// written as part0 SEP part1 SEP part2 ...). Missing parts are empty; extra parts are kept.
inline std::vector<std::string_view> split_parts(const uint8_t* data, size_t size, size_t min_parts) {
  static constexpr std::string_view kSep = "\n=====\n";
  std::string_view s(reinterpret_cast<const char*>(data), size);
  std::vector<std::string_view> parts;
  size_t pos = 0;
  while (true) {
    const size_t at = s.find(kSep, pos);
    if (at == std::string_view::npos) {
      parts.push_back(s.substr(pos));
      break;
    }
    parts.push_back(s.substr(pos, at - pos));
    pos = at + kSep.size();
  }
  while (parts.size() < min_parts) parts.emplace_back();
  return parts;
}

// Runs fn, treating focus::Error as the expected result of a malformed input.
template <class Fn>
void guarded(Fn&& fn) {
  try {
    fn();
  } catch (const focus::Error&) {
  }
}

}  // namespace focus::fuzz
