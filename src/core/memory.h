// Memory limits checked before large allocations. A job whose estimated need exceeds what the
// machine (or the process's cgroup) has free gets a clear error with the estimate and its parts,
// before anything large is allocated, rather than an out-of-memory kill halfway through.
#pragma once
#include <cstddef>
#include <cstdint>
#include <new>
#include <string>
#include <utility>
#include <vector>

namespace focus {

// Bytes this process may still allocate: the smaller of MemAvailable (/proc/meminfo) and the
// cgroup's memory limit less its current usage. The environment variable FOCUS_MEMORY_LIMIT
// replaces the reading (bytes, or a number with K, M, G or T; "off" or 0 turns the checks off).
// Returns -1 when nothing is known (no limit is then enforced).
int64_t available_memory();

// "1.50 GiB", "12.0 MiB", "512 B".
std::string format_bytes(double bytes);

// An estimate of the memory a job will allocate, in named parts.
struct MemoryNeed {
  std::vector<std::pair<std::string, double>> parts;
  MemoryNeed& add(const std::string& what, double bytes) {
    if (bytes > 0) parts.emplace_back(what, bytes);
    return *this;
  }
  double total() const;
  // "1.50 GiB (KV cache 1.00 GiB, activations 512 MiB)"
  std::string describe() const;
};

// Memory for large arrays read at scattered rows (the KV cache): blocks of 2 MiB or more are
// 2 MiB aligned and asked for transparent huge pages before they are touched, so that rows
// gathered from anywhere in them cost no TLB miss per 4 KiB page. Smaller blocks come from the
// ordinary allocator.
void* huge_page_alloc(size_t bytes);
void huge_page_free(void* p) noexcept;

// Elements made without a value are default-initialised: a vector<float, HugePageAllocator<float>>
// of n elements holds n unset floats, which its owner fills (KVCache::init zeroes its arrays from
// every thread, so that the pages are first touched, and cleared by the system, side by side).
template <class T>
struct HugePageAllocator {
  using value_type = T;
  HugePageAllocator() = default;
  template <class U>
  HugePageAllocator(const HugePageAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(huge_page_alloc(n * sizeof(T))); }
  void deallocate(T* p, size_t) noexcept { huge_page_free(p); }
  // (Construction with a value goes through std::allocator_traits' own placement new.)
  template <class U>
  void construct(U* p) {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U>
  bool operator==(const HugePageAllocator<U>&) const { return true; }
};

// Throws Error "WHAT needs about X (parts) but only Y is free; HINT" when the need exceeds
// available_memory().
void check_memory(const std::string& what, const MemoryNeed& need, const std::string& hint);

}  // namespace focus
