// Timing shared by the benchmarks.
#pragma once
#include <algorithm>
#include <chrono>
#include <vector>

namespace focus::bench {

// Median wall time in seconds of f over reps runs, after one untimed run.
template <class F>
double median_seconds(F f, int reps) {
  f();
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace focus::bench
