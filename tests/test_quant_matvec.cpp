// quant_matvec against a float64 product over the exactly dequantised weights, for every weight
// type and every instruction set this CPU runs: random valid blocks, random activations (some rows
// with one large outlier), several M and shapes with odd row counts.
//
// Bound per output n of row x (K = W.cols, blocks b of kQuantActBlock = 32 elements):
//   quantisation: x is replaced by d_b * q with |x_k - d_b q_k| <= d_b / 2, the weights are used
//   exactly, so the product moves by at most sum_b (d_b / 2) sum_{k in b} |W[n,k]|;
//   rounding: the kernels form float32 products and partial sums of at most K / 16 + 64 terms whose
//   magnitudes are each bounded by A_b (|x_k| + d_b) summed over their elements, A_b = max_{k in b}
//   |W[n,k]| (the weight's parts, d q and the min or offset, are each at most about 2 A_b), so a
//   relative 1e-5 (~ 170 float32 ulps) of sum_k A_b (|x_k| + d_b) covers it with room.
// For the float types there is no quantisation term and the rounding term is 1e-5 sum_k |W x|.
#include <gtest/gtest.h>

#include <omp.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/threads.h"
#include "io/ggml_types.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/quant_matvec.h"
#include "kernels/cpu/weight.h"

using focus::Weight;
using focus::io::GGMLType;
namespace cpu = focus::cpu;

namespace {

const char* const kIsas[] = {"generic", "avx2", "avx512vnni"};

// Restores the instruction set in use when a test ends.
struct IsaGuard {
  std::string saved = cpu::quant_isa();
  ~IsaGuard() { cpu::set_quant_isa(saved); }
};

std::vector<std::string> supported_isas() {
  std::vector<std::string> out;
  for (const char* n : kIsas)
    if (cpu::quant_isa_supported(n)) out.push_back(n);
  return out;
}

// The instruction sets with an integer GEMM (quant_gemm) that this CPU runs.
std::vector<std::string> gemm_isas() {
  std::vector<std::string> out;
  for (const char* n : {"avx512vnni", "avx2"})
    if (cpu::quant_isa_supported(n)) out.push_back(n);
  return out;
}

void put16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }

// A finite random half: magnitude 2^-9 .. 2^-4 with a random sign.
uint16_t random_scale(std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-9.f, -4.f);
  const float v = std::exp2(u(rng)) * ((rng() & 1) ? -1.f : 1.f);
  return focus::io::fp32_to_fp16(v);
}

// Offsets of the fp16 fields (scales, minima) in a block of quantised type t.
std::vector<size_t> fp16_fields(GGMLType t) {
  switch (t) {
    case GGMLType::Q4_0: case GGMLType::Q5_0: case GGMLType::Q8_0: return {0};
    case GGMLType::Q4_1: case GGMLType::Q5_1: case GGMLType::Q4_K: case GGMLType::Q5_K: return {0, 2};
    case GGMLType::Q2_K: return {80, 82};
    case GGMLType::Q3_K: return {108};
    case GGMLType::Q6_K: return {208};
    default: ADD_FAILURE() << "no block builder for " << focus::io::type_name(t); return {};
  }
}

// Bytes of a [rows, cols] weight of type t: random quant bytes with finite random fp16 scales, or
// random values for the float types.
std::vector<uint8_t> random_weight(GGMLType t, int64_t rows, int64_t cols, std::mt19937& rng) {
  const size_t rb = focus::io::row_bytes(t, cols);
  std::vector<uint8_t> data(rb * (size_t)rows);
  std::normal_distribution<float> nd(0.f, 1.f);
  if (t == GGMLType::F32 || t == GGMLType::F16 || t == GGMLType::BF16) {
    for (size_t i = 0; i < (size_t)(rows * cols); ++i) {
      const float v = nd(rng) * 0.05f;
      if (t == GGMLType::F32) std::memcpy(data.data() + 4 * i, &v, 4);
      else if (t == GGMLType::F16) put16(data.data() + 2 * i, focus::io::fp32_to_fp16(v));
      else {
        uint32_t u;
        std::memcpy(&u, &v, 4);
        put16(data.data() + 2 * i, (uint16_t)(u >> 16));
      }
    }
    return data;
  }
  for (auto& c : data) c = (uint8_t)(rng() & 0xFF);
  const size_t bb = focus::io::type_block_bytes(t);
  const std::vector<size_t> halves = fp16_fields(t);
  for (size_t b = 0; b + bb <= data.size(); b += bb)
    for (size_t h : halves) put16(data.data() + b + h, random_scale(rng));
  return data;
}

// A quantised weight whose rows hold one byte everywhere but in the fp16 scales (random): 0xFF,
// 0x00, 0x80 and 0x7F by turns, which give each type's largest quants of either sign (Q4_1's 15,
// Q4_0's -8, Q6_K's 31 and -32, Q8_0's -128 and 127, ...).
std::vector<uint8_t> extreme_weight(GGMLType t, int64_t rows, int64_t cols, std::mt19937& rng) {
  std::vector<uint8_t> data = random_weight(t, rows, cols, rng);
  if (t == GGMLType::F32 || t == GGMLType::F16 || t == GGMLType::BF16) return data;
  const size_t rb = focus::io::row_bytes(t, cols), bb = focus::io::type_block_bytes(t);
  std::vector<uint8_t> scales = data;  // random_weight's blocks, whose fp16 fields are kept
  const uint8_t fills[] = {0xFF, 0x00, 0x80, 0x7F};
  for (int64_t r = 0; r < rows; ++r) std::fill_n(data.begin() + (ptrdiff_t)(r * rb), rb, fills[r % 4]);
  const std::vector<size_t> halves = fp16_fields(t);
  for (size_t b = 0; b + bb <= data.size(); b += bb)
    for (size_t h : halves) std::copy_n(scales.begin() + (ptrdiff_t)(b + h), 2, data.begin() + (ptrdiff_t)(b + h));
  return data;
}

// Activations: mean 0.3 (so block sums are large and a wrong offset or min shows), unit noise,
// and in every second row one element 50x larger.
std::vector<float> random_x(int64_t M, int64_t K, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.3f, 1.f);
  std::vector<float> x((size_t)(M * K));
  for (auto& v : x) v = nd(rng);
  for (int64_t m = 1; m < M; m += 2) x[(size_t)(m * K + (int64_t)(rng() % (uint32_t)K))] = 50.f * nd(rng);
  return x;
}

bool is_float_type(GGMLType t) { return t == GGMLType::F32 || t == GGMLType::F16 || t == GGMLType::BF16; }

struct Expect {
  std::vector<double> exact;     // [M, N]
  std::vector<double> quant;     // quantisation bound
  std::vector<double> rounding;  // rounding allowance
};

Expect reference(const Weight& W, const std::vector<float>& x, int64_t M) {
  const int64_t N = W.rows, K = W.cols, B = cpu::kQuantActBlock;
  const std::vector<float> w = focus::dequantize_all(W);
  Expect e;
  e.exact.assign((size_t)(M * N), 0.0);
  e.quant.assign((size_t)(M * N), 0.0);
  e.rounding.assign((size_t)(M * N), 0.0);
  const bool flt = is_float_type(W.type);
  // Types whose quants carry a fixed offset (Q8_0's kernels may add 128 to make them unsigned and
  // take 128 d * sum(x) off again; Q4_0's -8 d, Q5_0's -16 d): the rounding of that cancellation
  // scales with offset * |d| even where every weight of the block is 0.
  const double offset = W.type == GGMLType::Q8_0 ? 128 : W.type == GGMLType::Q5_0 ? 16 : W.type == GGMLType::Q4_0 ? 8 : 0;
  const size_t rb = focus::io::row_bytes(W.type, K), bb = flt ? 0 : focus::io::type_block_bytes(W.type);
  std::vector<float> d((size_t)(K / B));
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x.data() + m * K;
    if (!flt) cpu::quantize_activation_scales(xr, K, d.data());
    for (int64_t n = 0; n < N; ++n) {
      const float* wr = w.data() + n * K;
      double s = 0, q = 0, r = 0;
      for (int64_t k = 0; k < K; ++k) s += (double)wr[k] * xr[k];
      if (flt) {
        for (int64_t k = 0; k < K; ++k) r += std::fabs((double)wr[k] * xr[k]);
      } else {
        for (int64_t b = 0; b < K / B; ++b) {
          double sw = 0, amax = 0;
          for (int64_t k = b * B; k < (b + 1) * B; ++k) {
            sw += std::fabs(wr[k]);
            amax = std::max(amax, (double)std::fabs(wr[k]));
          }
          if (offset > 0) {  // blocks of 32 (= B), the fp16 d first
            const uint8_t* blk = (const uint8_t*)W.data + (size_t)n * rb + (size_t)b * bb;
            amax = std::max(amax, offset * std::fabs((double)focus::io::fp16_to_fp32((uint16_t)(blk[0] | blk[1] << 8))));
          }
          q += d[b] / 2.0 * sw;
          for (int64_t k = b * B; k < (b + 1) * B; ++k) r += amax * (std::fabs(xr[k]) + d[b]);
        }
      }
      e.exact[m * N + n] = s;
      e.quant[m * N + n] = q;
      e.rounding[m * N + n] = 1e-5 * r + 1e-30;
    }
  }
  return e;
}

struct Case {
  GGMLType type;
  int64_t rows, cols;
};

std::vector<Case> cases_for(GGMLType t) {
  const bool k = focus::io::type_block_elems(t) == 256;
  std::vector<Case> c = {{t, 37, 256}, {t, 577, 1536}, {t, 3, 256}};
  if (!k) {
    c.push_back({t, 577, 576});
    c.push_back({t, 5, 96});  // three blocks: one partial step of the four- and two-block kernels
    c.push_back({t, 6, 32});
    c.push_back({t, 9, 224});
  }
  else c.push_back({t, 41, 2560});
  if (is_float_type(t)) c.push_back({t, 19, 100});  // a row length that is no multiple of the vector width
  return c;
}

const GGMLType kTypes[] = {GGMLType::F32,  GGMLType::F16,  GGMLType::BF16, GGMLType::Q4_0, GGMLType::Q4_1,
                           GGMLType::Q5_0, GGMLType::Q5_1, GGMLType::Q8_0, GGMLType::Q2_K, GGMLType::Q3_K,
                           GGMLType::Q4_K, GGMLType::Q5_K, GGMLType::Q6_K};

class QuantMatvecType : public ::testing::TestWithParam<GGMLType> {};

// Every instruction set, every M: within the bound of the exact product.
TEST_P(QuantMatvecType, WithinBoundOfExactProduct) {
  IsaGuard guard;
  std::mt19937 rng(1234 + (int)GetParam());
  for (const Case& c : cases_for(GetParam())) {
    const std::vector<uint8_t> bytes = random_weight(c.type, c.rows, c.cols, rng);
    const Weight W{c.type, c.rows, c.cols, bytes.data()};
    for (int64_t M : {1, 3, 8}) {
      const std::vector<float> x = random_x(M, c.cols, rng);
      const Expect e = reference(W, x, M);
      for (const std::string& isa : supported_isas()) {
        ASSERT_TRUE(cpu::set_quant_isa(isa));
        std::vector<float> y((size_t)(M * c.rows), NAN);
        cpu::quant_matvec(x.data(), W, y.data(), M);
        double worst = 0;  // largest error as a fraction of the bound
        for (size_t i = 0; i < y.size(); ++i) {
          const double err = std::fabs((double)y[i] - e.exact[i]), bound = e.quant[i] + e.rounding[i];
          ASSERT_LE(err, bound) << focus::io::type_name(c.type) << " " << c.rows << "x" << c.cols << " M " << M
                                << " " << isa << " output " << i << ": " << y[i] << " vs " << e.exact[i];
          worst = std::max(worst, err / bound);
        }
        EXPECT_GT(worst, 0.0);
      }
    }
  }
}

// The integer GEMM of prefill, on every instruction set that has one: within the same bound of
// the exact product, and equal to quant_matvec on the same rows up to rounding (same quantised
// activations, same terms), for M that are and are not multiples of its tiles (6 tokens with
// AVX-512, 2 with AVX2) and row counts that are not multiples of its 32-row panels or of AVX2's
// 16-row halves. The activations include rows at the int8 extremes (every q = +127, every q = -127)
// against weights at their own extremes, where AVX2's 16-bit pair sums are closest to overflow.
TEST_P(QuantMatvecType, GemmWithinBoundAndAgreesWithMatvec) {
  IsaGuard guard;
  const auto isas = gemm_isas();
  if (isas.empty()) GTEST_SKIP() << "this CPU has neither AVX-512 VNNI nor AVX2";
  std::mt19937 rng(777 + (int)GetParam());
  std::vector<Case> cases = cases_for(GetParam());
  if (!is_float_type(GetParam())) cases.push_back({GetParam(), 21, 512});  // a second half of 5 rows
  for (const std::string& isa : isas) {
    ASSERT_TRUE(cpu::set_quant_isa(isa));
    bool any = false;
    for (const Case& c : cases) {
      for (bool extreme : {false, true}) {
        const std::vector<uint8_t> bytes =
            extreme ? extreme_weight(c.type, c.rows, c.cols, rng) : random_weight(c.type, c.rows, c.cols, rng);
        const Weight W{c.type, c.rows, c.cols, bytes.data()};
        if (!cpu::quant_gemm_supported(W)) {
          EXPECT_TRUE(is_float_type(c.type)) << focus::io::type_name(c.type) << " has no integer GEMM on " << isa;
          continue;
        }
        any = true;
        for (int64_t M : {1, 6, 13, 40}) {
          std::vector<float> x = random_x(M, c.cols, rng);
          if (extreme)
            for (int64_t m = 0; m < M; ++m)
              for (int64_t k = 0; k < c.cols; ++k) x[m * c.cols + k] = m % 3 == 0 ? 1.f : m % 3 == 1 ? -1.f : x[m * c.cols + k];
          const Expect e = reference(W, x, M);
          std::vector<float> y((size_t)(M * c.rows), NAN), ref((size_t)(M * c.rows), NAN);
          cpu::quant_gemm(x.data(), W, y.data(), M);
          cpu::quant_matvec(x.data(), W, ref.data(), M);
          for (size_t i = 0; i < y.size(); ++i) {
            const std::string where = isa + " " + focus::io::type_name(c.type) + (extreme ? " extreme " : " ") +
                                      std::to_string(c.rows) + "x" + std::to_string(c.cols) + " M " +
                                      std::to_string(M) + " output " + std::to_string(i);
            ASSERT_LE(std::fabs((double)y[i] - e.exact[i]), e.quant[i] + e.rounding[i]) << where;
            ASSERT_LE(std::fabs((double)y[i] - ref[i]), 2 * e.rounding[i]) << where << ": " << y[i] << " vs " << ref[i];
          }
        }
      }
    }
    EXPECT_EQ(any, !is_float_type(GetParam())) << isa;
  }
}

// The instruction sets use the same quantised activations, so they differ by rounding only.
TEST_P(QuantMatvecType, InstructionSetsAgree) {
  IsaGuard guard;
  const auto isas = supported_isas();
  std::mt19937 rng(99 + (int)GetParam());
  for (const Case& c : cases_for(GetParam())) {
    const std::vector<uint8_t> bytes = random_weight(c.type, c.rows, c.cols, rng);
    const Weight W{c.type, c.rows, c.cols, bytes.data()};
    const int64_t M = 3;
    const std::vector<float> x = random_x(M, c.cols, rng);
    const Expect e = reference(W, x, M);
    std::vector<std::vector<float>> ys;
    for (const std::string& isa : isas) {
      ASSERT_TRUE(cpu::set_quant_isa(isa));
      ys.emplace_back((size_t)(M * c.rows));
      cpu::quant_matvec(x.data(), W, ys.back().data(), M);
    }
    for (size_t j = 1; j < ys.size(); ++j)
      for (size_t i = 0; i < ys[0].size(); ++i)
        ASSERT_LE(std::fabs((double)ys[j][i] - ys[0][i]), 2 * e.rounding[i])
            << focus::io::type_name(c.type) << " " << isas[0] << " vs " << isas[j] << " output " << i;
  }
}

// M rows at once give exactly the M single-row results, and one thread the same as several.
TEST_P(QuantMatvecType, BatchEqualsSingleRows) {
  IsaGuard guard;
  std::mt19937 rng(7 + (int)GetParam());
  const GGMLType t = GetParam();
  const int64_t rows = 577, cols = focus::io::type_block_elems(t) == 256 ? 1536 : 576;
  const std::vector<uint8_t> bytes = random_weight(t, rows, cols, rng);
  const Weight W{t, rows, cols, bytes.data()};
  for (const std::string& isa : supported_isas()) {
    ASSERT_TRUE(cpu::set_quant_isa(isa));
    for (int64_t M : {3, 8, 13}) {
      const std::vector<float> x = random_x(M, cols, rng);
      std::vector<float> y((size_t)(M * rows)), y1((size_t)rows);
      cpu::quant_matvec(x.data(), W, y.data(), M);
      for (int64_t m = 0; m < M; ++m) {
        cpu::quant_matvec(x.data() + m * cols, W, y1.data(), 1);
        ASSERT_EQ(0, std::memcmp(y1.data(), y.data() + m * rows, sizeof(float) * (size_t)rows))
            << focus::io::type_name(t) << " " << isa << " M " << M << " row " << m;
      }
      // One thread (the products above are split between threads when there are several).
      const int threads = omp_get_max_threads();
      omp_set_num_threads(1);
      std::vector<float> ys((size_t)(M * rows));
      cpu::quant_matvec(x.data(), W, ys.data(), M);
      omp_set_num_threads(threads);
      ASSERT_EQ(0, std::memcmp(ys.data(), y.data(), sizeof(float) * ys.size()))
          << focus::io::type_name(t) << " " << isa << " M " << M << ": one thread differs";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(QuantMatvec, QuantMatvecType, ::testing::ValuesIn(kTypes),
                         [](const ::testing::TestParamInfo<GGMLType>& i) { return focus::io::type_name(i.param); });

TEST(QuantMatvec, IsaSelection) {
  IsaGuard guard;
  EXPECT_TRUE(cpu::quant_isa_supported("generic"));
  EXPECT_FALSE(cpu::set_quant_isa("sse9"));
  const std::string before = cpu::quant_isa();
  for (const char* n : kIsas) {
    if (cpu::quant_isa_supported(n)) {
      EXPECT_TRUE(cpu::set_quant_isa(n));
      EXPECT_STREQ(n, cpu::quant_isa());
    } else {
      EXPECT_FALSE(cpu::set_quant_isa(n));
    }
  }
  EXPECT_TRUE(cpu::set_quant_isa("best"));
  EXPECT_TRUE(cpu::quant_isa_supported(cpu::quant_isa()));
}

TEST(QuantMatvec, ActivationScales) {
  std::vector<float> x(64, 0.f), d(2);
  x[5] = -2.54f;
  x[40] = 1.27f;
  cpu::quantize_activation_scales(x.data(), 64, d.data());
  EXPECT_EQ(d[0], 2.54f / 127.f);
  EXPECT_EQ(d[1], 1.27f / 127.f);
}

// Products of one x by several weights in one call (quant_matvec_multi) give the bits of separate
// quant_matvec calls: weights of types whose kernels read different activation layouts (and a
// float type) in one call, row counts off the 16-row chunks, on one thread and on several.
TEST(QuantMatvec, MultiEqualsSeparateProducts) {
  IsaGuard guard;
  std::mt19937 rng(21);
  const int64_t cols = 768;
  const std::vector<std::pair<GGMLType, int64_t>> parts = {
      {GGMLType::Q4_1, 577}, {GGMLType::Q8_0, 33}, {GGMLType::Q4_K, 250}, {GGMLType::F16, 17}, {GGMLType::Q4_1, 191}};
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<Weight> Ws;
  for (const auto& [t, rows] : parts) bytes.push_back(random_weight(t, rows, cols, rng));
  for (size_t i = 0; i < parts.size(); ++i) Ws.push_back(Weight{parts[i].first, parts[i].second, cols, bytes[i].data()});
  const int threads = omp_get_max_threads();
  for (const std::string& isa : supported_isas()) {
    ASSERT_TRUE(cpu::set_quant_isa(isa));
    for (int64_t M : {1, 2, 5}) {
      const std::vector<float> x = random_x(M, cols, rng);
      for (int th : {1, 2, 3}) {
        omp_set_num_threads(th);
        std::vector<std::vector<float>> sep, multi;
        std::vector<cpu::MatvecOut> outs;
        for (const Weight& W : Ws) {
          sep.emplace_back((size_t)(M * W.rows));
          multi.emplace_back((size_t)(M * W.rows), NAN);
          cpu::quant_matvec(x.data(), W, sep.back().data(), M);
        }
        for (size_t i = 0; i < Ws.size(); ++i) outs.push_back({&Ws[i], multi[i].data()});
        cpu::quant_matvec_multi(x.data(), outs.data(), (int)outs.size(), M);
        for (size_t i = 0; i < Ws.size(); ++i)
          ASSERT_EQ(0, std::memcmp(sep[i].data(), multi[i].data(), sizeof(float) * sep[i].size()))
              << isa << " M " << M << " threads " << th << " weight " << i << " ("
              << focus::io::type_name(Ws[i].type) << ")";
      }
      omp_set_num_threads(threads);
    }
  }
  // A weight of another width is refused.
  const Weight narrow{GGMLType::Q8_0, 4, 32, bytes[1].data()};
  std::vector<float> x(cols, 1.f), y0(577), y1(4);
  const cpu::MatvecOut bad[2] = {{&Ws[0], y0.data()}, {&narrow, y1.data()}};
  EXPECT_THROW(cpu::quant_matvec_multi(x.data(), bad, 2, 1), std::exception);
}

// M = 0 writes nothing; a single-block weight with all-ones activations (quantised exactly).
TEST(QuantMatvec, ZeroAndTinyShapes) {
  const std::vector<uint8_t> bytes = [] {
    std::mt19937 rng(5);
    return random_weight(GGMLType::Q8_0, 1, 32, rng);
  }();
  const Weight W{GGMLType::Q8_0, 1, 32, bytes.data()};
  std::vector<float> x(32, 1.f), y(1, NAN);
  cpu::quant_matvec(x.data(), W, y.data(), 0);  // M = 0: nothing written
  EXPECT_TRUE(std::isnan(y[0]));
  cpu::quant_matvec(x.data(), W, y.data(), 1);
  const std::vector<float> w = focus::dequantize_all(W);
  double s = 0;
  for (float v : w) s += v;
  EXPECT_NEAR(y[0], s, 1e-4 * std::fabs(s) + 1e-6);  // all-ones x quantises exactly
}

}  // namespace

// Scoring fused with the integer GEMM: the log-softmax at the targets of the logits quant_gemm
// computes, over output rows that span several 2048-row blocks and end in a partial panel, with
// row counts off its 48-row chunks; the same for one thread and several; a NaN activation row
// gives a NaN (and only that row).
namespace {

// The float64 log-softmax of a row of n logits at target.
double ref_log_prob(const float* row, int64_t n, int64_t target) {
  double mx = row[0], s = 0;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, (double)row[i]);
  for (int64_t i = 0; i < n; ++i) s += std::exp((double)row[i] - mx);
  return (double)row[target] - mx - std::log(s);
}

// f(a.data()) on 3 threads, then f(b.data()) on 1.
template <class F>
void on_3_then_1_thread(F f, std::vector<double>& a, std::vector<double>& b) {
  const int saved = focus::num_threads();
  focus::set_threads(3);
  f(a.data());
  focus::set_threads(1);
  f(b.data());
  focus::set_threads(saved);
}

}  // namespace

TEST(QuantGemmLogSoftmax, EqualsLogSoftmaxOfTheGemmLogits) {
  IsaGuard guard;
  const auto isas = gemm_isas();
  if (isas.empty()) GTEST_SKIP() << "this CPU has neither AVX-512 VNNI nor AVX2";
  std::mt19937 rng(4242);
  for (const std::string& isa : isas)
  for (GGMLType t : {GGMLType::Q8_0, GGMLType::Q4_K}) {
    ASSERT_TRUE(cpu::set_quant_isa(isa));
    const int64_t rows = 2 * 2048 + 37, cols = 256;
    const std::vector<uint8_t> bytes = random_weight(t, rows, cols, rng);
    const Weight W{t, rows, cols, bytes.data()};
    ASSERT_TRUE(cpu::quant_gemm_supported(W));
    for (int64_t M : {1, 50, 97}) {
      std::vector<float> x = random_x(M, cols, rng);
      for (float& v : x) v *= 4.f;  // logits spread over several nats
      std::vector<int32_t> tg(M);
      for (int64_t m = 0; m < M; ++m) tg[m] = (int32_t)((m * 1237 + 11) % rows);
      tg[0] = (int32_t)rows - 1;  // in the partial last panel
      std::vector<float> logits((size_t)(M * rows));
      cpu::quant_gemm(x.data(), W, logits.data(), M);
      std::vector<double> lp(M), lp1(M);
      on_3_then_1_thread([&](double* out) { cpu::quant_gemm_log_softmax(x.data(), W, M, tg.data(), out); }, lp, lp1);
      for (int64_t m = 0; m < M; ++m) {
        const double ref = ref_log_prob(logits.data() + m * rows, rows, tg[m]);
        ASSERT_NEAR(lp[m], ref, 1e-6 * (1 + std::fabs(ref))) << focus::io::type_name(t) << " M " << M << " row " << m;
        ASSERT_EQ(lp1[m], lp[m]) << "thread count changed row " << m;
      }
      if (M > 1) {
        x[cols + 3] = NAN;  // row 1
        cpu::quant_gemm_log_softmax(x.data(), W, M, tg.data(), lp.data());
        EXPECT_TRUE(std::isnan(lp[1]));
        EXPECT_TRUE(std::isfinite(lp[0]));
      }
    }
  }
}

// The float path of scoring (linear_log_prob: tiles of the weight dequantised once, chunks of rows
// through sgemm, per-tile maxima and sums merged) against the float64 log-softmax of linear()'s
// float32 logits: several tiles with a partial last one, one and several row chunks, targets in every
// tile; on 1 and 3 threads (sgemm's rounding may depend on its threads); a NaN row gives NaN alone; a bad target is refused.
TEST(LinearLogProb, EqualsLogSoftmaxOfTheLinearLogits) {
  std::mt19937 rng(777);
  for (GGMLType t : {GGMLType::Q8_0, GGMLType::Q4_1, GGMLType::F32}) {
    const int64_t rows = t == GGMLType::F32 ? 2 * 4096 + 29 : 2 * 8192 + 37, cols = 256;
    const std::vector<uint8_t> bytes = random_weight(t, rows, cols, rng);
    const Weight W{t, rows, cols, bytes.data()};
    for (int64_t M : {1, 300}) {
      std::vector<float> x = random_x(M, cols, rng);
      for (float& v : x) v *= 4.f;
      std::vector<int32_t> tg(M);
      for (int64_t m = 0; m < M; ++m) tg[m] = (int32_t)((m * 7919 + 5) % rows);
      tg[0] = (int32_t)rows - 1;  // in the partial last tile
      std::vector<float> logits((size_t)(M * rows)), wf((size_t)(rows * cols));
      focus::dequantize_rows(W, 0, rows, wf.data());
      cpu::linear(x.data(), wf.data(), nullptr, logits.data(), M, cols, rows);
      std::vector<double> lp(M), lp1(M);
      on_3_then_1_thread([&](double* out) { cpu::linear_log_prob(x.data(), W, M, tg.data(), out); }, lp, lp1);
      for (int64_t m = 0; m < M; ++m) {
        const double ref = ref_log_prob(logits.data() + m * rows, rows, tg[m]);
        ASSERT_NEAR(lp[m], ref, 2e-6 * (1 + std::fabs(ref))) << focus::io::type_name(t) << " M " << M << " row " << m;
        ASSERT_NEAR(lp1[m], ref, 2e-6 * (1 + std::fabs(ref))) << "1 thread, row " << m;
      }
      if (M > 1) {
        x[cols + 3] = NAN;  // row 1
        cpu::linear_log_prob(x.data(), W, M, tg.data(), lp.data());
        EXPECT_TRUE(std::isnan(lp[1]));
        EXPECT_TRUE(std::isfinite(lp[0]) && std::isfinite(lp[2]));
      }
      tg[M - 1] = (int32_t)rows;
      EXPECT_THROW(cpu::linear_log_prob(x.data(), W, M, tg.data(), lp.data()), std::exception);
    }
  }
}

// Rounding activations to int8 would hide a NaN or an infinity: the row that holds one gives NaN
// outputs in the matrix-vector kernels (every instruction set) and the integer GEMM, the other
// rows their usual values.
TEST(QuantMatvecNaN, NonFiniteActivationRowsGiveNaN) {
  IsaGuard guard;
  std::mt19937 rng(31);
  for (GGMLType t : {GGMLType::Q8_0, GGMLType::Q4_1, GGMLType::Q6_K}) {
    const int64_t rows = 40, cols = 256, M = 3;
    const std::vector<uint8_t> bytes = random_weight(t, rows, cols, rng);
    const Weight W{t, rows, cols, bytes.data()};
    for (float bad : {NAN, INFINITY}) {
      std::vector<float> x = random_x(M, cols, rng);
      x[cols + 17] = bad;  // row 1
      for (const std::string& isa : supported_isas()) {
        ASSERT_TRUE(cpu::set_quant_isa(isa));
        std::vector<float> y((size_t)(M * rows));
        cpu::quant_matvec(x.data(), W, y.data(), M);
        for (int64_t n = 0; n < rows; ++n) {
          EXPECT_TRUE(std::isnan(y[rows + n])) << isa << " " << focus::io::type_name(t) << " output " << n;
          EXPECT_TRUE(std::isfinite(y[n]) && std::isfinite(y[2 * rows + n])) << isa;
        }
        if (isa != "generic" && cpu::quant_gemm_supported(W)) {
          cpu::quant_gemm(x.data(), W, y.data(), M);
          for (int64_t n = 0; n < rows; ++n) {
            EXPECT_TRUE(std::isnan(y[rows + n])) << "gemm " << focus::io::type_name(t) << " output " << n;
            EXPECT_TRUE(std::isfinite(y[n]) && std::isfinite(y[2 * rows + n])) << "gemm";
          }
        }
      }
    }
  }
}
