// Focus through a whole model (stories260K): zero degradation by construction, causality in
// soft and hard mode, router files round-trip.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "core/error.h"
#include "core/mapped_file.h"
#include "eval/groups_report.h"
#include "focus/focus_attention.h"
#include "focus/focus_model.h"
#include "kernels/cpu/sparse_attention.h"
#include "model/model.h"
#include "test_util.h"

using namespace focus;
using focus::test::book;
using focus::test::stories;
using focus::test::tok512;

namespace {


std::vector<float> run(const Model& m, const std::vector<int32_t>& ids, const FocusRouters* f) {
  KVCache c;
  c.init(m.cfg, (int64_t)ids.size());
  std::vector<float> h(ids.size() * m.cfg.dim);
  const AttentionPlan plan = f ? focus_plan(m.cfg, *f) : AttentionPlan{};
  forward(m, ids.data(), (int64_t)ids.size(), c, h.data(), f ? &plan : nullptr);
  return h;
}

std::vector<int32_t> some_ids(int64_t n, int64_t vocab, int seed) {
  std::vector<int32_t> ids(n);
  for (int64_t i = 0; i < n; ++i) ids[i] = (int32_t)((i * 131 + seed * 17 + 7) % vocab);
  ids[0] = 1;
  return ids;
}

FocusRouters random_routers(const Model& m, FocusMode mode, int64_t window, int topk, int64_t groups = 4) {
  FocusSettings s;
  s.mode = mode;
  s.local_window = window;
  s.sinks = 1;
  s.groups = groups;
  s.dg = 16;
  s.topk = topk;
  s.tau = 0.5f;
  return focus_init(m.cfg, s, 42);
}

}  // namespace

TEST(FocusModel, ZeroDegradationWhenOffOrInsideTheWindow) {
  FOCUS_NEED_FILE(stories());
  auto m = load_model(stories(), LoadOptions{"", false});
  const auto ids = some_ids(100, m->cfg.vocab, 1);
  const auto plain = run(*m, ids, nullptr);
  for (FocusMode mode : {FocusMode::Off, FocusMode::Soft, FocusMode::Hard}) {
    // Off: any context. Soft / hard: the whole context fits in the window.
    FocusRouters f = random_routers(*m, mode, mode == FocusMode::Off ? 8 : 100, 1);
    const auto h = run(*m, ids, &f);
    ASSERT_EQ(h.size(), plain.size());
    EXPECT_EQ(std::memcmp(h.data(), plain.data(), h.size() * sizeof(float)), 0) << to_string(mode);
  }
}

TEST(FocusModel, PatternChangesOutputsBeyondTheWindow) {
  FOCUS_NEED_FILE(stories());
  auto m = load_model(stories(), LoadOptions{"", false});
  const auto ids = some_ids(200, m->cfg.vocab, 2);
  const auto plain = run(*m, ids, nullptr);
  FocusRouters f = random_routers(*m, FocusMode::Hard, 16, 1);
  const auto h = run(*m, ids, &f);
  const int64_t D = m->cfg.dim;
  // Rows inside the window see the same keys (another kernel, so up to rounding); later rows differ.
  for (int64_t i = 0; i < 16 * D; ++i) ASSERT_NEAR(h[i], plain[i], 1e-5) << i;
  double diff = 0;
  for (int64_t i = 100 * D; i < 200 * D; ++i) diff = std::max(diff, (double)std::fabs(h[i] - plain[i]));
  EXPECT_GT(diff, 1e-3);
}

TEST(FocusModel, OneGroupHardEqualsDenseAttention) {
  FOCUS_NEED_FILE(stories());
  auto m = load_model(stories(), LoadOptions{"", false});
  const auto ids = some_ids(300, m->cfg.vocab, 3);
  const auto plain = run(*m, ids, nullptr);
  FocusRouters f = random_routers(*m, FocusMode::Hard, 16, 1, 1);
  const auto h = run(*m, ids, &f);
  double err = 0;
  for (size_t i = 0; i < h.size(); ++i) err = std::max(err, (double)std::fabs(h[i] - plain[i]));
  EXPECT_LT(err, 1e-4);
}

TEST(FocusModel, CausalInSoftAndHardMode) {
  FOCUS_NEED_FILE(stories());
  auto m = load_model(stories(), LoadOptions{"", false});
  const int64_t N = 260, D = m->cfg.dim;
  for (FocusMode mode : {FocusMode::Soft, FocusMode::Hard, FocusMode::Window})
    for (int topk : {1, 2}) {
      if (mode != FocusMode::Hard && topk == 2) continue;
      FocusRouters f = random_routers(*m, mode, 16, topk);
      auto ids = some_ids(N, m->cfg.vocab, 4);
      const auto base = run(*m, ids, &f);
      for (int64_t j : {40, 150, 259}) {
        auto ids2 = ids;
        ids2[j] = (ids2[j] + 101) % (int32_t)m->cfg.vocab;
        const auto h = run(*m, ids2, &f);
        // Positions < j see only unchanged tokens: outputs identical, bit for bit.
        EXPECT_EQ(std::memcmp(h.data(), base.data(), j * D * sizeof(float)), 0)
            << to_string(mode) << " top-" << topk << " perturbing " << j;
        double d = 0;
        for (int64_t i = j * D; i < (j + 1) * D; ++i) d = std::max(d, (double)std::fabs(h[i] - base[i]));
        EXPECT_GT(d, 0) << "the perturbed position itself must change";
      }
    }
}

// Decoding with Focus: a prefix inside the window (plain kernel, routing recorded), a chunk, then
// one token at a time give the hidden states of one call over the whole sequence, in every mode.
TEST(FocusModel, DecodingFromTheCacheEqualsOneCall) {
  FOCUS_NEED_FILE(stories());
  auto m = load_model(stories(), LoadOptions{"", false});
  const int64_t n = 150, D = m->cfg.dim;
  const auto ids = some_ids(n, m->cfg.vocab, 3);
  for (auto [mode, topk] : {std::pair{FocusMode::Soft, 1}, std::pair{FocusMode::Hard, 1},
                            std::pair{FocusMode::Hard, 2}, std::pair{FocusMode::Window, 1}}) {
    FocusRouters f = random_routers(*m, mode, 16, topk, 8);
    const auto one = run(*m, ids, &f);
    KVCache c;
    c.init(m->cfg, n);
    std::vector<float> h(n * D);
    const AttentionPlan plan = focus_plan(m->cfg, f);
    forward(*m, ids.data(), 10, c, h.data(), &plan);
    forward(*m, ids.data() + 10, 57, c, h.data() + 10 * D, &plan);
    for (int64_t i = 67; i < n; ++i) forward(*m, ids.data() + i, 1, c, h.data() + i * D, &plan);
    double err = 0, scale = 0;
    for (int64_t i = 0; i < n * D; ++i) {
      err = std::max(err, (double)std::fabs(h[i] - one[i]));
      scale = std::max(scale, (double)std::fabs(one[i]));
    }
    EXPECT_LE(err, 1e-5 * scale) << to_string(mode) << " top-" << topk;
    // The pattern matters from the cache too: the same steps without routers differ.
    if (mode == FocusMode::Hard) {
      const auto plain = run(*m, ids, nullptr);
      double d = 0;
      for (int64_t i = 0; i < n * D; ++i) d = std::max(d, (double)std::fabs(h[i] - plain[i]));
      EXPECT_GT(d, 1e-3 * scale);
    }
  }
  // A cache filled without routers has no routing to decode from.
  FocusRouters f = random_routers(*m, FocusMode::Hard, 16, 1, 8);
  KVCache c;
  c.init(m->cfg, n);
  std::vector<float> h(n * D);
  forward(*m, ids.data(), 40, c, h.data());
  const AttentionPlan plan = focus_plan(m->cfg, f);
  EXPECT_THROW(forward(*m, ids.data() + 40, 1, c, h.data(), &plan), Error);
}

TEST(FocusModel, ForwardFreesLargeAttentionScratchAndKeepsSmall) {
  FOCUS_NEED_FILE(stories());
  auto m = load_model(stories(), LoadOptions{"", false});
  // Grow this thread's kernel scratch past forward's limit, as a long prefill does: the two-call
  // path's second output alone is n * heads * head_dim floats (64 MiB here).
  const int64_t n = 16384, heads = 8, hd = 128, row = heads * hd, groups = 256;
  std::vector<float> q(n * row), k(n * hd), v(n * hd), o(n * row);  // one kv head
  for (int64_t i = 0; i < n * row; ++i) q[i] = 0.01f * (float)((i * 7) % 13);
  for (int64_t i = 0; i < n * hd; ++i) {
    k[i] = 0.01f * (float)((i * 5) % 11);
    v[i] = 0.01f * (float)((i * 3) % 17);
  }
  std::vector<int32_t> gid(n);
  for (int64_t i = 0; i < n; ++i) gid[i] = (int32_t)(i % groups);
  cpu::AttnShape s;
  s.n_q = s.n_kv = n;
  s.heads = heads;
  s.kv_heads = 1;
  s.head_dim = hd;
  s.q_stride = s.o_stride = row;
  s.kv_stride = hd;
  s.local_window = 16;
  s.sinks = 1;
  cpu::focus_attention_two_call(q.data(), k.data(), v.data(), o.data(), nullptr, s, Routing{gid.data(), groups, 1});
  ASSERT_GT(cpu::focus_attention_scratch_bytes(), kAttentionScratchKept);

  FocusRouters f = random_routers(*m, FocusMode::Hard, 16, 1);
  const auto ids = some_ids(200, m->cfg.vocab, 9);
  const auto a = run(*m, ids, &f);
  EXPECT_EQ(cpu::focus_attention_scratch_bytes(), 0u) << "a pass ending above the limit frees the scratch";
  const auto b = run(*m, ids, &f);
  const size_t kept = cpu::focus_attention_scratch_bytes();
  EXPECT_GT(kept, 0u) << "a short pass keeps its own scratch for the next call";
  EXPECT_LE(kept, kAttentionScratchKept);
  EXPECT_EQ(a, b);
}

TEST(FocusModel, RouterFilesRoundTrip) {
  FOCUS_NEED_FILE(stories());
  auto m = load_model(stories(), LoadOptions{"", false});
  FocusRouters f = random_routers(*m, FocusMode::Hard, 16, 2, 8);
  const std::string dir = ::testing::TempDir() + "/focus_router_rt";
  save_focus(f, dir, m->cfg, stories());
  FocusRouters g = load_focus(dir, m->cfg);
  EXPECT_EQ(g.settings.local_window, 16);
  EXPECT_EQ(g.settings.topk, 2);
  EXPECT_EQ(g.settings.mode, FocusMode::Hard);
  const FocusSettings s = load_focus_settings(dir, m->cfg);  // the settings alone agree
  EXPECT_EQ(s.local_window, 16);
  EXPECT_EQ(s.topk, 2);
  EXPECT_EQ(s.mode, FocusMode::Hard);
  EXPECT_EQ(s.groups, f.settings.groups);
  EXPECT_EQ(s.dg, f.settings.dg);
  EXPECT_EQ(s.tau, f.settings.tau);
  ASSERT_EQ(g.routers.size(), f.routers.size());
  for (size_t r = 0; r < f.routers.size(); ++r) EXPECT_EQ(g.routers[r].params, f.routers[r].params);
  const auto ids = some_ids(120, m->cfg.vocab, 5);
  const auto a = run(*m, ids, &f), b = run(*m, ids, &g);
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
}

// focus.json may list only global attention layers, each once: training would apply a router on
// a sliding-window layer that inference skips.
TEST(FocusModel, LoadRejectsRoutersOnSlidingLayersAndRepeatedLayers) {
  ModelConfig c;
  c.dim = 16;
  c.layers = 3;
  c.layer_sliding_window = {0, 0, 0};
  FocusSettings s;
  s.groups = 4;
  s.dg = 8;
  const std::string dir = ::testing::TempDir() + "/focus_router_layers";
  save_focus(focus_init(c, s, 3), dir, c, "none");
  EXPECT_EQ(load_focus(dir, c).routers.size(), 3u);
  auto error_of = [&](const ModelConfig& cfg) {
    try {
      load_focus(dir, cfg);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  ModelConfig sliding = c;
  sliding.layer_sliding_window = {0, 8, 0};  // the same files, but layer 1 is now a sliding-window layer
  std::string msg = error_of(sliding);
  EXPECT_NE(msg.find(dir + "/focus.json: layer 1 is a sliding-window layer"), std::string::npos) << msg;

  const std::string jp = dir + "/focus.json";
  nlohmann::json j = nlohmann::json::parse(read_file(jp));
  j["layers"] = {0, 2, 2};
  std::ofstream(jp) << j.dump(2);
  msg = error_of(c);
  EXPECT_NE(msg.find(jp + ": layer 2 is listed twice"), std::string::npos) << msg;
}

TEST(FocusModel, LearnedTemperaturesRoundTrip) {
  FOCUS_NEED_FILE(stories());
  auto m = load_model(stories(), LoadOptions{"", false});
  FocusSettings s = random_routers(*m, FocusMode::Soft, 16, 1).settings;
  s.learn_tau = true;
  FocusRouters f = focus_init(m->cfg, s, 7);
  for (size_t r = 0; r < f.routers.size(); ++r) {
    RouterParams& rp = f.routers[r];
    ASSERT_GE(rp.log_tau_offset(), 0);
    EXPECT_FLOAT_EQ(rp.tau(), s.tau);
    rp.params[rp.log_tau_offset()] = std::log(0.05f * (float)(r + 1));  // as if trained, one per layer
  }
  const std::string dir = ::testing::TempDir() + "/focus_router_tau";
  save_focus(f, dir, m->cfg, stories());
  FocusRouters g = load_focus(dir, m->cfg);
  EXPECT_TRUE(g.settings.learn_tau);
  ASSERT_EQ(g.routers.size(), f.routers.size());
  for (size_t r = 0; r < f.routers.size(); ++r) {
    EXPECT_EQ(g.routers[r].params, f.routers[r].params);
    EXPECT_NEAR(g.routers[r].tau(), 0.05f * (float)(r + 1), 1e-6f);
  }
  const auto ids = some_ids(120, m->cfg.vocab, 5);
  const auto a = run(*m, ids, &f), b = run(*m, ids, &g);
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
}

TEST(FocusModel, GroupsReportCountsEveryMembership) {
  FOCUS_NEED_FILE(stories());
  auto m = load_model(stories(), LoadOptions{test::data_path("models/stories260K/tok512.bin")});
  const auto ids = some_ids(700, m->cfg.vocab, 6);
  for (int topk : {1, 2}) {
    FocusRouters f = random_routers(*m, FocusMode::Hard, 16, topk, 8);
    const GroupsReport r = groups_report(*m, f, ids, 256, 0, 5, false);
    EXPECT_EQ(r.tokens, 700);
    EXPECT_EQ(r.windows, 3);  // 255 text tokens per window after BOS
    ASSERT_EQ(r.layers.size(), f.routers.size());
    for (const auto& l : r.layers) {
      int64_t total = 0, mx = 0;
      for (const auto& g : l.groups) {
        total += g.size;
        mx = std::max(mx, g.size);
        int64_t in_top = 0;
        for (const auto& [id, c] : g.top) in_top += c;
        EXPECT_LE(in_top, g.size);
        EXPECT_LE(g.top.size(), 5u);
      }
      EXPECT_EQ(total, 700 * topk) << "layer " << l.layer;
      EXPECT_NEAR(l.max_over_mean, (double)mx * 8 / total, 1e-12);
    }
  }
}

// A window scored with a cache that keeps no rows (what `focus eval` uses): the same bits as with
// a cache that keeps them, dense and routed, on every cache type; the cache cannot be run on.
TEST(FocusModel, AWindowWithoutKeptRowsHasTheSameBits) {
  FOCUS_NEED_FILE(stories());
  auto m = load_model(stories(), LoadOptions{"", false});
  const int64_t n = 140, D = m->cfg.dim;
  const auto ids = some_ids(n, m->cfg.vocab, 5);
  FocusRouters f = random_routers(*m, FocusMode::Hard, 16, 1, 8);
  const AttentionPlan plan = focus_plan(m->cfg, f);
  for (cpu::KvType t : {cpu::KvType::F32, cpu::KvType::F16, cpu::KvType::BF16})
    for (const AttentionPlan* p : {(const AttentionPlan*)nullptr, &plan}) {
      KVCache kept, none;
      kept.init(m->cfg, n, t);
      none.init(m->cfg, n + 1, t, /*keep_rows=*/false);  // room for one more: refused for another reason
      EXPECT_EQ(none.bytes(), 0);
      std::vector<float> a(n * D), b(n * D);
      forward(*m, ids.data(), n, kept, a.data(), p);
      forward(*m, ids.data(), n, none, b.data(), p);
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
          << cpu::to_string(t) << (p ? " routed" : " dense");
      EXPECT_THROW(forward(*m, ids.data(), 1, none, b.data(), p), Error);
    }
}
