#include "core/threads.h"

#include <omp.h>
#include <unistd.h>

#include <cstdlib>

extern "C" void openblas_set_num_threads(int);

namespace focus {
void set_threads(int n) {
  if (n <= 0) n = omp_get_num_procs();
  omp_set_num_threads(n);
  openblas_set_num_threads(n);
}
int num_threads() { return omp_get_max_threads(); }

void select_blas_kernels(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") || std::getenv("FOCUS_NO_REEXEC")) return;
  __builtin_cpu_init();
  if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")))
    return;
  setenv("OPENBLAS_CORETYPE", "SkylakeX", 1);
  setenv("FOCUS_NO_REEXEC", "1", 1);
  execv("/proc/self/exe", argv);
  // exec failed: carry on with the kernels already chosen.
}
}  // namespace focus
