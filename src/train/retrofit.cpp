#include "train/retrofit.h"

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "eval/perplexity.h"
#include "focus/balancing.h"
#include "io/safetensors.h"
#include "io/safetensors_writer.h"
#include "train/backward.h"

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
          {"tokens", v.tokens},                 {"captured", v.captured},         {"far_mass", v.far_mass}};
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
  v.captured = j.value("captured", 0.0);
  if (j.contains("far_mass")) v.far_mass = j["far_mass"].get<std::vector<float>>();
  return v;
}

// The settings a checkpoint must share with the run that resumes it: everything that shapes the
// trained routers (data, optimizer, schedule, router shape, balancing) or the recorded validation
// (files, windows, hard top-k).
json run_identity(const Model& m, const RetrofitOptions& o) {
  json j = train_options_identity(m, o);
  j.update({{"window", o.focus.local_window},
            {"sinks", o.focus.sinks},
            {"groups", o.focus.groups},
            {"dg", o.focus.dg},
            {"topk", o.focus.topk},
            {"tau", o.focus.tau},
            {"learn_tau", o.focus.learn_tau},
            {"balance", balance_name(o.balance)},
            {"balance_weight", o.balance_weight},
            {"init", o.init},
            {"objective", o.objective}});
  if (o.objective == "distill")
    j["key_weight"] = o.distill.key_weight;
  if (o.objective == "distill" && o.distill.residual) {  // the target: what these budgets leave unread
    const BlockBudget& b = *o.distill.residual;
    j["residual_budget"] = json{{"block", b.block}, {"window", b.window}, {"sinks", b.sinks}, {"k", b.k}};
  }
  if (o.objective != "lm")
    j.update({
              {"key_capacity", o.focus.key_capacity},
              {"per_kv_head", o.focus.per_kv_head},
              {"per_head", o.focus.per_head},
              {"route_on_qk", o.focus.route_on_qk}});
  if (o.focus.group_bias) j["group_bias"] = true;
  if (o.focus.far_bias) j["far_bias"] = true;
  if (o.focus.blocks > 0 || !o.block_budget.empty())
    j.update({{"blocks", o.focus.blocks}, {"block_size", o.focus.block_size}, {"block_budget", o.block_budget}});
  if (!o.block_near.empty()) j["block_near"] = o.block_near;
  if (!o.block_group.empty()) j["block_group"] = o.block_group;
  if (o.focus.block_select_every != 1) j["block_select_every"] = o.focus.block_select_every;
  return j;
}

// Replaces the seeded routers of f by those saved in dir (the settings that define the
// parameters must agree; errors name the folder's focus.json).
void init_from(FocusRouters& f, const std::string& dir, const ModelConfig& c) {
  const FocusRouters g = load_focus(dir, c);
  const std::string jp = dir + "/focus.json";
  const FocusSettings &a = f.settings, &b = g.settings;
  FOCUS_CHECK(a.asymmetric == b.asymmetric && a.per_kv_head == b.per_kv_head && a.per_head == b.per_head &&
                  a.route_on_qk == b.route_on_qk,
              jp, ": --init routers are of another kind (symmetric / asymmetric, per layer / kv head / query head)");
  FOCUS_CHECK(a.groups == b.groups && a.dg == b.dg && a.learn_tau == b.learn_tau, jp,
              ": --init routers have groups ", b.groups, ", d_g ", b.dg, b.learn_tau ? ", learned tau" : "",
              "; this run asks for groups ", a.groups, ", d_g ", a.dg, a.learn_tau ? ", learned tau" : "");
  FOCUS_CHECK(a.learn_tau || a.tau == b.tau, jp, ": --init routers use tau ", b.tau, "; this run asks for tau ", a.tau);
  FOCUS_CHECK(g.router_of_layer == f.router_of_layer, jp, ": --init routers sit on other layers than this model routes");
  FOCUS_CHECK(a.far_bias || !b.far_bias, jp, ": --init routers carry far-pair terms; this run has none (--far-bias)");
  for (size_t r = 0; r < f.routers.size(); ++r) {
    // Far-pair terms come last in the parameters: routers without them start these runs at zero.
    std::copy(g.routers[r].params.begin(), g.routers[r].params.end(), f.routers[r].params.begin());
    f.routers[r].bias = g.routers[r].bias;
  }
}

// Asymmetric routers have no soft form: the pretrained model, the window baseline, hard top-k and
// hard 2k (k2 field), and the share of the far attention mass that top-k reads.
ValidResult validate_asymmetric(const Model& m, const FocusRouters& f, const std::vector<std::vector<int32_t>>& ids,
                                const std::vector<std::vector<int32_t>>& targets, bool with_pretrained) {
  ValidResult v;
  FocusRouters hard = f, win = f;
  hard.settings.mode = FocusMode::Hard;
  win.settings.mode = FocusMode::Window;
  FocusRouters hard2 = hard;
  hard2.settings.topk = (int)std::min<int64_t>(2 * f.settings.topk, f.settings.groups);
  const AttentionPlan p_hard = focus_plan(m.cfg, hard), p_hard2 = focus_plan(m.cfg, hard2),
                      p_win = focus_plan(m.cfg, win);
  double nll_win = 0, nll_pre = 0, nll_hard = 0, nll_hard2 = 0;
  AttentionStats st;
  DistillStats ds;
  for (size_t w = 0; w < ids.size(); ++w) {
    int64_t n = 0;
    if (with_pretrained) {
      nll_pre += window_nll(m, ids[w], targets[w], nullptr, nullptr, &n);
      nll_win += window_nll(m, ids[w], targets[w], &p_win, nullptr, &n);
    }
    nll_hard += window_nll(m, ids[w], targets[w], &p_hard, &st, &n);
    nll_hard2 += window_nll(m, ids[w], targets[w], &p_hard2, nullptr, &n);
    v.tokens += n;
    const TrainWindow tw{ids[w].data(), (int64_t)ids[w].size(), targets[w].data()};
    distill_loss_and_grad(m, f, tw, 1.0f, DistillOptions{}, nullptr, &ds);
  }
  v.ppl_pretrained = with_pretrained ? ppl_of(nll_pre, v.tokens) : 0;
  v.ppl_window = with_pretrained ? ppl_of(nll_win, v.tokens) : 0;
  v.ppl_hard = ppl_of(nll_hard, v.tokens);
  v.ppl_hard_k2 = ppl_of(nll_hard2, v.tokens);
  v.density_hard = st.density();
  v.load_max_over_mean = st.load_max_over_mean;
  v.captured = ds.far_total > 0 ? ds.captured / ds.far_total : 0;
  v.far_mass = ds.far_mass();
  return v;
}

}  // namespace

ValidResult validate(const Model& m, const FocusRouters& f, const std::vector<std::vector<int32_t>>& ids,
                     const std::vector<std::vector<int32_t>>& targets, bool with_pretrained) {
  ValidResult v;
  if (f.settings.asymmetric) return validate_asymmetric(m, f, ids, targets, with_pretrained);
  FocusRouters soft = f, hard = f;
  soft.settings.mode = FocusMode::Soft;
  hard.settings.mode = FocusMode::Hard;
  FocusRouters hard2 = hard, win = f;
  win.settings.mode = FocusMode::Window;
  hard2.settings.topk = 2;
  double nll_win = 0, nll_pre = 0, nll_soft = 0, nll_hard = 0, nll_hard2 = 0;
  const AttentionPlan p_soft = focus_plan(m.cfg, soft), p_hard = focus_plan(m.cfg, hard),
                      p_hard2 = focus_plan(m.cfg, hard2), p_win = focus_plan(m.cfg, win);
  AttentionStats st;
  for (size_t w = 0; w < ids.size(); ++w) {
    int64_t n = 0;
    if (with_pretrained) {
      nll_pre += window_nll(m, ids[w], targets[w], nullptr, nullptr, &n);
      nll_win += window_nll(m, ids[w], targets[w], &p_win, nullptr, &n);
    }
    nll_soft += window_nll(m, ids[w], targets[w], &p_soft, nullptr, &n);
    nll_hard += window_nll(m, ids[w], targets[w], &p_hard, &st, &n);
    if (f.settings.groups >= 2) nll_hard2 += window_nll(m, ids[w], targets[w], &p_hard2, nullptr, &n);
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

RouterAuxHook swav_balance_hook(const FocusRouters& f, float scale, double* loss_sum, int64_t* terms) {
  return [&f, scale, loss_sum, terms](int64_t r, const RouterCache& rc, float* ds) {
    const int64_t n = rc.n, G = f.settings.groups;
    std::vector<float> q(n * G);
    sinkhorn_forward(rc.s.data(), n, G, 1.0f, 3, q.data());
    const float* bias = f.routers[r].bias.data();
    *loss_sum += swav_loss_forward(rc.s.data(), bias, q.data(), n, G);
    ++*terms;
    swav_loss_backward(rc.s.data(), bias, q.data(), n, G, scale, ds);
  };
}

RetrofitResult run_retrofit(const Model& m, const RetrofitOptions& o) {
  const TrainData d = prepare_train_data(m, o, "retrofit");
  MemoryNeed need = training_memory(m.cfg, o.ctx, o.focus.groups, 0);
  if (o.objective == "distill" && o.distill.residual)  // one layer's pairs read by the blocks, and their transpose
    need.add("pairs the blocks read", 2.0 * m.cfg.heads * o.ctx * ((o.ctx + 63) / 64) * 8);
  if (o.focus.blocks > 0 || !o.block_budget.empty()) {  // each layer's blocks read, one bit per (head, row, block)
    const double words = (double)((o.ctx + o.focus.block_size - 1) / std::max<int64_t>(1, o.focus.block_size) + 63) / 64;
    need.add("blocks read (every layer)", (double)m.cfg.layers * m.cfg.heads * o.ctx * words * 8);
  }
  check_memory("retrofit at ctx " + std::to_string(o.ctx), need, "lower --ctx");

  FOCUS_CHECK(o.objective == "lm" || o.objective == "distill" || o.objective == "sparse",
              "retrofit: unknown objective '", o.objective, "' (expected lm, distill or sparse)");
  const bool distill = o.objective == "distill", sparse = o.objective == "sparse";
  FocusSettings fs_ = o.focus;
  fs_.mode = distill || sparse ? FocusMode::Hard : FocusMode::Soft;
  fs_.asymmetric = distill || sparse;
  FOCUS_CHECK(!distill || o.balance == Balance::Swav, "retrofit: distillation balances the key groups with the "
              "SwAV loss (--balance swav, weight --balance-weight)");
  FOCUS_CHECK(!sparse || o.balance != Balance::Bias, "retrofit: sparse training balances the keys by capacity "
              "(and optionally --balance swav on their scores), not with --balance bias");
  FOCUS_CHECK(!sparse || !o.focus.route_on_qk, "retrofit: sparse training reads the hidden state (no --route-on-qk)");
  FOCUS_CHECK(!o.focus.group_bias || sparse, "retrofit: group weights (--group-bias) train with --objective sparse");
  FOCUS_CHECK(!o.focus.far_bias || sparse, "retrofit: far-pair terms (--far-bias) train with --objective sparse");
  FOCUS_CHECK(!sparse || !o.focus.per_head || m.cfg.heads == m.cfg.kv_heads, "retrofit: sparse training routes per "
              "layer or per kv head; routers per query head need as many kv heads as query heads (this model has ",
              m.cfg.heads, " and ", m.cfg.kv_heads, ")");
  FOCUS_CHECK(sparse || (o.focus.blocks == 0 && o.block_budget.empty()),
              "retrofit: positional blocks (the hybrid pattern) train with --objective sparse");
  FocusRouters f = focus_init(m.cfg, fs_, o.seed);
  FOCUS_CHECK(!f.routers.empty(), "retrofit: the model has no global attention layer to route");
  if (!o.init.empty()) init_from(f, o.init, m.cfg);
  if (!o.block_budget.empty())
    set_block_budget(f, m.cfg, o.block_budget, "retrofit --block-budget", o.block_near, o.block_group);
  std::vector<BiasBalancer> balancers;
  if (o.balance == Balance::Bias)
    for (size_t r = 0; r < f.routers.size(); ++r)
      balancers.emplace_back(f.settings.groups, o.balance_weight, 0.9f);

  // Auxiliary balancing inside the backward pass: SwAV targets from Sinkhorn over the window's
  // scores (no gradient), cross-entropy against p; or load observation for the bias rule.
  // The SwAV loss value (before weighting) is summed over a step's windows and routers and
  // logged as their mean ("swav_loss" in metrics.jsonl and the result).
  const float swav_scale = o.balance_weight / (float)o.batch;
  double swav_sum = 0;
  int64_t swav_terms = 0;
  RouterAuxHook hook = nullptr;
  if (o.balance == Balance::Swav)
    hook = swav_balance_hook(f, swav_scale, &swav_sum, &swav_terms);
  else if (o.balance == Balance::Bias)
    hook = [&](int64_t r, const RouterCache& rc, float*) { balancers[r].observe_soft(rc.p.data(), rc.n); };

  TrainTask task;
  task.name = "retrofit";
  task.identity = run_identity(m, o);
  for (size_t r = 0; r < f.routers.size(); ++r) {
    task.params.push_back(&f.routers[r].params);
    task.block_names.push_back("router." + std::to_string(r) + ".");
  }
  DistillStats dstats;
  DistillOptions dopt = o.distill;
  dopt.balance_weight = o.balance_weight;
  task.loss_and_grad = [&](const TrainWindow& w, float loss_scale, std::vector<std::vector<float>>& grads) {
    if (distill) return distill_loss_and_grad(m, f, w, loss_scale, dopt, &grads, &dstats).loss_sum;
    return focus_router_loss_and_grad(m, f, w, loss_scale, &grads, hook).loss_sum;
  };
  task.after_step = [&] {
    for (size_t r = 0; r < balancers.size(); ++r) balancers[r].update(f.routers[r].bias.data());
  };
  double last_swav = 0;
  if (distill)
    task.step_metrics = [&](json& line) {
      const double rows = std::max<double>(1, (double)dstats.rows);
      line["query_ce"] = dstats.query_ce / rows;
      line["key_purity"] = dstats.key_purity / rows;
      line["captured"] = dstats.far_total > 0 ? dstats.captured / dstats.far_total : 0.0;
      last_swav = dstats.swav / std::max<double>(1, (double)(dstats.far_sum.size() * o.batch));
      line["swav_loss"] = last_swav;
      dstats = DistillStats{};
    };
  else if (o.balance == Balance::Swav)
    task.step_metrics = [&](json& line) {
      last_swav = swav_terms > 0 ? swav_sum / (double)swav_terms : 0.0;
      line["swav_loss"] = last_swav;
      swav_sum = 0;
      swav_terms = 0;
    };
  task.validate = [&](ValidPhase phase, int64_t step, const json& before) {
    if (phase == ValidPhase::Initial) {
      std::fprintf(stderr, "[retrofit] validating the pretrained model and the initial routers...\n");
      const ValidResult v0 = validate(m, f, d.valid_ids, d.valid_targets, true);
      f.far_mass = v0.far_mass;
      return valid_json(v0);
    }
    ValidResult v = validate(m, f, d.valid_ids, d.valid_targets, false);
    if (phase == ValidPhase::Periodic) {
      if (distill)
        std::fprintf(stderr, "\n[retrofit] step %lld: valid ppl hard %.3f (density %.3f, load %.2f), far mass read %.3f\n",
                     (long long)step, v.ppl_hard, v.density_hard, v.load_max_over_mean, v.captured);
      else
        std::fprintf(stderr, "\n[retrofit] step %lld: valid ppl soft %.3f hard %.3f (density %.3f, load %.2f)\n",
                     (long long)step, v.ppl_soft, v.ppl_hard, v.density_hard, v.load_max_over_mean);
    } else {
      const ValidResult b = valid_from_json(before);
      v.ppl_pretrained = b.ppl_pretrained;
      v.ppl_window = b.ppl_window;
    }
    return valid_json(v);
  };
  task.save_outputs = [&] { save_focus(f, o.out, m.cfg, m.path); };
  // The balancing bias (no gradient) and the bias balancer's running group loads (in JSON, where
  // doubles round-trip exactly) travel with the checkpoint.
  task.save_state = [&](std::map<std::string, io::F32Tensor>& t, json& meta) {
    for (size_t r = 0; r < f.routers.size(); ++r)
      t["router." + std::to_string(r) + ".bias"] = {{(int64_t)f.routers[r].bias.size()}, f.routers[r].bias};
    json loads = json::array();
    for (const auto& b : balancers) loads.push_back(b.load);
    meta["balance_load"] = loads;
    meta["far_mass"] = f.far_mass;  // measured at the initial validation, saved with the routers
  };
  task.load_state = [&](const io::SafetensorsFile& file, const json& meta) {
    for (size_t r = 0; r < f.routers.size(); ++r) {
      const std::string n = "router." + std::to_string(r) + ".bias";
      std::vector<float> v = file.to_float(file.tensor(n));
      FOCUS_CHECK(v.size() == f.routers[r].bias.size(), file.path(), ": tensor '", n, "' has ", v.size(),
                  " values, expected ", f.routers[r].bias.size());
      f.routers[r].bias = std::move(v);
      if (r < balancers.size() && meta.contains("balance_load") && r < meta["balance_load"].size())
        balancers[r].load = meta["balance_load"][r].get<std::vector<double>>();
    }
    if (meta.contains("far_mass")) f.far_mass = meta["far_mass"].get<std::vector<float>>();
  };

  const TrainLoopResult lr = run_train_loop(o, d, task);
  RetrofitResult res;
  res.router_params = f.n_params();
  res.swav_loss = last_swav;
  res.before = valid_from_json(lr.before);
  if (!lr.interrupted) res.after = valid_from_json(lr.after);
  static_cast<TrainStats&>(res) = lr;
  return res;
}

}  // namespace focus
