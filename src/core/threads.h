// Thread count control (OpenMP, shared with OpenBLAS's OpenMP build). Nothing in the library sets
// the thread count on its own: the program calls set_threads (the focus command from -t).
#pragma once
#include <cstdint>
#include <exception>

namespace focus {
// Sets the number of threads used by our kernels and BLAS; n <= 0 means all cores.
void set_threads(int n);
int num_threads();

// OpenBLAS picks its kernels when it loads: on AMD CPUs with AVX-512 it still takes the AVX2
// ("Haswell") ones, at half the speed. Returns the OPENBLAS_CORETYPE that selects the AVX-512
// kernels ("SkylakeX") when this CPU has AVX-512 F, BW, DQ and VL, else nullptr. A query only:
// a program that wants those kernels sets the variable before OpenBLAS loads (see cli/process.h).
const char* preferred_blas_coretype();

// body(i) for i in [0, n): split over the threads (static schedule) when `parallel`, else on the
// calling thread with no OpenMP region at all. A region whose `if` clause is false still makes
// and frees a team of one thread in libgomp (about 0.4 us): a decoding step has hundreds of loops
// too small for threads. The iterations must be independent and body must not throw.
template <class F>
inline void parallel_for(int64_t n, bool parallel, F&& body) {
  if (!parallel) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) body(i);
}

// The same for a few unequal iterations that may throw: taken one at a time by whichever thread
// is free (dynamic schedule); an exception of an iteration stops none of the others and is
// rethrown on the calling thread after the loop (when several throw, one of them).
template <class F>
inline void parallel_for_checked(int64_t n, bool parallel, F&& body) {
  if (!parallel) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  std::exception_ptr failed;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i) {
    try {
      body(i);
    } catch (...) {
#pragma omp critical(focus_parallel_for_checked)
      if (!failed) failed = std::current_exception();
    }
  }
  if (failed) std::rethrow_exception(failed);
}
}  // namespace focus
