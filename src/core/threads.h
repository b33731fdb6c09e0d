// Thread count control (OpenMP, shared with OpenBLAS's OpenMP build).
#pragma once

namespace focus {
// Sets the number of threads used by our kernels and BLAS; n <= 0 means all cores.
void set_threads(int n);
int num_threads();

// OpenBLAS picks its kernels when it loads: on AMD CPUs with AVX-512 it still takes the AVX2
// ("Haswell") ones, at half the speed. Called first thing in main(): when the CPU has
// AVX-512 (F, BW, DQ, VL) and OPENBLAS_CORETYPE is unset, sets it to SkylakeX and re-executes
// the program once so the library loads with the AVX-512 kernels. Does nothing otherwise.
void select_blas_kernels(char** argv);
}  // namespace focus
