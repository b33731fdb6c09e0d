// Wall time of every OpenMP parallel region a program opens, by the function it runs: loaded with
// LD_PRELOAD in front of libgomp, it wraps GOMP_parallel (the entry GCC emits for `#pragma omp
// parallel`), times each call and, at exit, writes per function: seconds, calls, the object file
// and the function's offset in it (scripts/profile/omp_regions.sh turns those into names).
// OMP_REGIONS_DELAY=S skips the regions that start in the first S seconds (a prefill before the
// decoding steps to be measured); OMP_REGIONS_OUT=FILE writes there instead of stderr. Regions
// opened by several threads at once are each counted (the table is updated under a lock); a
// nested region's time is also inside its parent's.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef void (*region_fn)(void*);
static void (*real_parallel)(region_fn, void*, unsigned, unsigned);

enum { kSlots = 4096 };
static void* fn_of[kSlots];
static double seconds_of[kSlots];
static long calls_of[kSlots];
static double t_load = -1, delay = 0, t_first = -1, t_last = 0;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

void GOMP_parallel(region_fn fn, void* data, unsigned threads, unsigned flags) {
  pthread_mutex_lock(&lock);
  if (!real_parallel) {
    real_parallel = (void (*)(region_fn, void*, unsigned, unsigned))dlsym(RTLD_NEXT, "GOMP_parallel");
    const char* d = getenv("OMP_REGIONS_DELAY");
    delay = d ? atof(d) : 0;
    t_load = now();
  }
  pthread_mutex_unlock(&lock);
  const double a = now();
  real_parallel(fn, data, threads, flags);
  const double b = now();
  if (a - t_load < delay) return;
  pthread_mutex_lock(&lock);
  if (t_first < 0) t_first = a;
  if (b > t_last) t_last = b;
  size_t h = ((size_t)fn >> 4) % kSlots;  // open addressing
  int probe = 0;
  for (; fn_of[h] && fn_of[h] != (void*)fn && probe < kSlots; ++probe) h = (h + 1) % kSlots;
  if (probe < kSlots) {  // a full table (more than kSlots region functions) drops the rest
    fn_of[h] = (void*)fn;
    seconds_of[h] += b - a;
    calls_of[h] += 1;
  }
  pthread_mutex_unlock(&lock);
}

__attribute__((destructor)) static void report(void) {
  const char* path = getenv("OMP_REGIONS_OUT");
  FILE* out = path ? fopen(path, "w") : stderr;
  if (!out) return;
  double total = 0;
  for (int i = 0; i < kSlots; ++i) {
    if (!fn_of[i]) continue;
    Dl_info info;
    const char* file = "?";
    long offset = 0;
    if (dladdr(fn_of[i], &info) && info.dli_fname) {
      file = info.dli_fname;
      offset = (long)((char*)fn_of[i] - (char*)info.dli_fbase);
    }
    fprintf(out, "%.6f %ld %s 0x%lx\n", seconds_of[i], calls_of[i], file, offset);
    total += seconds_of[i];
  }
  // The summary: seconds inside the regions, and from the first measured region's start to the
  // last one's end.
  fprintf(out, "# %.6f %.6f\n", total, t_first < 0 ? 0.0 : t_last - t_first);
  if (path) fclose(out);
}
