// Decoding matrix-vector products on weights in their GGUF block formats: cpu::quant_matvec per
// weight type, instruction set and thread count, against float32 cblas_sgemv on the dequantised
// weights. Weights are random valid blocks; each product reads the whole weight once, so GB/s is
// weight bytes over time (for the large output matrices this is the memory bandwidth; the small
// matrices fit in the caches and show the kernels' compute speed).
#include "bench_quant_matvec.h"

#include <cblas.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench_timing.h"
#include "core/threads.h"
#include "io/ggml_types.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/quant_matvec.h"
#include "kernels/cpu/weight.h"

namespace focus {
namespace {

using io::GGMLType;

struct Shape {
  const char* name;
  int64_t rows, cols;
  std::vector<GGMLType> types;  // types to time (the model's own first)
};

// Random valid blocks: random bytes, fp16 scales overwritten with finite values.
std::vector<uint8_t> random_weight(GGMLType t, int64_t rows, int64_t cols, uint32_t seed) {
  std::vector<uint8_t> data(io::row_bytes(t, cols) * (size_t)rows);
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i + 8 <= data.size(); i += 8) {
    const uint64_t v = rng();
    std::memcpy(data.data() + i, &v, 8);
  }
  auto put = [&](size_t off, float v) {
    const uint16_t h = io::fp32_to_fp16(v);
    std::memcpy(data.data() + off, &h, 2);
  };
  const size_t n = (size_t)(rows * cols);
  if (t == GGMLType::F32) {
    for (size_t i = 0; i < n; ++i) {
      const float v = (float)((int)(rng() % 2001) - 1000) * 1e-5f;
      std::memcpy(data.data() + 4 * i, &v, 4);
    }
    return data;
  }
  if (t == GGMLType::F16 || t == GGMLType::BF16) {
    for (size_t i = 0; i < n; ++i) {
      const float v = (float)((int)(rng() % 2001) - 1000) * 1e-5f;
      if (t == GGMLType::F16) put(2 * i, v);
      else {
        uint32_t u;
        std::memcpy(&u, &v, 4);
        const uint16_t h = (uint16_t)(u >> 16);
        std::memcpy(data.data() + 2 * i, &h, 2);
      }
    }
    return data;
  }
  std::vector<size_t> halves;
  switch (t) {
    case GGMLType::Q4_0: case GGMLType::Q5_0: case GGMLType::Q8_0: halves = {0}; break;
    case GGMLType::Q4_1: case GGMLType::Q5_1: case GGMLType::Q4_K: case GGMLType::Q5_K: halves = {0, 2}; break;
    case GGMLType::Q2_K: halves = {80, 82}; break;
    case GGMLType::Q3_K: halves = {108}; break;
    case GGMLType::Q6_K: halves = {208}; break;
    default: break;
  }
  const size_t bb = io::type_block_bytes(t);
  for (size_t b = 0; b + bb <= data.size(); b += bb)
    for (size_t h : halves) put(b + h, 0.01f * (float)(1 + (int)(rng() % 7)) * ((rng() & 1) ? -1.f : 1.f));
  return data;
}

// Repetitions for about 0.25 s of timing, at least 5.
int reps_for(double seconds) { return (int)std::clamp(0.25 / std::max(seconds, 1e-7), 5.0, 2000.0); }

template <class F>
double time_it(F f) {
  const double t0 = bench::median_seconds(f, 3);
  return bench::median_seconds(f, reps_for(t0));
}

// The rate at which the threads in use read a 512 MiB buffer (each its own contiguous part, summed
// in 64-bit lanes): the ceiling a matrix-vector product that streams its weight from memory once
// can approach.
double read_bandwidth_gbs() {
  const size_t n = (size_t)512 << 20 >> 3;  // 64-bit words
  std::vector<uint64_t> buf(n);
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; ++i) buf[i] = i * 0x9E3779B97F4A7C15ull;  // touched by the thread that reads it
  volatile uint64_t sink = 0;
  const double sec = time_it([&] {
    uint64_t total = 0;
#pragma omp parallel for schedule(static) reduction(+ : total)
    for (size_t i = 0; i < n; i += 8) {
      uint64_t s = 0;
      for (size_t j = 0; j < 8; ++j) s += buf[i + j];
      total += s;
    }
    sink = sink + total;
  });
  return (double)(n * 8) / sec / 1e9;
}

}  // namespace

nlohmann::json bench_quant_matvec(bool full) {
  using T = GGMLType;
  const std::vector<T> classic = {T::Q4_0, T::Q4_1, T::Q5_0, T::Q8_0, T::F16, T::BF16, T::F32};
  const std::vector<T> kq = {T::Q4_K, T::Q5_K, T::Q6_K};
  auto all = [&](std::vector<T> first) {
    for (T t : classic)
      if (std::find(first.begin(), first.end(), t) == first.end()) first.push_back(t);
    return first;
  };
  auto all_k = [&](std::vector<T> first) {
    std::vector<T> v = all(first);
    for (T t : kq)
      if (std::find(v.begin(), v.end(), t) == v.end()) v.push_back(t);
    return v;
  };
  std::vector<Shape> shapes;
  if (full) {
    shapes = {{"smollm2 q/o 576x576", 576, 576, all({T::Q4_1})},
              {"smollm2 k/v 192x576", 192, 576, all({T::Q4_1})},
              {"smollm2 gate/up 1536x576", 1536, 576, all({T::Q4_1})},
              {"smollm2 down 576x1536", 576, 1536, all_k({T::Q4_1})},
              {"smollm2 output 49152x576", 49152, 576, all({T::Q8_0})},
              {"gemma3 q 1024x640", 1024, 640, all({T::Q5_0})},
              {"gemma3 gate/up 2048x640", 2048, 640, all({T::Q5_0})},
              {"gemma3 o 640x1024", 640, 1024, all_k({T::Q4_K})},
              {"gemma3 down 640x2048", 640, 2048, all_k({T::Q4_K, T::Q6_K})},
              {"gemma3 output 262144x640", 262144, 640, {T::Q8_0, T::Q4_0, T::Q4_1, T::Q5_0, T::F16}}};
  } else {
    shapes = {{"smollm2 q/o 576x576", 576, 576, {T::Q4_1}},
              {"smollm2 gate/up 1536x576", 1536, 576, {T::Q4_1}},
              {"smollm2 down 576x1536", 576, 1536, {T::Q4_1}},
              {"smollm2 output 49152x576", 49152, 576, {T::Q8_0}},
              {"gemma3 gate/up 2048x640", 2048, 640, {T::Q5_0}},
              {"gemma3 o 640x1024", 640, 1024, {T::Q4_K}},
              {"gemma3 down 640x2048", 640, 2048, {T::Q4_K, T::Q6_K}},
              {"gemma3 output 262144x640", 262144, 640, {T::Q8_0}}};
  }
  std::vector<std::string> isas;
  for (const char* n : {"avx512vnni", "avx2", "generic"})
    if (cpu::quant_isa_supported(n)) isas.push_back(n);
  const std::string saved_isa = cpu::quant_isa();
  const int saved_threads = num_threads();

  nlohmann::json rows = nlohmann::json::array();
  for (int th : {1, 2}) {
    set_threads(th);
    const double gbs = read_bandwidth_gbs();
    std::printf("memory read, 512 MiB, %d thread%s: %.1f GB/s\n", th, th > 1 ? "s" : "", gbs);
    rows.push_back({{"shape", "memory read 512 MiB"}, {"threads", th}, {"gb_per_s", gbs}});
  }
  std::printf("%-26s %-5s %-10s %3s %10s %8s %10s %8s\n", "shape", "type", "isa", "thr", "us", "GB/s", "sgemv us",
              "speedup");
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (const Shape& s : shapes) {
    std::vector<float> x((size_t)s.cols), y((size_t)s.rows);
    for (auto& v : x) v = nd(rng);
    // The float32 baseline: the model's own type dequantised.
    const std::vector<uint8_t> base_bytes = random_weight(s.types[0], s.rows, s.cols, 5);
    std::vector<float> wf = dequantize_all(Weight{s.types[0], s.rows, s.cols, base_bytes.data()});
    double sgemv_s[3] = {0, 0, 0};
    for (int th : {1, 2}) {
      set_threads(th);
      sgemv_s[th] = time_it([&] {
        cblas_sgemv(CblasRowMajor, CblasNoTrans, (int)s.rows, (int)s.cols, 1.f, wf.data(), (int)s.cols, x.data(), 1,
                    0.f, y.data(), 1);
      });
    }
    wf = std::vector<float>();
    for (T t : s.types) {
      if (s.cols % (int64_t)io::type_block_elems(t) != 0) continue;
      const std::vector<uint8_t> bytes = t == s.types[0] ? base_bytes : random_weight(t, s.rows, s.cols, 5);
      const Weight W{t, s.rows, s.cols, bytes.data()};
      for (const std::string& isa : isas) {
        cpu::set_quant_isa(isa);
        for (int th : {1, 2}) {
          set_threads(th);
          const double sec = time_it([&] { cpu::quant_matvec(x.data(), W, y.data(), 1); });
          const double gbs = (double)W.bytes() / sec / 1e9;
          std::printf("%-26s %-5s %-10s %3d %10.1f %8.1f %10.1f %8.2f\n", s.name, io::type_name(t).c_str(),
                      isa.c_str(), th, sec * 1e6, gbs, sgemv_s[th] * 1e6, sgemv_s[th] / sec);
          std::fflush(stdout);
          rows.push_back({{"shape", s.name}, {"rows", s.rows}, {"cols", s.cols}, {"type", io::type_name(t)},
                          {"isa", isa}, {"threads", th}, {"us", sec * 1e6}, {"weight_bytes", W.bytes()},
                          {"gb_per_s", gbs}, {"sgemv_us", sgemv_s[th] * 1e6}, {"speedup_vs_sgemv", sgemv_s[th] / sec}});
        }
      }
    }
  }
  cpu::set_quant_isa(saved_isa);
  set_threads(saved_threads);
  return rows;
}

nlohmann::json bench_quant_gemm(int64_t M) {
  using T = GGMLType;
  const std::vector<Shape> shapes = {{"smollm2 q/o 576x576", 576, 576, {T::Q4_1}},
                                     {"smollm2 gate/up 1536x576", 1536, 576, {T::Q4_1}},
                                     {"smollm2 down 576x1536", 576, 1536, {T::Q4_1}},
                                     {"smollm2 output 49152x576", 49152, 576, {T::Q8_0}},
                                     {"gemma3 q 1024x640", 1024, 640, {T::Q5_0}},
                                     {"gemma3 gate/up 2048x640", 2048, 640, {T::Q5_0, T::Q8_0}},
                                     {"gemma3 o 640x1024", 640, 1024, {T::Q4_K}},
                                     {"gemma3 down 640x2048", 640, 2048, {T::Q4_K, T::Q6_K, T::Q8_0}}};
  nlohmann::json rows = nlohmann::json::array();
  const std::string saved_isa = cpu::quant_isa();
  // The best instruction set with an integer GEMM: AVX-512 VNNI, else AVX2.
  if (!cpu::set_quant_isa("avx512vnni") && !cpu::set_quant_isa("avx2")) {
    std::printf("quant_gemm: this CPU has neither AVX-512 VNNI nor AVX2; nothing to time\n");
    return rows;
  }
  const cpu::PrefillGemm saved_gemm = cpu::prefill_gemm();
  std::printf("quant_gemm on %s\n", cpu::quant_isa());
  std::printf("%-26s %-5s %5s %3s %10s %9s %10s %9s %8s\n", "shape", "type", "M", "thr", "int8 ms", "GOP/s",
              "f32 ms", "GFLOP/s", "speedup");
  std::mt19937 rng(12);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (const Shape& s : shapes) {
    std::vector<float> x((size_t)(M * s.cols)), y((size_t)(M * s.rows));
    for (auto& v : x) v = nd(rng);
    for (T t : s.types) {
      const std::vector<uint8_t> bytes = random_weight(t, s.rows, s.cols, 6);
      const Weight W{t, s.rows, s.cols, bytes.data()};
      const double ops = 2.0 * (double)M * (double)s.rows * (double)s.cols;
      const double int8_s = time_it([&] { cpu::quant_gemm(x.data(), W, y.data(), M); });
      cpu::set_prefill_gemm(cpu::PrefillGemm::Dequant);
      const double f32_s = time_it([&] { cpu::linear(x.data(), W, nullptr, y.data(), M, s.cols, s.rows); });
      cpu::set_prefill_gemm(saved_gemm);
      std::printf("%-26s %-5s %5lld %3d %10.3f %9.1f %10.3f %9.1f %8.2f\n", s.name, io::type_name(t).c_str(),
                  (long long)M, num_threads(), int8_s * 1e3, ops / int8_s / 1e9, f32_s * 1e3, ops / f32_s / 1e9,
                  f32_s / int8_s);
      std::fflush(stdout);
      rows.push_back({{"shape", s.name}, {"rows", s.rows}, {"cols", s.cols}, {"type", io::type_name(t)},
                      {"isa", cpu::quant_isa()}, {"M", M},
                      {"threads", num_threads()}, {"int8_ms", int8_s * 1e3}, {"int8_gops", ops / int8_s / 1e9},
                      {"dequant_sgemm_ms", f32_s * 1e3}, {"dequant_sgemm_gflops", ops / f32_s / 1e9},
                      {"speedup", f32_s / int8_s}});
    }
  }
  cpu::set_quant_isa(saved_isa);
  return rows;
}

}  // namespace focus
