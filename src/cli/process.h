// Process-wide set-up that belongs to programs, not to the library: re-executing with the
// AVX-512 BLAS kernels and the Ctrl-C handler. Header-only so focus_bench can use it too.
#pragma once
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdlib>

#include "core/progress.h"
#include "core/threads.h"

namespace focus::cli {

// First thing in main(): when the CPU prefers other OpenBLAS kernels than the ones the library
// picks by itself (preferred_blas_coretype) and OPENBLAS_CORETYPE is unset, sets it and
// re-executes the program once so OpenBLAS loads with them. Does nothing otherwise.
inline void reexec_for_blas_kernels(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") || std::getenv("FOCUS_NO_REEXEC")) return;
  const char* core = preferred_blas_coretype();
  if (!core) return;
  setenv("OPENBLAS_CORETYPE", core, 1);
  setenv("FOCUS_NO_REEXEC", "1", 1);
  execv("/proc/self/exe", argv);
  // exec failed: carry on with the kernels already chosen.
}

inline std::atomic<int> sigint_count{0};

inline void on_sigint(int) {
  if (sigint_count.fetch_add(1) >= 1) _exit(130);
  request_interrupt();
}

// Ctrl-C asks the running loop to stop (request_interrupt); a second Ctrl-C exits at once.
inline void install_interrupt_handler() {
  struct sigaction sa {};
  sa.sa_handler = on_sigint;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
}

}  // namespace focus::cli
