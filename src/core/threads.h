// Thread count control (OpenMP, shared with OpenBLAS's OpenMP build).
#pragma once

namespace focus {
// Sets the number of threads used by our kernels and BLAS; n <= 0 means all cores.
void set_threads(int n);
int num_threads();
}  // namespace focus
