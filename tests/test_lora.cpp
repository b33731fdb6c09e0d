// The LoRA baseline: adapter gradients through whole random models (Llama GQA, Gemma 3, GPT-2)
// against central differences of the float32 training loss; untrained adapters are the
// pretrained model exactly; merged inference equals the unmerged training forward; files round
// trip and bad files are refused naming the file; and the trainer end to end on stories260K
// (the loss falls, an interrupted run resumes to the same bits, the merged model reproduces the
// reported validation perplexity), including through the focus binary.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>

#include "core/error.h"
#include "core/mapped_file.h"
#include "eval/perplexity.h"
#include "io/safetensors_writer.h"
#include "train/backward.h"
#include "train/data.h"
#include "train/lora.h"
#include "train/lora_train.h"
#include "test_models.h"
#include "test_util.h"

using namespace focus;
using focus::test::book;
using focus::test::small_training_run;
using focus::test::stories;
using focus::test::tok512;
using focus::test::random_model;
using focus::test::Win;
using focus::test::window_of;
namespace fs = std::filesystem;

namespace {


// Adapters with B random too (B = 0 would make dA vanish).
LoraAdapters random_adapters(const ModelConfig& c, const std::string& targets, float alpha, uint32_t seed) {
  LoraSettings s;
  s.rank = 2;
  s.alpha = alpha;
  s.targets = targets;
  LoraAdapters a = lora_init(c, s, seed);
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.f, 0.3f);
  for (auto& m : a.mats)
    for (int64_t i = 0; i < m.out * m.rank; ++i) m.b()[i] = d(g);
  return a;
}

std::vector<std::vector<float>> zero_grads(const LoraAdapters& a) {
  std::vector<std::vector<float>> g;
  for (const auto& m : a.mats) g.emplace_back(m.params.size(), 0.f);
  return g;
}

double lora_loss(const Model& m, const LoraAdapters& a, const TrainWindow& w, const FocusRouters* f = nullptr) {
  TrainableSet ts;
  ts.routers = f;
  ts.lora = &a;
  return train_loss(m, ts, w);
}

// Checks the adapter gradient of the whole model against central differences of the float32
// loss: along the normalised gradient, and for the largest coordinates of A and of B of every
// adapter.
void check_lora_gradient(const Model& m, const LoraAdapters& a, const FocusRouters* f) {
  const int64_t T = 29;
  const Win w = window_of(T, m.cfg.vocab, 5);
  const TrainWindow tw{w.ids.data(), T, w.targets.data()};
  const float scale = 1.f / (T - 2);
  auto g = zero_grads(a);
  TrainableSet ts;
  ts.routers = f;
  ts.lora = &a;
  ts.lora_grads = &g;
  const LossGrad lg = train_loss_and_grad(m, ts, tw, scale);
  EXPECT_EQ(lg.scored, T - 2);
  EXPECT_NEAR(lg.loss_sum, lora_loss(m, a, tw, f), 1e-9 * std::abs(lg.loss_sum)) << "loss with and without grads";

  auto loss_at = [&](const std::function<void(LoraAdapters&)>& edit) {
    LoraAdapters a2 = a;
    edit(a2);
    return lora_loss(m, a2, tw, f) * scale;
  };
  focus::test::expect_directional_derivative(g, [&](double s) {
    return loss_at([&](LoraAdapters& a2) {
      for (size_t k = 0; k < g.size(); ++k)
        for (size_t i = 0; i < g[k].size(); ++i) a2.mats[k].params[i] += (float)(s * g[k][i]);
    });
  });
  const double h = 1e-2;
  for (size_t k = 0; k < g.size(); ++k) {
    const LoraMatrix& mat = a.mats[k];
    const int64_t na = mat.rank * mat.in;
    // The two largest coordinates within A and within B.
    for (auto [lo, hi] : {std::pair<int64_t, int64_t>{0, na}, {na, mat.size()}}) {
      std::vector<int64_t> idx;
      for (int64_t i = lo; i < hi; ++i) idx.push_back(i);
      std::partial_sort(idx.begin(), idx.begin() + 2, idx.end(),
                        [&](int64_t x, int64_t y) { return std::abs(g[k][x]) > std::abs(g[k][y]); });
      for (int j = 0; j < 2; ++j) {
        const int64_t i = idx[j];
        auto at = [&](double t) { return loss_at([&](LoraAdapters& a2) { a2.mats[k].params[i] += (float)t; }); };
        const double fdi = (at(h) - at(-h)) / (2 * h);
        EXPECT_NEAR(fdi, g[k][i], 5e-3 * std::abs(g[k][i]) + 2e-4)
            << "layers." << mat.layer << "." << lora_target_name(mat.target) << (i < na ? " A[" : " B[")
            << (i < na ? i : i - na) << "]";
      }
    }
  }
}

class LoraGrad : public ::testing::TestWithParam<Arch> {};

}  // namespace

TEST(Lora, TargetsAndSettings) {
  EXPECT_EQ(parse_lora_targets("qkvo"), "qkvo");
  EXPECT_EQ(parse_lora_targets("v,q"), "qv");
  EXPECT_EQ(parse_lora_targets("oo"), "o");
  EXPECT_THROW(parse_lora_targets("qx"), Error);
  EXPECT_THROW(parse_lora_targets(""), Error);
  LoraSettings s;
  s.rank = 8;
  EXPECT_EQ(s.alpha_or_default(), 16.f);  // alpha defaults to 2 * rank
  EXPECT_EQ(s.scale(), 2.f);
  s.alpha = 4.f;
  EXPECT_EQ(s.scale(), 0.5f);
  s.targets = "qv";
  EXPECT_TRUE(s.adapts(kLoraQ) && s.adapts(kLoraV) && !s.adapts(kLoraK) && !s.adapts(kLoraO));
}

TEST(Lora, InitIsSeededSmallAndStartsAtZero) {
  auto m = random_model(Arch::Llama, 1);
  LoraSettings s;
  s.rank = 4;
  s.targets = "qko";
  const LoraAdapters a = lora_init(m->cfg, s, 7), b = lora_init(m->cfg, s, 7), c = lora_init(m->cfg, s, 8);
  ASSERT_EQ(a.mats.size(), (size_t)(3 * m->cfg.layers));
  EXPECT_EQ(a.n_params(), m->cfg.layers * 4 * ((32 + 32) + (32 + 16) + (32 + 32)));
  for (size_t k = 0; k < a.mats.size(); ++k) {
    const LoraMatrix& x = a.mats[k];
    EXPECT_EQ(x.params, b.mats[k].params);
    EXPECT_NE(x.params, c.mats[k].params);
    const double bound = 1.0 / std::sqrt((double)x.in);
    double sum_abs = 0;
    for (int64_t i = 0; i < x.rank * x.in; ++i) {
      EXPECT_LE(std::abs(x.a()[i]), bound);
      sum_abs += std::abs(x.a()[i]);
    }
    EXPECT_GT(sum_abs / (x.rank * x.in), 0.3 * bound);  // uniform: mean |a| = bound / 2
    for (int64_t i = 0; i < x.out * x.rank; ++i) EXPECT_EQ(x.b()[i], 0.f);
  }
  EXPECT_EQ(a.find(0, kLoraV), nullptr);
  ASSERT_NE(a.find(2, kLoraO), nullptr);
  EXPECT_EQ(a.find(2, kLoraO)->in, m->cfg.q_dim());
  EXPECT_EQ(a.find(1, kLoraK)->out, m->cfg.kv_dim());
}

// dA and dB through the whole model match central differences of the loss.
TEST_P(LoraGrad, AdapterGradientMatchesFiniteDifferences) {
  auto m = random_model(GetParam(), 100);
  check_lora_gradient(*m, random_adapters(m->cfg, "qkvo", 3.f, 11), nullptr);
}

// Adapters on a subset of projections, alpha by default.
TEST_P(LoraGrad, SubsetOfProjections) {
  auto m = random_model(GetParam(), 110);
  check_lora_gradient(*m, random_adapters(m->cfg, "vo", 0.f, 12), nullptr);
}

// With frozen Focus routers in the forward pass, the adapters' gradient still matches (the
// router's input gradient is passed on though the router is not trained).
TEST_P(LoraGrad, WithFrozenRouters) {
  auto m = random_model(GetParam(), 120);
  FocusSettings s;
  s.local_window = 4;
  s.groups = 4;
  s.dg = 8;
  s.tau = 0.5f;
  const FocusRouters f = focus_init(m->cfg, s, 7);
  check_lora_gradient(*m, random_adapters(m->cfg, "qkvo", 0.f, 13), &f);
}

// Routers trained on top of frozen adapters: the router gradient (which flows back through the
// adapters of the layers above) matches central differences, alone and trained jointly.
TEST_P(LoraGrad, RouterGradientThroughFrozenAdapters) {
  auto m = random_model(GetParam(), 130);
  FocusSettings s;
  s.local_window = 4;
  s.groups = 4;
  s.dg = 8;
  s.tau = 0.5f;
  const FocusRouters f = focus_init(m->cfg, s, 9);
  const LoraAdapters a = random_adapters(m->cfg, "qkvo", 0.f, 18);
  const int64_t T = 29;
  const Win w = window_of(T, m->cfg.vocab, 7);
  const TrainWindow tw{w.ids.data(), T, w.targets.data()};
  const float scale = 1.f / (T - 2);
  for (bool joint : {false, true}) {
    std::vector<std::vector<float>> gr, gl = zero_grads(a);
    for (const auto& r : f.routers) gr.emplace_back(r.params.size(), 0.f);
    TrainableSet ts;
    ts.routers = &f;
    ts.router_grads = &gr;
    ts.lora = &a;
    if (joint) ts.lora_grads = &gl;
    train_loss_and_grad(*m, ts, tw, scale);
    double gn = 0;
    for (auto* g : {&gr, &gl})
      for (auto& v : *g)
        for (float x : v) gn += (double)x * x;
    gn = std::sqrt(gn);
    ASSERT_GT(gn, 1e-4);
    const double h = 3e-3;
    auto along = [&](double t) {
      FocusRouters f2 = f;
      LoraAdapters a2 = a;
      for (size_t r = 0; r < gr.size(); ++r)
        for (size_t i = 0; i < gr[r].size(); ++i) f2.routers[r].params[i] += (float)(t * gr[r][i] / gn);
      for (size_t k = 0; k < gl.size(); ++k)
        for (size_t i = 0; i < gl[k].size(); ++i) a2.mats[k].params[i] += (float)(t * gl[k][i] / gn);
      return lora_loss(*m, a2, tw, &f2) * scale;
    };
    const double fd = (along(h) - along(-h)) / (2 * h);
    EXPECT_NEAR(fd, gn, 2e-3 * gn + 1e-4) << (joint ? "routers and adapters" : "routers");
  }
}

TEST_P(LoraGrad, RecomputeEqualsKeep) {
  auto m = random_model(GetParam(), 200);
  const LoraAdapters a = random_adapters(m->cfg, "qkvo", 0.f, 14);
  const Win w = window_of(21, m->cfg.vocab, 6);
  const TrainWindow tw{w.ids.data(), 21, w.targets.data()};
  auto ga = zero_grads(a), gb = zero_grads(a);
  BackwardOptions keep, rec;
  keep.force_recompute = 0;
  rec.force_recompute = 1;
  TrainableSet ta, tb;
  ta.lora = tb.lora = &a;
  ta.lora_grads = &ga;
  tb.lora_grads = &gb;
  const LossGrad la = train_loss_and_grad(*m, ta, tw, 0.1f, keep);
  const LossGrad lb = train_loss_and_grad(*m, tb, tw, 0.1f, rec);
  EXPECT_EQ(la.loss_sum, lb.loss_sum);
  EXPECT_EQ(ga, gb);
}

// Untrained adapters (B = 0) are the pretrained model exactly, in training and merged.
TEST_P(LoraGrad, ZeroBIsThePretrainedModel) {
  auto m = random_model(GetParam(), 300);
  LoraSettings s;
  s.rank = 3;
  const LoraAdapters a = lora_init(m->cfg, s, 5);
  const Win w = window_of(40, m->cfg.vocab, 8);
  const TrainWindow tw{w.ids.data(), 40, w.targets.data()};
  EXPECT_EQ(lora_loss(*m, a, tw), train_loss(*m, TrainableSet{}, tw));
  int64_t n = 0;
  const double plain = window_nll(*m, w.ids, w.targets, nullptr, nullptr, &n);
  const Model merged = lora_merged_view(*m, a);
  EXPECT_EQ(window_nll(merged, w.ids, w.targets, nullptr, nullptr, &n), plain);
  // The gradient of B is not zero (training can start), that of A is.
  auto g = zero_grads(a);
  TrainableSet ts;
  ts.lora = &a;
  ts.lora_grads = &g;
  train_loss_and_grad(*m, ts, tw, 0.1f);
  double na = 0, nb = 0;
  for (size_t k = 0; k < g.size(); ++k) {
    const LoraMatrix& x = a.mats[k];
    for (int64_t i = 0; i < x.size(); ++i) (i < x.rank * x.in ? na : nb) += std::abs(g[k][i]);
  }
  EXPECT_EQ(na, 0.0);
  EXPECT_GT(nb, 0.0);
}

// Merged inference (eval forward with W + (alpha/r) B A) equals the unmerged training forward.
TEST_P(LoraGrad, MergedEqualsUnmerged) {
  auto m = random_model(GetParam(), 400);
  const LoraAdapters a = random_adapters(m->cfg, "qkvo", 0.f, 15);
  const Win w = window_of(40, m->cfg.vocab, 9);
  const TrainWindow tw{w.ids.data(), 40, w.targets.data()};
  const double train = lora_loss(*m, a, tw);
  int64_t n = 0;
  const double plain = window_nll(*m, w.ids, w.targets, nullptr, nullptr, &n);
  const Model view = lora_merged_view(*m, a);
  const double merged = window_nll(view, w.ids, w.targets, nullptr, nullptr, &n);
  EXPECT_NEAR(train, merged, 1e-5 * std::abs(merged));
  EXPECT_GT(std::abs(merged - plain), 1e-3) << "the adapters changed nothing";
  // The view left the model alone; merging into the model itself gives the view's numbers.
  EXPECT_EQ(window_nll(*m, w.ids, w.targets, nullptr, nullptr, &n), plain);
  apply_lora(*m, a);
  EXPECT_EQ(window_nll(*m, w.ids, w.targets, nullptr, nullptr, &n), merged);
}

INSTANTIATE_TEST_SUITE_P(Arches, LoraGrad, ::testing::Values(Arch::Llama, Arch::Gemma3, Arch::GPT2),
                         [](const auto& info) { return to_string(info.param); });

// ---------------------------------------------------------------------------------------------
// Files.

namespace {

std::string expect_error(const std::function<void()>& f) {
  const std::string m = focus::test::error_of(f);
  if (m.empty()) ADD_FAILURE() << "expected an error";
  return m;
}

std::string fresh_dir(const std::string& name) {
  const std::string d = ::testing::TempDir() + "/" + name;
  fs::remove_all(d);
  return d;
}

}  // namespace

TEST(LoraFiles, SaveLoadRoundTrip) {
  auto m = random_model(Arch::Gemma3, 500);
  LoraAdapters a = random_adapters(m->cfg, "qvo", 5.f, 16);
  const std::string d = fresh_dir("focus_lora_roundtrip");
  save_lora(a, d, m->cfg, "some/model.gguf");
  EXPECT_TRUE(fs::exists(d + "/lora.safetensors"));
  EXPECT_TRUE(fs::exists(d + "/lora.json"));
  const auto j = nlohmann::json::parse(read_file(d + "/lora.json"));
  EXPECT_EQ(j["rank"], 2);
  EXPECT_EQ(j["alpha"], 5.0);
  EXPECT_EQ(j["targets"], "qvo");
  const LoraAdapters b = load_lora(d, m->cfg);
  EXPECT_EQ(b.settings.rank, 2);
  EXPECT_EQ(b.settings.alpha, 5.f);
  EXPECT_EQ(b.settings.targets, "qvo");
  ASSERT_EQ(b.mats.size(), a.mats.size());
  for (size_t k = 0; k < a.mats.size(); ++k) {
    EXPECT_EQ(b.mats[k].layer, a.mats[k].layer);
    EXPECT_EQ(b.mats[k].target, a.mats[k].target);
    EXPECT_EQ(b.mats[k].params, a.mats[k].params);
  }
  // Tensor names and shapes as documented.
  io::SafetensorsFile st(d + "/lora.safetensors");
  EXPECT_EQ(st.tensor("layers.1.o.lora_a").shape, (std::vector<int64_t>{2, m->cfg.q_dim()}));
  EXPECT_EQ(st.tensor("layers.1.o.lora_b").shape, (std::vector<int64_t>{m->cfg.dim, 2}));
  EXPECT_EQ(st.tensor("layers.2.v.lora_b").shape, (std::vector<int64_t>{m->cfg.kv_dim(), 2}));
  EXPECT_EQ(st.find("layers.0.k.lora_a"), nullptr);
  // load_and_apply_lora merges what was saved.
  const Win w = window_of(30, m->cfg.vocab, 3);
  int64_t n = 0;
  const Model view = lora_merged_view(*m, a);
  const double want = window_nll(view, w.ids, w.targets, nullptr, nullptr, &n);
  load_and_apply_lora(*m, d);
  EXPECT_EQ(window_nll(*m, w.ids, w.targets, nullptr, nullptr, &n), want);
}

TEST(LoraFiles, BadFilesAreRefusedNamingTheFile) {
  auto m = random_model(Arch::Llama, 600);
  const LoraAdapters a = random_adapters(m->cfg, "qkvo", 0.f, 17);
  const std::string d = fresh_dir("focus_lora_bad");
  auto contains = [](const std::string& msg, const std::string& part) {
    EXPECT_NE(msg.find(part), std::string::npos) << "message: " << msg;
  };
  // No folder.
  contains(expect_error([&] { load_lora(d + "/nope", m->cfg); }), d + "/nope");
  save_lora(a, d, m->cfg, "m");
  const std::string json_text = read_file(d + "/lora.json");
  // A model of another shape (GPT-2: 4 kv heads instead of 2).
  auto other = random_model(Arch::GPT2, 601);
  contains(expect_error([&] { load_lora(d, other->cfg); }), "lora.json");
  // Broken JSON, wrong format, bad targets, bad rank.
  auto with_json = [&](const std::string& text, const std::string& part) {
    std::ofstream(d + "/lora.json") << text;
    const std::string msg = expect_error([&] { load_lora(d, m->cfg); });
    contains(msg, "lora.json");
    contains(msg, part);
  };
  std::string msg;
  with_json("{ not json", "invalid JSON");
  with_json(R"({"format": "focus-router"})", "not a focus LoRA config");
  auto j = nlohmann::json::parse(json_text);
  j["targets"] = "qz";
  with_json(j.dump(), "unknown projection");
  j = nlohmann::json::parse(json_text);
  j["rank"] = 0;
  with_json(j.dump(), "rank");
  j = nlohmann::json::parse(json_text);
  j.erase("alpha");
  with_json(j.dump(), "missing or malformed field");
  j = nlohmann::json::parse(json_text);
  j["rank"] = 3;  // the tensors hold rank 2
  std::ofstream(d + "/lora.json") << j.dump();
  msg = expect_error([&] { load_lora(d, m->cfg); });
  contains(msg, "lora.safetensors");
  contains(msg, "shape");
  std::ofstream(d + "/lora.json") << json_text;
  EXPECT_NO_THROW(load_lora(d, m->cfg));
  // A tensor missing, a wrong shape, NaN.
  auto tensors = [&](int variant) {
    std::map<std::string, io::F32Tensor> t;
    for (const auto& x : a.mats) {
      const std::string p = "layers." + std::to_string(x.layer) + "." + lora_target_name(x.target) + ".";
      t[p + "lora_a"] = {{x.rank, x.in}, std::vector<float>(x.a(), x.a() + x.rank * x.in)};
      t[p + "lora_b"] = {{x.out, x.rank}, std::vector<float>(x.b(), x.b() + x.out * x.rank)};
    }
    if (variant == 0) t.erase("layers.1.k.lora_b");
    if (variant == 1) t["layers.2.o.lora_a"].shape = {m->cfg.q_dim(), 2};
    if (variant == 2) t["layers.0.q.lora_b"].data[5] = std::nanf("");
    io::save_safetensors(d + "/lora.safetensors", t);
  };
  tensors(0);
  msg = expect_error([&] { load_lora(d, m->cfg); });
  contains(msg, "lora.safetensors");
  contains(msg, "layers.1.k.lora_b");
  tensors(1);
  msg = expect_error([&] { load_lora(d, m->cfg); });
  contains(msg, "lora.safetensors");
  contains(msg, "layers.2.o.lora_a");
  tensors(2);
  msg = expect_error([&] { load_lora(d, m->cfg); });
  contains(msg, "lora.safetensors");
  contains(msg, "NaN");
  // Not a safetensors file at all.
  std::ofstream(d + "/lora.safetensors") << "garbage";
  contains(expect_error([&] { load_lora(d, m->cfg); }), "lora.safetensors");
}

// ---------------------------------------------------------------------------------------------
// The trainer on stories260K.

namespace {


LoraOptions small_lora_run(const std::string& out) {
  LoraOptions o = small_training_run<LoraOptions>(out);
  o.adam.lr = 1e-2f;
  o.lora.rank = 4;
  return o;
}

std::vector<std::vector<float>> lora_params(const std::string& dir, const ModelConfig& c) {
  std::vector<std::vector<float>> p;
  for (const auto& m : load_lora(dir, c).mats) p.push_back(m.params);
  return p;
}

}  // namespace

TEST(LoraTrain, Stories260KEndToEnd) {
  FOCUS_NEED_FILE(stories());
  FOCUS_NEED_FILE(book("pg-345-dracula.txt"));
  auto m = load_model(stories(), LoadOptions{tok512()});
  const std::string out = ::testing::TempDir() + "/focus_lora_e2e";
  const LoraOptions o = small_lora_run(out);
  const LoraResult r = run_lora(*m, o);
  EXPECT_FALSE(r.interrupted);
  EXPECT_EQ(r.steps, 24);
  EXPECT_EQ(r.train_tokens, 24 * 3 * (o.ctx - 1));
  EXPECT_GT(r.tokens_per_s, 0);
  EXPECT_EQ(r.settings.alpha, 8.f);
  const ModelConfig& c = m->cfg;  // rank 4 on q, k, v, o: r * (in + out) each
  EXPECT_EQ(r.params, c.layers * 4 * ((c.dim + c.q_dim()) + 2 * (c.dim + c.kv_dim()) + (c.q_dim() + c.dim)));
  EXPECT_GT(r.before.ppl_pretrained, 1.0);
  EXPECT_EQ(r.before.ppl_lora, r.before.ppl_pretrained);
  EXPECT_EQ(r.after.ppl_pretrained, r.before.ppl_pretrained);
  EXPECT_LT(r.after.ppl_lora, r.before.ppl_pretrained) << "LoRA did not lower the held-out (in-domain) perplexity";
  EXPECT_TRUE(fs::exists(out + "/lora.safetensors"));
  EXPECT_TRUE(fs::exists(out + "/lora.json"));
  EXPECT_TRUE(fs::exists(out + "/checkpoint.safetensors"));
  std::ifstream in(out + "/metrics.jsonl");
  int lines = 0;
  for (std::string l; std::getline(in, l);) ++lines;
  EXPECT_EQ(lines, 24 + 2);

  // The training loss on the windows of the first steps is lower with the trained adapters.
  const auto docs = tokenize_docs(*m->tok, o.train);
  const int32_t bos = m->tok->bos();
  const LoraAdapters trained = load_lora(out, m->cfg);
  double before = 0, after = 0;
  for (int64_t step = 0; step < 2; ++step)
    for (int64_t b = 0; b < o.batch; ++b) {
      const Window w = make_window(docs, sample_window(docs, o.ctx, bos, o.seed, step, b), o.ctx, bos);
      const TrainWindow tw{w.ids.data(), (int64_t)w.ids.size(), w.targets.data()};
      before += train_loss(*m, TrainableSet{}, tw);
      TrainableSet ts;
      ts.lora = &trained;
      after += train_loss(*m, ts, tw);
    }
  EXPECT_LT(after, before) << "training did not lower the training loss";

  // A freshly loaded model with the saved adapters merged evaluates the validation windows to
  // the perplexity the trainer reported.
  auto m2 = load_model(stories(), LoadOptions{tok512()});
  load_and_apply_lora(*m2, out);
  const auto vdocs = tokenize_docs(*m2->tok, o.valid);
  double nll = 0;
  int64_t tokens = 0;
  for (const auto& ref : validation_windows(vdocs, o.ctx, bos, o.valid_windows)) {
    const Window w = make_window(vdocs, ref, o.ctx, bos);
    int64_t n = 0;
    nll += window_nll(*m2, w.ids, w.targets, nullptr, nullptr, &n);
    tokens += n;
  }
  EXPECT_EQ(tokens, r.after.tokens);
  EXPECT_DOUBLE_EQ(std::exp(nll / tokens), r.after.ppl_lora);
}

TEST(LoraTrain, InterruptedRunResumesToTheSameBits) {
  FOCUS_NEED_FILE(stories());
  FOCUS_NEED_FILE(book("pg-345-dracula.txt"));
  auto m = load_model(stories(), LoadOptions{tok512()});
  const std::string a = ::testing::TempDir() + "/focus_lora_a", b = ::testing::TempDir() + "/focus_lora_b";
  LoraOptions oa = small_lora_run(a);
  oa.steps = 10;
  oa.lora.targets = "qv";
  const LoraResult ra = run_lora(*m, oa);

  LoraOptions ob = small_lora_run(b);
  ob.steps = 10;
  ob.lora.targets = "qv";
  ob.stop_after = 4;
  const LoraResult first = run_lora(*m, ob);
  EXPECT_TRUE(first.interrupted);
  EXPECT_EQ(first.steps, 4);
  ob.stop_after = 0;
  ob.resume = true;
  const LoraResult second = run_lora(*m, ob);
  EXPECT_FALSE(second.interrupted);
  EXPECT_EQ(second.steps, 10);
  EXPECT_EQ(lora_params(a, m->cfg), lora_params(b, m->cfg));
  EXPECT_EQ(second.after.ppl_lora, ra.after.ppl_lora);
  EXPECT_EQ(second.before.ppl_pretrained, ra.before.ppl_pretrained);

  // Resuming with another rank is refused, naming the checkpoint.
  LoraOptions oc = ob;
  oc.lora.rank = 2;
  const std::string msg = expect_error([&] { run_lora(*m, oc); });
  EXPECT_NE(msg.find("checkpoint.safetensors"), std::string::npos) << msg;
  // So are another validation text and another weight decay; the error names the setting.
  oc = ob;
  oc.valid = {book("pg-98-a-tale-of-two-cities.txt")};
  EXPECT_NE(expect_error([&] { run_lora(*m, oc); }).find("valid: checkpoint"), std::string::npos);
  oc = ob;
  oc.adam.weight_decay = ob.adam.weight_decay + 0.05f;
  EXPECT_NE(expect_error([&] { run_lora(*m, oc); }).find("weight_decay: checkpoint"), std::string::npos);
  // A document on both sides is refused.
  LoraOptions od = small_lora_run(::testing::TempDir() + "/focus_lora_split");
  od.valid = {od.train[0]};
  EXPECT_NE(expect_error([&] { run_lora(*m, od); }).find("both training and validation"), std::string::npos);
}

// `focus lora --json` and `focus eval --lora DIR` through the binary.
TEST(LoraTrain, CommandLine) {
  FOCUS_NEED_FILE(stories());
  FOCUS_NEED_FILE(book("pg-345-dracula.txt"));
  const char* env = std::getenv("FOCUS_BIN");
  const std::string bin = env ? env : std::string(FOCUS_SOURCE_DIR) + "/build/focus";
  FOCUS_NEED_FILE(bin);
  const std::string out = fresh_dir("focus_lora_cli");
  const std::string log = ::testing::TempDir() + "/focus_lora_cli.txt";
  auto run = [&](const std::string& args) {
    const int st = std::system((bin + " -t 1 " + args + " >" + log + " 2>/dev/null").c_str());
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << args;
    const std::string text = read_file(log);
    const size_t nl = text.find_last_of('\n', text.size() >= 2 ? text.size() - 2 : 0);
    return nlohmann::json::parse(nl == std::string::npos ? text : text.substr(nl + 1));
  };
  const std::string model = "--model " + stories() + " --tokenizer " + tok512();
  const auto j = run("lora " + model + " --train " + book("pg-345-dracula.txt") + " --valid " +
                     book("pg-1342-pride-and-prejudice.txt") +
                     " --ctx 128 --rank 2 --targets qv --steps 6 --batch 2 --lr 1e-2 --valid-windows 3 --out " + out +
                     " --json");
  for (const char* k : {"valid_ppl_pretrained", "valid_ppl_lora", "train_tokens", "tokens_per_s", "steps", "params"})
    EXPECT_TRUE(j.contains(k)) << k;
  EXPECT_EQ(j["steps"], 6);
  EXPECT_EQ(j["train_tokens"], 6 * 2 * 127);
  const std::string text = " --text " + book("pg-1342-pride-and-prejudice.txt") + " --ctx 128 --max-tokens 2000 --json";
  const auto plain = run("eval " + model + text);
  const auto adapted = run("eval " + model + text + " --lora " + out);
  EXPECT_EQ(adapted["tokens"], plain["tokens"]);
  EXPECT_NE(adapted["ppl"], plain["ppl"]);
  EXPECT_EQ(adapted["lora"], out);
}
