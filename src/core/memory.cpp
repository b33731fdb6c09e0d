#include "core/memory.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include <sys/mman.h>

#include "core/error.h"

namespace focus {
namespace {

// FOCUS_MEMORY_LIMIT: -2 when unset, -1 for off, else bytes.
int64_t env_limit() {
  const char* s = std::getenv("FOCUS_MEMORY_LIMIT");
  if (!s || !*s) return -2;
  std::string v(s);
  for (auto& ch : v) ch = (char)std::tolower((unsigned char)ch);
  if (v == "off" || v == "none") return -1;
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  FOCUS_CHECK(end != v.c_str() && std::isfinite(x) && x >= 0, "FOCUS_MEMORY_LIMIT='", s,
              "' is not a byte count (e.g. 8G, 512M, off)");
  std::string unit(end);
  if (!unit.empty() && unit.back() == 'b') unit.pop_back();
  if (!unit.empty() && unit.back() == 'i') unit.pop_back();
  double mul = 1;
  if (unit == "k") mul = 1024.0;
  else if (unit == "m") mul = 1024.0 * 1024;
  else if (unit == "g") mul = 1024.0 * 1024 * 1024;
  else if (unit == "t") mul = 1024.0 * 1024 * 1024 * 1024;
  else FOCUS_CHECK(unit.empty(), "FOCUS_MEMORY_LIMIT='", s, "' has an unknown unit (use K, M, G or T)");
  return x == 0 ? -1 : (int64_t)(x * mul);
}

// A number from the first line of a file, or -1 (missing, or "max").
int64_t read_number(const char* path) {
  std::ifstream in(path);
  std::string s;
  if (!(in >> s) || s == "max") return -1;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  return end != s.c_str() && v >= 0 ? (int64_t)v : -1;
}

int64_t meminfo_available() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  long long kb = 0;
  std::string unit;
  while (in >> key >> kb) {
    std::getline(in, unit);
    if (key == "MemAvailable:") return (int64_t)kb * 1024;
  }
  return -1;
}

// A "key value" entry of a stat file, or -1.
int64_t read_stat(const char* path, const std::string& want) {
  std::ifstream in(path);
  std::string key;
  long long v = 0;
  while (in >> key >> v)
    if (key == want) return (int64_t)v;
  return -1;
}

int64_t cgroup_available() {
  // cgroup v2, then v1. Limits at or beyond 2^60 mean none. The usage counts the page cache,
  // which the kernel reclaims under pressure: it is not held against the limit.
  int64_t limit = read_number("/sys/fs/cgroup/memory.max");
  int64_t used = read_number("/sys/fs/cgroup/memory.current");
  int64_t cache = read_stat("/sys/fs/cgroup/memory.stat", "file");
  if (limit < 0) {
    limit = read_number("/sys/fs/cgroup/memory/memory.limit_in_bytes");
    used = read_number("/sys/fs/cgroup/memory/memory.usage_in_bytes");
    cache = read_stat("/sys/fs/cgroup/memory/memory.stat", "total_cache");
  }
  if (limit < 0 || limit >= (int64_t{1} << 60)) return -1;
  used = std::max<int64_t>(used, 0) - std::max<int64_t>(cache, 0);
  return std::max<int64_t>(0, limit - std::max<int64_t>(used, 0));
}

}  // namespace

int64_t available_memory() {
  const int64_t env = env_limit();
  if (env != -2) return env;
  const int64_t a = meminfo_available(), b = cgroup_available();
  if (a < 0) return b;
  if (b < 0) return a;
  return std::min(a, b);
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (bytes >= 1024 && u < 5) bytes /= 1024, ++u;
  char buf[32];
  if (u == 0) std::snprintf(buf, sizeof buf, "%.0f B", bytes);
  else std::snprintf(buf, sizeof buf, bytes >= 100 ? "%.0f %s" : bytes >= 10 ? "%.1f %s" : "%.2f %s", bytes, units[u]);
  return buf;
}

double MemoryNeed::total() const {
  double t = 0;
  for (const auto& p : parts) t += p.second;
  return t;
}

std::string MemoryNeed::describe() const {
  std::ostringstream os;
  os << format_bytes(total());
  if (!parts.empty()) {
    os << " (";
    for (size_t i = 0; i < parts.size(); ++i) os << (i ? ", " : "") << parts[i].first << " " << format_bytes(parts[i].second);
    os << ")";
  }
  return os.str();
}

void check_memory(const std::string& what, const MemoryNeed& need, const std::string& hint) {
  const int64_t avail = available_memory();
  if (avail < 0 || need.total() <= (double)avail) return;
  fail(what, " needs about ", need.describe(), " but only ", format_bytes((double)avail),
       " is free", hint.empty() ? "" : "; ", hint, " (FOCUS_MEMORY_LIMIT=off skips this check)");
}

void* huge_page_alloc(size_t bytes) {
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t align = bytes >= kHuge ? kHuge : 64;
  const size_t size = (std::max<size_t>(bytes, 1) + align - 1) / align * align;
  void* p = std::aligned_alloc(align, size);
  if (!p) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
  if (align == kHuge) madvise(p, size, MADV_HUGEPAGE);  // advice only: without THP, ordinary pages
#endif
  return p;
}

void huge_page_free(void* p) noexcept { std::free(p); }

}  // namespace focus
