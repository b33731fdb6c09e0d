#include "core/threads.h"

#include <omp.h>

extern "C" void openblas_set_num_threads(int);

namespace focus {
void set_threads(int n) {
  if (n <= 0) n = omp_get_num_procs();
  omp_set_num_threads(n);
  openblas_set_num_threads(n);
}
int num_threads() { return omp_get_max_threads(); }

const char* preferred_blas_coretype() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
    return "SkylakeX";
  return nullptr;
}
}  // namespace focus
