#include "train/retrofit.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "core/mapped_file.h"
#include "core/progress.h"
#include "core/threads.h"
#include "eval/perplexity.h"
#include "focus/sinkhorn.h"
#include "io/safetensors.h"
#include "io/safetensors_writer.h"
#include "train/backward.h"
#include "train/data.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace focus {

Balance parse_balance(const std::string& s) {
  if (s == "none") return Balance::None;
  if (s == "swav") return Balance::Swav;
  if (s == "bias") return Balance::Bias;
  fail("unknown balancing '", s, "' (expected none, swav or bias)");
}

namespace {

const char* balance_name(Balance b) { return b == Balance::Swav ? "swav" : b == Balance::Bias ? "bias" : "none"; }

double ppl_of(double nll, int64_t n) { return n > 0 ? std::exp(nll / n) : 0; }

json valid_json(const ValidResult& v) {
  return {{"ppl_pretrained", v.ppl_pretrained}, {"ppl_window", v.ppl_window}, {"ppl_soft", v.ppl_soft},           {"ppl_hard", v.ppl_hard},
          {"ppl_hard_k2", v.ppl_hard_k2},       {"density_hard", v.density_hard}, {"load_max_over_mean", v.load_max_over_mean},
          {"tokens", v.tokens}};
}

ValidResult valid_from_json(const json& j) {
  ValidResult v;
  v.ppl_pretrained = j.value("ppl_pretrained", 0.0);
  v.ppl_window = j.value("ppl_window", 0.0);
  v.ppl_soft = j.value("ppl_soft", 0.0);
  v.ppl_hard = j.value("ppl_hard", 0.0);
  v.ppl_hard_k2 = j.value("ppl_hard_k2", 0.0);
  v.density_hard = j.value("density_hard", 0.0);
  v.load_max_over_mean = j.value("load_max_over_mean", 0.0);
  v.tokens = j.value("tokens", int64_t(0));
  return v;
}

// The settings a checkpoint must share with the run that resumes it.
json run_identity(const Model& m, const RetrofitOptions& o) {
  return {{"model", m.path},          {"train", o.train},           {"ctx", o.ctx},
          {"steps", o.steps},         {"batch", o.batch},           {"warmup", o.warmup},
          {"lr", o.adam.lr},          {"window", o.focus.window},   {"sinks", o.focus.sinks},
          {"groups", o.focus.groups}, {"dg", o.focus.dg},           {"tau", o.focus.tau},
          {"seed", o.seed},           {"balance", balance_name(o.balance)}, {"balance_weight", o.balance_weight}};
}

struct Checkpoint {
  int64_t step = 0;
  int64_t train_tokens = 0;
  double seconds = 0;
  ValidResult before;
};

void save_checkpoint(const std::string& path, const FocusRouters& f, const AdamWState& st, const Checkpoint& c,
                     const json& identity, const std::vector<BiasBalancer>& balancers) {
  std::map<std::string, io::F32Tensor> t;
  for (size_t r = 0; r < f.routers.size(); ++r) {
    const auto& rp = f.routers[r];
    const std::string p = "router." + std::to_string(r) + ".";
    t[p + "params"] = {{(int64_t)rp.params.size()}, rp.params};
    t[p + "bias"] = {{(int64_t)rp.bias.size()}, rp.bias};
    if (st.m.size() == f.routers.size()) {
      t[p + "adam_m"] = {{(int64_t)st.m[r].size()}, st.m[r]};
      t[p + "adam_v"] = {{(int64_t)st.v[r].size()}, st.v[r]};
    }

  }
  json meta = {{"step", c.step},         {"adam_t", st.t},          {"train_tokens", c.train_tokens},
               {"seconds", c.seconds},   {"before", valid_json(c.before)}, {"identity", identity}};
  // Running group loads of the bias balancer, in JSON (doubles round-trip exactly).
  json loads = json::array();
  for (const auto& b : balancers) loads.push_back(b.load);
  meta["balance_load"] = loads;
  io::save_safetensors(path, t, {{"focus_checkpoint", meta.dump()}});
}

Checkpoint load_checkpoint(const std::string& path, FocusRouters& f, AdamWState& st, const json& identity,
                           std::vector<BiasBalancer>& balancers) {
  io::SafetensorsFile file(path);
  const json& md = file.metadata();
  FOCUS_CHECK(md.contains("focus_checkpoint"), path, ": not a focus retrofit checkpoint");
  json meta;
  try {
    meta = json::parse(md["focus_checkpoint"].get<std::string>());
  } catch (const json::exception& e) {
    fail(path, ": malformed checkpoint metadata: ", e.what());
  }
  if (meta["identity"] != identity)
    fail(path, ": the checkpoint was made with other settings; resume with the same flags (checkpoint: ",
         meta["identity"].dump(), ")");
  Checkpoint c;
  c.step = meta.at("step").get<int64_t>();
  c.train_tokens = meta.value("train_tokens", int64_t(0));
  c.seconds = meta.value("seconds", 0.0);
  c.before = valid_from_json(meta.at("before"));
  st.t = meta.at("adam_t").get<int64_t>();
  st.m.assign(f.routers.size(), {});
  st.v.assign(f.routers.size(), {});
  for (size_t r = 0; r < f.routers.size(); ++r) {
    const std::string p = "router." + std::to_string(r) + ".";
    auto get = [&](const std::string& n, size_t size) {
      std::vector<float> v = file.to_float(file.tensor(p + n));
      FOCUS_CHECK(v.size() == size, path, ": tensor '", p + n, "' has ", v.size(), " values, expected ", size);
      return v;
    };
    f.routers[r].params = get("params", f.routers[r].params.size());
    f.routers[r].bias = get("bias", f.routers[r].bias.size());
    if (r < balancers.size() && meta.contains("balance_load") && r < meta["balance_load"].size())
      balancers[r].load = meta["balance_load"][r].get<std::vector<double>>();
    if (st.t > 0) {
      st.m[r] = get("adam_m", f.routers[r].params.size());
      st.v[r] = get("adam_v", f.routers[r].params.size());
    } else {
      st.m[r].assign(f.routers[r].params.size(), 0.f);
      st.v[r].assign(f.routers[r].params.size(), 0.f);
    }
  }
  return c;
}

// Keeps the metrics lines of steps <= step (a resumed run rewrites what came after).
void trim_metrics(const std::string& path, int64_t step) {
  if (!fs::exists(path)) return;
  std::ifstream in(path);
  std::string line, kept;
  while (std::getline(in, line)) {
    try {
      if (json::parse(line).value("step", int64_t(0)) <= step) kept += line + "\n";
    } catch (const json::exception&) {
      // a torn last line from an interrupted write: dropped
    }
  }
  io::write_file_atomic(path, kept);
}

}  // namespace

ValidResult validate(const Model& m, const FocusRouters& f, const std::vector<std::vector<int32_t>>& ids,
                     const std::vector<std::vector<int32_t>>& targets, bool with_pretrained) {
  ValidResult v;
  FocusRouters soft = f, hard = f;
  soft.settings.mode = FocusMode::Soft;
  hard.settings.mode = FocusMode::Hard;
  FocusRouters hard2 = hard, win = f;
  win.settings.mode = FocusMode::Window;
  hard2.settings.topk = 2;
  double nll_win = 0, nll_pre = 0, nll_soft = 0, nll_hard = 0, nll_hard2 = 0;
  FocusStats st;
  for (size_t w = 0; w < ids.size(); ++w) {
    int64_t n = 0;
    if (with_pretrained) {
      nll_pre += window_nll(m, ids[w], targets[w], nullptr, nullptr, &n);
      nll_win += window_nll(m, ids[w], targets[w], &win, nullptr, &n);
    }
    nll_soft += window_nll(m, ids[w], targets[w], &soft, nullptr, &n);
    nll_hard += window_nll(m, ids[w], targets[w], &hard, &st, &n);
    if (f.settings.groups >= 2) nll_hard2 += window_nll(m, ids[w], targets[w], &hard2, nullptr, &n);
    v.tokens += n;
  }
  v.ppl_pretrained = with_pretrained ? ppl_of(nll_pre, v.tokens) : 0;
  v.ppl_window = with_pretrained ? ppl_of(nll_win, v.tokens) : 0;
  v.ppl_soft = ppl_of(nll_soft, v.tokens);
  v.ppl_hard = ppl_of(nll_hard, v.tokens);
  v.ppl_hard_k2 = f.settings.groups >= 2 ? ppl_of(nll_hard2, v.tokens) : 0;
  v.density_hard = st.density();
  v.load_max_over_mean = st.load_max_over_mean;
  return v;
}

RetrofitResult run_retrofit(const Model& m, const RetrofitOptions& o) {
  FOCUS_CHECK(m.tok, "retrofit: the model has no tokenizer");
  FOCUS_CHECK(!o.train.empty(), "retrofit: give at least one --train file");
  FOCUS_CHECK(!o.valid.empty(), "retrofit: give at least one --valid file");
  FOCUS_CHECK(!o.out.empty(), "retrofit: give --out DIR");
  FOCUS_CHECK(o.steps >= 0 && o.batch >= 1 && o.ctx >= 8, "retrofit: need steps >= 0, batch >= 1, ctx >= 8");
  {
    std::set<std::string> tr;
    for (const auto& t : o.train) tr.insert(fs::weakly_canonical(t).string());
    for (const auto& v : o.valid)
      FOCUS_CHECK(!tr.count(fs::weakly_canonical(v).string()), v,
                  ": a document cannot be both training and validation text (split by document)");
  }
  if (m.cfg.learned_pos)
    FOCUS_CHECK(o.ctx <= m.cfg.max_ctx, "retrofit: ctx ", o.ctx, " exceeds the model's ", m.cfg.max_ctx,
                " positions");
  std::error_code ec;
  fs::create_directories(o.out, ec);
  FOCUS_CHECK(!ec, o.out, ": cannot create the output folder: ", ec.message());

  const int32_t bos = m.tok->bos();
  const auto train_docs = tokenize_docs(*m.tok, o.train);
  const auto valid_docs = tokenize_docs(*m.tok, o.valid);
  std::vector<std::vector<int32_t>> vids, vtgt;
  for (const auto& r : validation_windows(valid_docs, o.ctx, bos, o.valid_windows)) {
    Window w = make_window(valid_docs, r, o.ctx, bos);
    vids.push_back(std::move(w.ids));
    vtgt.push_back(std::move(w.targets));
  }
  std::fprintf(stderr, "[retrofit] train %lld tokens in %zu docs, valid %zu windows of %lld from %zu docs\n",
               (long long)total_tokens(train_docs), train_docs.size(), vids.size(), (long long)o.ctx,
               valid_docs.size());

  FocusSettings fs_ = o.focus;
  fs_.mode = FocusMode::Soft;
  FocusRouters f = focus_init(m.cfg, fs_, o.seed);
  FOCUS_CHECK(!f.routers.empty(), "retrofit: the model has no global attention layer to route");
  AdamWState st;
  Checkpoint ck;
  std::vector<BiasBalancer> balancers;
  if (o.balance == Balance::Bias)
    for (size_t r = 0; r < f.routers.size(); ++r)
      balancers.emplace_back(f.settings.groups, o.balance_weight, 0.9f, BiasRule::kSign);
  const json identity = run_identity(m, o);
  const std::string ckpt_path = (fs::path(o.out) / "checkpoint.safetensors").string();
  const std::string metrics_path = (fs::path(o.out) / "metrics.jsonl").string();
  bool have_before = false;
  if (o.resume && fs::exists(ckpt_path)) {
    ck = load_checkpoint(ckpt_path, f, st, identity, balancers);
    have_before = true;
    trim_metrics(metrics_path, ck.step);
    std::fprintf(stderr, "[retrofit] resuming from %s at step %lld\n", ckpt_path.c_str(), (long long)ck.step);
  } else {
    FOCUS_CHECK(!o.resume || !fs::exists(metrics_path), ckpt_path,
                ": --resume given but no checkpoint exists (start without --resume)");
    io::write_file_atomic(metrics_path, "");
  }
  std::ofstream metrics(metrics_path, std::ios::app);
  FOCUS_CHECK(metrics.good(), metrics_path, ": cannot open for writing");
  auto log = [&](const json& j) {
    metrics << j.dump() << "\n";
    metrics.flush();
  };

  RetrofitResult res;
  res.router_params = f.n_params();
  if (!have_before) {
    std::fprintf(stderr, "[retrofit] validating the pretrained model and the initial routers...\n");
    ck.before = validate(m, f, vids, vtgt, true);
    log({{"step", 0}, {"valid", valid_json(ck.before)}});
  }
  res.before = ck.before;

  std::vector<std::vector<float>*> params;
  for (auto& r : f.routers) params.push_back(&r.params);
  std::vector<std::vector<float>> grads(f.routers.size());

  // Auxiliary balancing inside the backward pass: SwAV targets from Sinkhorn over the window's
  // scores (no gradient), cross-entropy against p; or load observation for the bias rule.
  float swav_scale = 0;
  RouterAuxHook hook = nullptr;
  if (o.balance == Balance::Swav)
    hook = [&](int64_t r, const RouterCache& rc, float* ds) {
      const int64_t n = rc.n, G = f.settings.groups;
      std::vector<float> q(n * G);
      sinkhorn_forward(rc.s.data(), n, G, 1.0f, 3, q.data());
      swav_loss_backward(rc.s.data(), f.routers[r].bias.data(), q.data(), n, G, swav_scale, ds);
    };
  else if (o.balance == Balance::Bias)
    hook = [&](int64_t r, const RouterCache& rc, float*) { balancers[r].observe_soft(rc.p.data(), rc.n); };

  install_interrupt_handler();
  Progress bar("retrofit", o.steps, "step");
  const auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [&] { return ck.seconds + std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  auto last_ckpt = std::chrono::steady_clock::now();
  const int64_t tokens_per_step = o.batch * (o.ctx - 1);
  int64_t step = ck.step;
  const int64_t first_step = ck.step;
  double run_tokens = 0;
  const auto run_start = std::chrono::steady_clock::now();
  while (step < o.steps) {
    if (interrupted() || (o.stop_after > 0 && step - first_step >= o.stop_after)) {
      res.interrupted = true;
      break;
    }
    for (auto& g : grads) g.assign(g.empty() ? 0 : g.size(), 0.f);
    for (size_t r = 0; r < f.routers.size(); ++r) grads[r].assign(f.routers[r].params.size(), 0.f);
    const float loss_scale = 1.0f / (float)tokens_per_step;
    swav_scale = o.balance_weight / (float)o.batch;
    double loss = 0;
    for (int64_t b = 0; b < o.batch; ++b) {
      const Window w = make_window(train_docs, sample_window(train_docs, o.ctx, bos, o.seed, step, b), o.ctx, bos);
      const TrainWindow tw{w.ids.data(), (int64_t)w.ids.size(), w.targets.data()};
      loss += focus_router_loss_and_grad(m, f, tw, loss_scale, &grads, hook).loss_sum;
    }
    const float lr = lr_schedule(o.adam.lr, step, o.steps, o.warmup);
    const double gnorm = adamw_step(o.adam, lr, params, grads, st);
    for (size_t r = 0; r < balancers.size(); ++r) balancers[r].update(f.routers[r].bias.data());
    ++step;
    ck.step = step;
    ck.train_tokens += tokens_per_step;
    run_tokens += tokens_per_step;
    const double run_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
    const double train_nll = loss / tokens_per_step;
    log({{"step", step}, {"loss", train_nll}, {"lr", lr}, {"grad_norm", gnorm}, {"train_tokens", ck.train_tokens},
         {"seconds", elapsed()}, {"tokens_per_s", run_tokens / std::max(run_s, 1e-9)}});
    if (o.progress) {
      char extra[128];
      std::snprintf(extra, sizeof(extra), "loss %.4f lr %.2e  %.0f tok/s", train_nll, lr, run_tokens / std::max(run_s, 1e-9));
      bar.update(step, extra);
    }
    const bool last = step == o.steps;
    if (!last && o.eval_every > 0 && step % o.eval_every == 0) {
      const ValidResult v = validate(m, f, vids, vtgt, false);
      log({{"step", step}, {"valid", valid_json(v)}});
      std::fprintf(stderr, "\n[retrofit] step %lld: valid ppl soft %.3f hard %.3f (density %.3f, load %.2f)\n",
                   (long long)step, v.ppl_soft, v.ppl_hard, v.density_hard, v.load_max_over_mean);
    }
    if (!last && std::chrono::duration<double>(std::chrono::steady_clock::now() - last_ckpt).count() >=
                     o.checkpoint_seconds) {
      ck.seconds = elapsed();
      save_checkpoint(ckpt_path, f, st, ck, identity, balancers);
      last_ckpt = std::chrono::steady_clock::now();
    }
  }
  if (o.progress) bar.finish();
  res.steps = step;
  res.train_tokens = ck.train_tokens;
  res.seconds = elapsed();
  const double run_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
  res.tokens_per_s = run_tokens > 0 ? run_tokens / run_s : 0;
  ck.seconds = res.seconds;
  save_checkpoint(ckpt_path, f, st, ck, identity, balancers);
  save_focus(f, o.out, m.cfg, m.path);
  if (res.interrupted) {
    std::fprintf(stderr, "[retrofit] interrupted at step %lld; checkpoint saved, continue with --resume\n",
                 (long long)step);
    return res;
  }
  res.after = validate(m, f, vids, vtgt, false);
  res.after.ppl_pretrained = res.before.ppl_pretrained;
  res.after.ppl_window = res.before.ppl_window;
  log({{"step", step}, {"valid", valid_json(res.after)}, {"final", true}});
  return res;
}

}  // namespace focus
