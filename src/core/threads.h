// Thread count control (OpenMP, shared with OpenBLAS's OpenMP build). Nothing in the library sets
// the thread count on its own: the program calls set_threads (the focus command from -t).
#pragma once

namespace focus {
// Sets the number of threads used by our kernels and BLAS; n <= 0 means all cores.
void set_threads(int n);
int num_threads();

// OpenBLAS picks its kernels when it loads: on AMD CPUs with AVX-512 it still takes the AVX2
// ("Haswell") ones, at half the speed. Returns the OPENBLAS_CORETYPE that selects the AVX-512
// kernels ("SkylakeX") when this CPU has AVX-512 F, BW, DQ and VL, else nullptr. A query only:
// a program that wants those kernels sets the variable before OpenBLAS loads (see cli/process.h).
const char* preferred_blas_coretype();
}  // namespace focus
