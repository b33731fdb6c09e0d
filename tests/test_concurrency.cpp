// The library is safe to share read-only: two threads running inference on one loaded model,
// each with its own KV cache, get bit for bit what each gets alone (every kernel's scratch is
// per thread; the model, the weights and the memory-mapped file are only read).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/threads.h"
#include "model/model.h"
#include "test_util.h"

using namespace focus;

namespace {

// Prefill of `prompt`, then `steps` tokens decoded greedily; the hidden states of every step.
std::vector<float> run(const Model& m, std::vector<int32_t> ids, int64_t steps, cpu::KvType kv) {
  const int64_t D = m.cfg.dim, P = (int64_t)ids.size();
  KVCache cache;
  cache.init(m.cfg, P + steps, kv);
  std::vector<float> out, hidden(P * D), logits(m.cfg.vocab);
  forward(m, ids.data(), P, cache, hidden.data());
  out.insert(out.end(), hidden.begin(), hidden.end());
  for (int64_t s = 0; s < steps; ++s) {
    compute_logits(m, hidden.data() + (s == 0 ? (P - 1) * D : 0), 1, logits.data());
    const int32_t next = (int32_t)(std::max_element(logits.begin(), logits.end()) - logits.begin());
    forward(m, &next, 1, cache, hidden.data());
    out.insert(out.end(), hidden.begin(), hidden.begin() + D);
  }
  return out;
}

void check_shared(const Model& m, cpu::KvType kv) {
  const int64_t V = m.cfg.vocab;
  std::vector<int32_t> a(40), b(57);
  for (size_t i = 0; i < a.size(); ++i) a[i] = (int32_t)((i * 31 + 7) % V);
  for (size_t i = 0; i < b.size(); ++i) b[i] = (int32_t)((i * 17 + 3) % V);
  const int64_t steps = test::small_shapes() ? 4 : 12;  // decoding steps after the prefill
  const std::vector<float> ra = run(m, a, steps, kv), rb = run(m, b, steps, kv);
  for (int round = 0; round < 3; ++round) {
    std::vector<float> ta, tb;
    std::thread x([&] { ta = run(m, a, steps, kv); });
    std::thread y([&] { tb = run(m, b, steps, kv); });
    x.join();
    y.join();
    ASSERT_EQ(ta.size(), ra.size());
    ASSERT_EQ(tb.size(), rb.size());
    EXPECT_EQ(std::memcmp(ta.data(), ra.data(), ra.size() * sizeof(float)), 0) << "thread A, round " << round;
    EXPECT_EQ(std::memcmp(tb.data(), rb.data(), rb.size() * sizeof(float)), 0) << "thread B, round " << round;
  }
}

}  // namespace

TEST(Concurrency, TwoThreadsShareAStories260KModel) {
  FOCUS_NEED_FILE(test::stories());
  auto m = load_model(test::stories(), LoadOptions{test::tok512()});
  check_shared(*m, cpu::KvType::F32);
  check_shared(*m, cpu::KvType::F16);
}

// Native quantised weights (views of the mapped GGUF file, the int8 matrix-vector kernels).
TEST(Concurrency, TwoThreadsShareASmolLM2ModelWithNativeWeights) {
  FOCUS_NEED_FILE(test::smollm2_path());
  auto m = load_model(test::smollm2_path());
  check_shared(*m, cpu::KvType::F16);
}

// parallel_for_checked: every iteration runs once, on the threads or (not parallel) on the caller;
// an iteration's exception reaches the caller after the others have run, as the same error.
TEST(Concurrency, ParallelForCheckedRunsEveryIterationAndRethrows) {
  for (bool par : {false, true}) {
    std::vector<int> runs(37, 0);
    parallel_for_checked(37, par, [&](int64_t i) { runs[i]++; });
    EXPECT_EQ(std::count(runs.begin(), runs.end(), 1), 37) << par;
    std::fill(runs.begin(), runs.end(), 0);
    try {
      parallel_for_checked(37, par, [&](int64_t i) {
        if (i == 5) FOCUS_CHECK(false, "iteration ", i, " failed");
        runs[i]++;
      });
      ADD_FAILURE() << "no exception";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("iteration 5 failed"), std::string::npos) << e.what();
    }
    if (par) {
      EXPECT_EQ(std::count(runs.begin(), runs.end(), 1), 36);  // the others all ran
    }
  }
}
