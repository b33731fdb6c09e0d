// The flash-style dense kernel against the obviously-correct reference.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/threads.h"
#include "kernels/cpu/attention.h"

using focus::cpu::AttnShape;

namespace {

struct Case {
  int64_t n_q, n_kv, heads, kv_heads, hd, window;
  int64_t q_pos0 = -1;  // -1: n_kv - n_q (the queries are the last rows of the cache)
  int64_t pad = 0;      // extra floats at the end of every q, k, v and o row
};

struct Inputs {
  std::vector<float> q, k, v;
  AttnShape s;
};

Inputs make_inputs(const Case& c) {
  std::mt19937 rng(1234 + c.n_q * 7 + c.hd);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int64_t q_stride = c.heads * c.hd + c.pad, kv_stride = c.kv_heads * c.hd + c.pad;
  Inputs in;
  in.q.resize(c.n_q * q_stride);
  in.k.resize(c.n_kv * kv_stride);
  in.v.resize(c.n_kv * kv_stride);
  for (auto& x : in.q) x = nd(rng);
  for (auto& x : in.k) x = nd(rng);
  for (auto& x : in.v) x = nd(rng);
  const int64_t pos0 = c.q_pos0 >= 0 ? c.q_pos0 : c.n_kv - c.n_q;
  in.s = AttnShape{c.n_q,    c.n_kv,    pos0,     c.heads, c.kv_heads, c.hd, q_stride, kv_stride, q_stride,
                   1.0f / std::sqrt((float)c.hd), c.window};
  return in;
}

void run_case(const Case& c) {
  const Inputs in = make_inputs(c);
  const AttnShape& s = in.s;
  constexpr float kCanary = 12345.f;  // the padding of the output rows must stay untouched
  std::vector<float> o1(in.q.size(), kCanary), o2(in.q.size()), l1(c.heads * c.n_q), l2(c.heads * c.n_q);
  focus::cpu::flash_attention(in.q.data(), in.k.data(), in.v.data(), o1.data(), l1.data(), s);
  focus::cpu::attention_reference(in.q.data(), in.k.data(), in.v.data(), o2.data(), l2.data(), s);
  double max_err = 0;
  for (int64_t t = 0; t < c.n_q; ++t) {
    for (int64_t i = 0; i < c.heads * c.hd; ++i)
      max_err = std::max(max_err, (double)std::fabs(o1[t * s.o_stride + i] - o2[t * s.o_stride + i]));
    for (int64_t i = c.heads * c.hd; i < s.o_stride; ++i) ASSERT_EQ(o1[t * s.o_stride + i], kCanary);
  }
  EXPECT_LT(max_err, 2e-5) << "n_q " << c.n_q << " n_kv " << c.n_kv << " pos0 " << s.q_pos0 << " heads " << c.heads
                           << "/" << c.kv_heads << " hd " << c.hd << " window " << c.window;
  for (size_t i = 0; i < l1.size(); ++i) {
    if (std::isinf(l2[i]))
      ASSERT_EQ(l1[i], l2[i]) << i;  // a row without visible keys
    else
      ASSERT_NEAR(l1[i], l2[i], 1e-4 * (1 + std::fabs(l2[i])));
  }
}

// Output and lse of flash_attention, rows [t0, t0 + n) of a case computed as one call (queries
// at positions pos0 + t0 .., keys up to the last of them, as a model's KV cache has).
struct Out {
  std::vector<float> o, lse;
};
Out run_rows(const Inputs& in, int64_t t0, int64_t n) {
  AttnShape s = in.s;
  s.n_q = n;
  s.q_pos0 = in.s.q_pos0 + t0;
  s.n_kv = std::min(in.s.n_kv, s.q_pos0 + n);
  Out r{std::vector<float>(n * s.o_stride), std::vector<float>(s.heads * n)};
  focus::cpu::flash_attention(in.q.data() + t0 * s.q_stride, in.k.data(), in.v.data(), r.o.data(), r.lse.data(), s);
  return r;
}

// Every row's bits are the same whether it is computed in one prefill call, token by token or
// in uneven chunks.
void check_batching_invariance(const Case& c) {
  const Inputs in = make_inputs(c);
  const AttnShape& s = in.s;
  const Out all = run_rows(in, 0, c.n_q);
  auto same_rows = [&](const Out& part, int64_t t0, int64_t n, const char* what) {
    for (int64_t t = 0; t < n; ++t) {
      ASSERT_EQ(std::memcmp(part.o.data() + t * s.o_stride, all.o.data() + (t0 + t) * s.o_stride,
                            s.heads * s.head_dim * sizeof(float)),
                0)
          << what << ": row " << t0 + t << " heads " << c.heads << "/" << c.kv_heads << " hd " << c.hd << " window "
          << c.window;
      for (int64_t h = 0; h < s.heads; ++h)
        ASSERT_EQ(std::memcmp(&part.lse[h * n + t], &all.lse[h * c.n_q + t0 + t], sizeof(float)), 0) << what;
    }
  };
  for (int64_t t = 0; t < c.n_q; ++t)  // a sample of rows: tile edges, the ends and every 9th
    if (t % 9 == 0 || t % 64 == 63 || t % 64 == 0 || t < 3 || t + 3 >= c.n_q) same_rows(run_rows(in, t, 1), t, 1, "decode");
  for (int64_t t0 = 0, n = 3; t0 < c.n_q; t0 += n, n = n * 2 + 7) {
    const int64_t m = std::min(n, c.n_q - t0);
    same_rows(run_rows(in, t0, m), t0, m, "chunk");
  }
}

}  // namespace

TEST(FlashAttention, MatchesReferenceAcrossShapes) {
  for (int64_t n : {1, 7, 63, 64, 65, 130, 300})
    for (int64_t hd : {8, 64, 80})
      for (int64_t w : {0, 1, 16, 100}) run_case({n, n, 4, 2, hd, w});
}

TEST(FlashAttention, GqaMqaAndDecodeRows) {
  run_case({200, 200, 8, 1, 64, 0});     // MQA
  run_case({200, 200, 8, 8, 64, 0});     // MHA
  run_case({1, 500, 9, 3, 64, 0});       // one decode row against a long cache
  run_case({5, 300, 4, 1, 256, 128});    // Gemma-sized heads, sliding window
}

TEST(FlashAttention, PrefillAfterACacheAndDecode) {
  for (int64_t kvh : {8, 2, 1})  // MHA, GQA 8/2, MQA 8/1
    for (int64_t w : {0, 50, 64}) {
      run_case({150, 401, 8, kvh, 64, w});  // 150 rows at positions 251 .., several query tiles
      run_case({1, 401, 8, kvh, 64, w});    // T = 1 decode
      run_case({1, 1, 8, kvh, 64, w});      // the very first token
      run_case({1, 130, 8, kvh, 80, w});    // decode with head_dim not a multiple of 16
      run_case({64, 129, 8, kvh, 80, w});   // one full query tile not aligned with the key tiles
    }
}

TEST(FlashAttention, StridesRowsBeyondTheCacheAndEmptyRows) {
  run_case({70, 200, 4, 2, 64, 0, -1, 5});   // padded rows (all four strides larger than a row)
  run_case({3, 300, 8, 8, 24, 20, -1, 3});   // decode-sized, padded, head_dim 24
  run_case({100, 40, 4, 1, 64, 0, 0});       // queries at positions past the last key
  run_case({100, 40, 4, 4, 32, 30, 0});      // ... with a window: rows 70 .. have no key
  run_case({20, 10, 4, 2, 64, 5, 50});       // no row sees any key: zeros and -inf
  run_case({20, 0, 4, 2, 64, 0, 0});         // empty cache
}

TEST(FlashAttention, RowsDoNotDependOnBatching) {
  check_batching_invariance({150, 150, 8, 8, 64, 0});
  check_batching_invariance({150, 150, 8, 2, 64, 0});
  check_batching_invariance({150, 150, 8, 1, 64, 40});
  check_batching_invariance({140, 140, 4, 4, 80, 0});
  check_batching_invariance({140, 140, 4, 1, 80, 70});
  check_batching_invariance({100, 300, 4, 2, 64, 0});  // after a filled cache
}

TEST(FlashAttention, SameBitsForAnyThreadCount) {
  const int saved = focus::num_threads();
  for (const Case& c : {Case{300, 300, 8, 2, 64, 0}, Case{1, 700, 8, 8, 64, 0}, Case{1, 700, 8, 1, 64, 100},
                        Case{5, 500, 4, 4, 80, 0}}) {
    const Inputs in = make_inputs(c);
    std::vector<Out> outs;
    for (int threads : {1, 2, 3}) {
      focus::set_threads(threads);
      outs.push_back(run_rows(in, 0, c.n_q));
    }
    for (size_t i = 1; i < outs.size(); ++i) {
      EXPECT_EQ(std::memcmp(outs[i].o.data(), outs[0].o.data(), outs[0].o.size() * sizeof(float)), 0);
      EXPECT_EQ(std::memcmp(outs[i].lse.data(), outs[0].lse.data(), outs[0].lse.size() * sizeof(float)), 0);
    }
  }
  focus::set_threads(saved);
}
