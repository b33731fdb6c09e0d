// The retrofit pipeline end to end on stories260K (seconds): training improves the held-out soft
// perplexity, outputs load back, an interrupted run resumes to the same bits, the trained router
// stays causal, and bad setups are refused.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/threads.h"
#include "focus/balancing.h"
#include "io/safetensors.h"
#include "train/backward.h"
#include "train/data.h"
#include "train/retrofit.h"
#include "test_util.h"

using namespace focus;
using focus::test::book;
using focus::test::small_training_run;
using focus::test::stories;
using focus::test::tok512;
namespace fs = std::filesystem;

namespace {


RetrofitOptions small_run(const std::string& out) {
  RetrofitOptions o = small_training_run<RetrofitOptions>(out);
  o.adam.lr = 3e-3f;
  o.focus.local_window = 24;
  o.focus.groups = 8;
  o.focus.dg = 16;
  o.focus.tau = 0.1f;
  return o;
}

// Distillation of asymmetric routers per kv head, top-2.
RetrofitOptions distill_run(const std::string& out, int64_t steps) {
  RetrofitOptions o = small_run(out);
  o.objective = "distill";
  o.balance = Balance::Swav;
  o.focus.per_kv_head = true;
  o.focus.topk = 2;
  o.adam.lr = 1e-2f;
  o.steps = steps;
  return o;
}

// Sparse training (per kv head, top-2, 6 steps) from the routers in `init`.
RetrofitOptions sparse_run(const std::string& out, const std::string& init) {
  RetrofitOptions o = small_run(out);
  o.objective = "sparse";
  o.init = init;
  o.focus.per_kv_head = true;
  o.focus.topk = 2;
  o.adam.lr = 5e-3f;
  o.steps = 6;
  return o;
}

// Runs o stopped after 3 steps, then resumed to its end; the steps the resumed run reports.
int64_t interrupted_then_resumed(const Model& m, RetrofitOptions o) {
  o.stop_after = 3;
  EXPECT_TRUE(run_retrofit(m, o).interrupted);
  o.stop_after = 0;
  o.resume = true;
  return run_retrofit(m, o).steps;
}

std::vector<std::vector<float>> router_params(const std::string& dir, const ModelConfig& c) {
  FocusRouters f = load_focus(dir, c);
  std::vector<std::vector<float>> p;
  for (auto& r : f.routers) p.push_back(r.params);
  return p;
}

}  // namespace

TEST(Retrofit, Stories260KEndToEnd) {
  FOCUS_NEED_FILE(stories());
  FOCUS_NEED_FILE(book("pg-345-dracula.txt"));
  auto m = load_model(stories(), LoadOptions{tok512()});
  const std::string out = ::testing::TempDir() + "/focus_retrofit_e2e";
  RetrofitOptions o = small_run(out);
  const RetrofitResult r = run_retrofit(*m, o);
  EXPECT_FALSE(r.interrupted);
  EXPECT_EQ(r.steps, 24);
  EXPECT_EQ(r.train_tokens, 24 * 3 * (o.ctx - 1));
  EXPECT_GT(r.tokens_per_s, 0);
  // The pretrained reference is the same before and after; the routers learn.
  EXPECT_GT(r.before.ppl_pretrained, 1.0);
  EXPECT_LT(r.after.ppl_soft, r.before.ppl_soft) << "training did not improve the held-out soft perplexity";
  EXPECT_TRUE(std::isfinite(r.after.ppl_hard));
  EXPECT_GT(r.after.density_hard, 0);
  EXPECT_LE(r.after.density_hard, 1);
  // Outputs: routers load back; metrics has a line per step plus validations.
  EXPECT_TRUE(fs::exists(out + "/router.safetensors"));
  EXPECT_TRUE(fs::exists(out + "/focus.json"));
  EXPECT_TRUE(fs::exists(out + "/checkpoint.safetensors"));
  FocusRouters f = load_focus(out, m->cfg);
  EXPECT_EQ(f.routers.size(), (size_t)m->cfg.layers);
  std::ifstream in(out + "/metrics.jsonl");
  int lines = 0;
  for (std::string l; std::getline(in, l);) ++lines;
  EXPECT_EQ(lines, 24 + 2);

  // The trained router is causal through the whole model, soft and hard.
  const int64_t N = 200, D = m->cfg.dim;
  std::vector<int32_t> ids(N);
  for (int64_t i = 0; i < N; ++i) ids[i] = (int32_t)((i * 37 + 11) % m->cfg.vocab);
  for (FocusMode mode : {FocusMode::Soft, FocusMode::Hard}) {
    f.settings.mode = mode;
    auto run = [&](const std::vector<int32_t>& x) {
      KVCache c;
      c.init(m->cfg, N);
      std::vector<float> h(N * D);
      const AttentionPlan plan = focus_plan(m->cfg, f);
      forward(*m, x.data(), N, c, h.data(), &plan);
      return h;
    };
    const auto base = run(ids);
    for (int64_t j : {30, 120, 199}) {
      auto ids2 = ids;
      ids2[j] = (ids2[j] + 77) % (int32_t)m->cfg.vocab;
      const auto h = run(ids2);
      EXPECT_EQ(std::memcmp(h.data(), base.data(), j * D * sizeof(float)), 0) << to_string(mode) << " j=" << j;
    }
  }
}

TEST(Retrofit, InterruptedRunResumesToTheSameBits) {
  FOCUS_NEED_FILE(stories());
  FOCUS_NEED_FILE(book("pg-345-dracula.txt"));
  auto m = load_model(stories(), LoadOptions{tok512()});
  RetrofitOptions ob;
  for (Balance bal : {Balance::None, Balance::Bias, Balance::Swav}) {
    const std::string a = ::testing::TempDir() + "/focus_retrofit_a", b = ::testing::TempDir() + "/focus_retrofit_b";
    RetrofitOptions oa = small_run(a);
    oa.steps = 10;
    oa.balance = bal;
    run_retrofit(*m, oa);

    ob = small_run(b);
    ob.steps = 10;
    ob.balance = bal;
    ob.stop_after = 4;
    const RetrofitResult first = run_retrofit(*m, ob);
    EXPECT_TRUE(first.interrupted);
    EXPECT_EQ(first.steps, 4);
    ob.stop_after = 0;
    ob.resume = true;
    const RetrofitResult second = run_retrofit(*m, ob);
    EXPECT_FALSE(second.interrupted);
    EXPECT_EQ(second.steps, 10);
    EXPECT_EQ(router_params(a, m->cfg), router_params(b, m->cfg)) << "balance " << (int)bal;
    EXPECT_EQ(load_focus(a, m->cfg).routers[0].bias, load_focus(b, m->cfg).routers[0].bias);
  }

  // Resuming with other settings is refused, naming the checkpoint.
  RetrofitOptions oc = ob;
  oc.focus.groups = 4;
  try {
    run_retrofit(*m, oc);
    FAIL() << "resume with other settings must fail";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("checkpoint.safetensors"), std::string::npos) << e.what();
  }
  // So is a changed weight decay, hard top-k or validation set; the error names the setting.
  auto refused = [&](const RetrofitOptions& o, const std::string& setting) {
    try {
      run_retrofit(*m, o);
      ADD_FAILURE() << "resume with another " << setting << " must fail";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("checkpoint.safetensors"), std::string::npos) << msg;
      EXPECT_NE(msg.find(setting + ": checkpoint"), std::string::npos) << msg;
    }
  };
  oc = ob;
  oc.adam.weight_decay = 0.1f;
  refused(oc, "weight_decay");
  oc = ob;
  oc.focus.topk = 2;
  refused(oc, "topk");
  oc = ob;
  oc.valid_windows = ob.valid_windows + 1;
  refused(oc, "valid_windows");
  oc = ob;
  oc.focus.learn_tau = true;
  refused(oc, "learn_tau");
}

// Distillation (asymmetric routers per kv head) trains, records the measured far mass, reads more
// of it after training than the seeded routers, and resumes to the same bits.
TEST(Retrofit, DistillationTrainsAndResumesToTheSameBits) {
  FOCUS_NEED_FILE(stories());
  FOCUS_NEED_FILE(book("pg-345-dracula.txt"));
  auto m = load_model(stories(), LoadOptions{tok512()});
  const std::string a = ::testing::TempDir() + "/focus_distill_a", b = ::testing::TempDir() + "/focus_distill_b";
  auto opts = [&](const std::string& out) { return distill_run(out, 6); };
  const RetrofitResult full = run_retrofit(*m, opts(a));
  EXPECT_GT(full.after.captured, full.before.captured) << "training must raise the far mass the top-k groups read";
  const FocusRouters fa = load_focus(a, m->cfg);
  EXPECT_TRUE(fa.settings.asymmetric && fa.settings.per_kv_head);
  ASSERT_EQ(fa.far_mass.size(), fa.routers.size());
  for (float x : fa.far_mass) EXPECT_TRUE(x > 0.f && x < 1.f) << x;

  RetrofitOptions ob = opts(b);
  EXPECT_EQ(interrupted_then_resumed(*m, ob), 6);
  EXPECT_EQ(router_params(a, m->cfg), router_params(b, m->cfg));
  EXPECT_EQ(load_focus(b, m->cfg).far_mass, fa.far_mass);
  ob.resume = true;
  ob.distill.key_weight = 0.5f;  // another objective weight is refused on resume
  EXPECT_THROW(run_retrofit(*m, ob), Error);
  // So is another target: the same run made residual (the blocks' budgets are part of the run).
  ob.distill.key_weight = DistillOptions{}.key_weight;
  auto budget = std::make_shared<BlockBudget>();
  budget->block = 4;
  budget->window = ob.focus.local_window;
  budget->sinks = ob.focus.sinks;
  budget->k.assign(m->cfg.layers, std::vector<int64_t>(m->cfg.heads, 2));
  ob.distill.residual = budget;
  try {
    run_retrofit(*m, ob);
    ADD_FAILURE() << "resume with a residual budget must fail";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("residual_budget"), std::string::npos) << e.what();
  }
}

// Sparse training (--objective sparse) goes on from distilled routers with the language-model loss
// through the hard pattern: the hard validation perplexity goes down, the folder stays asymmetric
// per kv head, an interrupted run resumes to the same bits, and the bias balancer is refused.
TEST(Retrofit, SparseTrainingLowersTheHardLossAndResumesToTheSameBits) {
  FOCUS_NEED_FILE(stories());
  FOCUS_NEED_FILE(book("pg-345-dracula.txt"));
  auto m = load_model(stories(), LoadOptions{tok512()});
  const std::string d = ::testing::TempDir() + "/focus_sparse_init", a = ::testing::TempDir() + "/focus_sparse_a",
                    b = ::testing::TempDir() + "/focus_sparse_b";
  run_retrofit(*m, distill_run(d, 4));
  auto opts = [&](const std::string& out) { return sparse_run(out, d); };
  const RetrofitResult full = run_retrofit(*m, opts(a));
  EXPECT_LT(full.after.ppl_hard, full.before.ppl_hard)
      << "training through the pattern must lower its loss (hard validation ppl " << full.before.ppl_hard << " -> "
      << full.after.ppl_hard << ")";
  const FocusRouters fa = load_focus(a, m->cfg);
  EXPECT_TRUE(fa.settings.asymmetric && fa.settings.per_kv_head);

  EXPECT_EQ(interrupted_then_resumed(*m, opts(b)), 6);
  EXPECT_EQ(router_params(a, m->cfg), router_params(b, m->cfg));
  RetrofitOptions oc = opts(::testing::TempDir() + "/focus_sparse_c");
  oc.balance = Balance::Bias;
  EXPECT_THROW(run_retrofit(*m, oc), Error);
}

// Far-pair terms (--far-bias) from --init routers that have none start at zero: the first
// validation scores the routers' unweighted pattern, as a run without the terms does. Training
// moves the terms and lowers the hard loss; the folder keeps them; routers that carry them are
// refused as --init of a run without them.
TEST(Retrofit, FarTermsStartAtZeroFromInitRouters) {
  FOCUS_NEED_FILE(stories());
  FOCUS_NEED_FILE(book("pg-345-dracula.txt"));
  auto m = load_model(stories(), LoadOptions{tok512()});
  const std::string d = ::testing::TempDir() + "/focus_far_init", a = ::testing::TempDir() + "/focus_far_plain",
                    b = ::testing::TempDir() + "/focus_far_terms";
  run_retrofit(*m, distill_run(d, 4));
  auto opts = [&](const std::string& out, bool far) {
    RetrofitOptions o = sparse_run(out, d);
    o.focus.far_bias = far;
    return o;
  };
  const RetrofitResult plain = run_retrofit(*m, opts(a, false));
  const RetrofitResult far = run_retrofit(*m, opts(b, true));
  // Not bit for bit: the weighted pattern runs through the soft kernel, where a pair not read keeps
  // a weight of eps (1e-6), and the tiny difference moves a few near-tied keys of later layers.
  EXPECT_NEAR(far.before.ppl_hard, plain.before.ppl_hard, 3e-3 * plain.before.ppl_hard);
  EXPECT_NEAR(far.before.density_hard, plain.before.density_hard, 1e-3);
  EXPECT_LT(far.after.ppl_hard, far.before.ppl_hard);
  const FocusRouters f = load_focus(b, m->cfg);
  ASSERT_TRUE(f.settings.far_bias);
  double moved = 0;
  for (const RouterParams& r : f.routers)
    for (RouterSide side : {RouterSide::Query, RouterSide::Key})
      for (int64_t i = 0; i <= r.cfg.dim; ++i) moved += std::fabs(r.params[r.far_offset(side) + i]);
  EXPECT_GT(moved, 0.0) << "training must move the far-pair terms";
  RetrofitOptions back = opts(::testing::TempDir() + "/focus_far_back", false);
  back.init = b;
  try {
    run_retrofit(*m, back);
    FAIL() << "routers with far-pair terms as --init of a run without them must be refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("far-pair terms"), std::string::npos) << e.what();
  }
}

// Sparse training through the hybrid pattern (--blocks or --block-budget with --far-bias): the
// hard loss of that pattern goes down, the terms move, the folder keeps the blocks and each
// head's budget, near blocks and group switch (evaluating it reads the pattern trained), and an
// interrupted run resumes to the same bits. Blocks need the sparse objective and refuse group weights.
TEST(Retrofit, HybridTrainingLowersItsHardLossAndKeepsItsBlocks) {
  FOCUS_NEED_FILE(stories());
  FOCUS_NEED_FILE(book("pg-345-dracula.txt"));
  auto m = load_model(stories(), LoadOptions{tok512()});
  const std::string d = ::testing::TempDir() + "/focus_hybrid_init", a = ::testing::TempDir() + "/focus_hybrid_a",
                    b = ::testing::TempDir() + "/focus_hybrid_b";
  run_retrofit(*m, distill_run(d, 4));
  std::vector<std::vector<int64_t>> budget(m->cfg.layers);
  for (int64_t l = 0; l < m->cfg.layers; ++l)
    for (int64_t h = 0; h < m->cfg.heads; ++h) budget[l].push_back((l + h) % 4);  // 0 .. 3 blocks per head
  auto opts = [&](const std::string& out) {
    RetrofitOptions o = sparse_run(out, d);
    o.focus.far_bias = true;
    o.focus.block_size = 4;
    o.block_budget = budget;
    return o;
  };
  const RetrofitResult full = run_retrofit(*m, opts(a));
  EXPECT_LT(full.after.ppl_hard, full.before.ppl_hard)
      << "training through the hybrid pattern must lower its loss (hard validation ppl " << full.before.ppl_hard
      << " -> " << full.after.ppl_hard << ")";
  const FocusRouters fa = load_focus(a, m->cfg);
  EXPECT_EQ(fa.block_budget, budget);
  EXPECT_EQ(fa.settings.block_size, 4);
  EXPECT_EQ(fa.settings.blocks, 3);
  double moved = 0;
  for (const RouterParams& r : fa.routers)
    for (RouterSide side : {RouterSide::Query, RouterSide::Key})
      for (int64_t i = 0; i <= r.cfg.dim; ++i) moved += std::fabs(r.params[r.far_offset(side) + i]);
  EXPECT_GT(moved, 0.0) << "training must move the far-pair terms";
  // The blocks read pairs: the pattern is denser than the groups alone.
  RetrofitOptions groups_only = sparse_run(::testing::TempDir() + "/focus_hybrid_groups", d);
  groups_only.focus.far_bias = true;
  groups_only.steps = 1;
  EXPECT_GT(full.before.density_hard, run_retrofit(*m, groups_only).before.density_hard);

  EXPECT_EQ(interrupted_then_resumed(*m, opts(b)), 6);
  EXPECT_EQ(router_params(a, m->cfg), router_params(b, m->cfg));
  // Blocks chosen once every 3 rows: another pattern from the same routers, trained through and kept.
  RetrofitOptions tiled = opts(::testing::TempDir() + "/focus_hybrid_tiled");
  tiled.focus.block_select_every = 3;
  const RetrofitResult rt = run_retrofit(*m, tiled);
  EXPECT_NE(rt.before.ppl_hard, full.before.ppl_hard);
  EXPECT_LT(rt.after.ppl_hard, rt.before.ppl_hard);
  EXPECT_EQ(load_focus(tiled.out, m->cfg).settings.block_select_every, 3);
  // Near blocks and the group switch (heads of odd index read blocks alone): another pattern,
  // trained through and kept in the folder.
  RetrofitOptions switched = opts(::testing::TempDir() + "/focus_hybrid_switched");
  for (int64_t l = 0; l < m->cfg.layers; ++l) {
    switched.block_near.emplace_back();
    switched.block_group.emplace_back();
    for (int64_t h = 0; h < m->cfg.heads; ++h) {
      switched.block_near[l].push_back((l + 2 * h) % 3);
      switched.block_group[l].push_back(1 - h % 2);
    }
  }
  const RetrofitResult rs = run_retrofit(*m, switched);
  EXPECT_NE(rs.before.ppl_hard, full.before.ppl_hard);
  EXPECT_LT(rs.after.ppl_hard, rs.before.ppl_hard);
  const FocusRouters fs = load_focus(switched.out, m->cfg);
  EXPECT_EQ(fs.block_near, switched.block_near);
  EXPECT_EQ(fs.block_group, switched.block_group);
  RetrofitOptions od = distill_run(::testing::TempDir() + "/focus_hybrid_distill", 1);
  od.focus.blocks = 2;
  EXPECT_THROW(run_retrofit(*m, od), Error);
  RetrofitOptions weighted = opts(::testing::TempDir() + "/focus_hybrid_weighted");  // blocks have no group weights
  weighted.focus.group_bias = true;
  try {
    run_retrofit(*m, weighted);
    FAIL() << "group weights with block budgets must be refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("without group weights"), std::string::npos) << e.what();
  }
}

// With --balance swav every step's metrics line carries the SwAV loss: the mean over the step's
// windows and routers of the cross-entropy against the Sinkhorn targets. Step 1 uses the seeded
// routers, so it is recomputed here from the same windows.
TEST(Retrofit, SwavLossIsLoggedEveryStep) {
  FOCUS_NEED_FILE(stories());
  FOCUS_NEED_FILE(book("pg-345-dracula.txt"));
  auto m = load_model(stories(), LoadOptions{tok512()});
  const std::string out = ::testing::TempDir() + "/focus_retrofit_swav";
  RetrofitOptions o = small_run(out);
  o.steps = 3;
  o.balance = Balance::Swav;
  const RetrofitResult r = run_retrofit(*m, o);

  std::vector<double> logged;
  std::ifstream in(out + "/metrics.jsonl");
  for (std::string l; std::getline(in, l);) {
    const nlohmann::json j = nlohmann::json::parse(l);
    if (j.contains("loss")) {
      ASSERT_TRUE(j.contains("swav_loss")) << l;
      logged.push_back(j["swav_loss"].get<double>());
    } else {
      EXPECT_FALSE(j.contains("swav_loss")) << l;
    }
  }
  ASSERT_EQ(logged.size(), 3u);
  EXPECT_EQ(r.swav_loss, logged.back());

  FocusSettings fs = o.focus;
  fs.mode = FocusMode::Soft;
  const FocusRouters f = focus_init(m->cfg, fs, o.seed);
  const std::vector<TokenDoc> docs = tokenize_docs(*m->tok, o.train);
  const int32_t bos = m->tok->bos();
  double sum = 0;
  int64_t terms = 0;
  const int64_t G = fs.groups;
  const RouterAuxHook hook = [&](int64_t ri, const RouterCache& rc, float*) {
    std::vector<float> q(rc.n * G);
    sinkhorn_forward(rc.s.data(), rc.n, G, 1.0f, 3, q.data());
    sum += swav_loss_forward(rc.s.data(), f.routers[ri].bias.data(), q.data(), rc.n, G);
    ++terms;
  };
  for (int64_t b = 0; b < o.batch; ++b) {
    const Window w = make_window(docs, sample_window(docs, o.ctx, bos, o.seed, 0, b), o.ctx, bos);
    std::vector<std::vector<float>> grads(f.routers.size());
    for (size_t i = 0; i < grads.size(); ++i) grads[i].assign(f.routers[i].params.size(), 0.f);
    focus_router_loss_and_grad(*m, f, TrainWindow{w.ids.data(), (int64_t)w.ids.size(), w.targets.data()}, 1.f,
                               &grads, hook);
  }
  ASSERT_EQ(terms, o.batch * (int64_t)f.routers.size());
  EXPECT_NEAR(logged[0], sum / (double)terms, 1e-9 * logged[0]);
  EXPECT_GT(logged[0], 0.0);

  // Without SwAV balancing there is no such field.
  o = small_run(out);
  o.steps = 1;
  EXPECT_EQ(run_retrofit(*m, o).swav_loss, 0.0);
  std::ifstream in2(out + "/metrics.jsonl");
  for (std::string l; std::getline(in2, l);) EXPECT_FALSE(nlohmann::json::parse(l).contains("swav_loss")) << l;
}

// The elapsed time in the metrics log counts each second once, however often a checkpoint is
// written (a checkpoint every step once made it grow geometrically).
TEST(Retrofit, ElapsedTimeIsWallTimeWithCheckpointsEveryStep) {
  FOCUS_NEED_FILE(stories());
  FOCUS_NEED_FILE(book("pg-345-dracula.txt"));
  auto m = load_model(stories(), LoadOptions{tok512()});
  const std::string out = ::testing::TempDir() + "/focus_retrofit_seconds";
  RetrofitOptions o = small_run(out);
  o.steps = 12;
  o.checkpoint_seconds = 0;
  const auto t0 = std::chrono::steady_clock::now();
  const RetrofitResult r = run_retrofit(*m, o);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LE(r.seconds, wall + 1e-3);
  std::ifstream in(out + "/metrics.jsonl");
  double last = 0;
  int steps = 0;
  for (std::string l; std::getline(in, l);) {
    const nlohmann::json j = nlohmann::json::parse(l);
    if (!j.contains("seconds")) continue;
    EXPECT_GE(j["seconds"].get<double>(), last);
    last = j["seconds"].get<double>();
    ++steps;
  }
  EXPECT_EQ(steps, 12);
  EXPECT_LE(last, wall + 1e-3) << "the log counts more seconds than the run took";
}

TEST(Retrofit, RefusesADocumentOnBothSides) {
  FOCUS_NEED_FILE(stories());
  auto m = load_model(stories(), LoadOptions{tok512()});
  RetrofitOptions o = small_run(::testing::TempDir() + "/focus_retrofit_split");
  o.valid = {o.train[0]};
  try {
    run_retrofit(*m, o);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("both training and validation"), std::string::npos) << e.what();
  }
}

TEST(Retrofit, InitContinuesFromSavedRouters) {
  FOCUS_NEED_FILE(stories());
  auto m = load_model(stories(), LoadOptions{tok512()});
  const std::string a = ::testing::TempDir() + "/focus_retrofit_init_a";
  RetrofitOptions oa = small_run(a);
  oa.steps = 8;
  const RetrofitResult ra = run_retrofit(*m, oa);
  ASSERT_FALSE(ra.interrupted);

  // A second run from A's routers starts exactly where A ended: the same validation windows give
  // the same soft and hard perplexities before its first step.
  RetrofitOptions ob = small_run(::testing::TempDir() + "/focus_retrofit_init_b");
  ob.steps = 2;
  ob.init = a;
  const RetrofitResult rb = run_retrofit(*m, ob);
  EXPECT_EQ(rb.before.ppl_soft, ra.after.ppl_soft);
  EXPECT_EQ(rb.before.ppl_hard, ra.after.ppl_hard);
  EXPECT_NE(rb.before.ppl_soft, ra.before.ppl_soft);  // not the random start

  // Routers of another shape are refused, naming the folder's config.
  RetrofitOptions oc = small_run(::testing::TempDir() + "/focus_retrofit_init_c");
  oc.focus.groups = 4;
  oc.init = a;
  try {
    run_retrofit(*m, oc);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("focus.json"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("groups 8"), std::string::npos) << e.what();
  }
}
