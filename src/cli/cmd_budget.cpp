// focus budget: per-head block budgets for block top-k attention, measured on calibration text.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <set>
#include <nlohmann/json.hpp>

#include "cli/process.h"
#include "cli/setup.h"
#include "core/error.h"
#include "focus/block_budget.h"
#include "focus/focus_attention.h"
#include "focus/focus_model.h"
#include "io/text.h"

namespace focus::cli {
namespace {

struct BudgetFlags {
  ModelSetup s;
  std::vector<std::string> texts;
  std::string out, curves, from_curves, focus_dir;
  int topk = 0;
  int64_t ctx = 4096, max_tokens = 0, block = 8, window = 64, sinks = 1, k_max = 0, near_max = 0;
  bool group_switch = false;
  std::string metric = "mass";
  BudgetWeights weights;
  std::vector<double> mean_k;
  CLI::App* app = nullptr;
};

// "{k}" in the output path becomes the mean k (as written on the command line's terms: 96, 96.5).
std::string out_path(const std::string& pattern, double mean_k) {
  const size_t at = pattern.find("{k}");
  if (at == std::string::npos) return pattern;
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", mean_k);
  return pattern.substr(0, at) + buf + pattern.substr(at + 3);
}

// Writes the budgets of one mean k and prints what they miss against uniform k, per layer.
nlohmann::json write_budget(const BudgetFlags& f, const BlockMassCurves& cv, double mean_k, size_t tokens, int64_t cap) {
  BlockBudget b;
  b.block = f.block;
  b.window = f.window;
  b.sinks = f.sinks;
  b.ctx = f.ctx;
  b.mean_k = mean_k;
  b.k = allocate_block_budget(cv, mean_k, cap, &b.near, f.group_switch ? &b.group : nullptr, f.weights);
  b.weights = f.weights;
  b.metric = cv.metric;
  auto near_of = [&](int64_t L, int64_t h) { return b.near.empty() ? int64_t{0} : b.near[L][h]; };
  auto keeps = [&](int64_t L, int64_t h) { return b.group.empty() || b.group[L][h] != 0; };
  const std::string out = out_path(f.out, mean_k);
  // Per layer, per row and head: the far probability, and what uniform k and the budgets miss.
  const int64_t H = cv.heads, ku = std::min<int64_t>(cv.k_max, (int64_t)std::llround(mean_k));
  double all_far = 0, all_uniform = 0, all_budget = 0;
  int64_t all_rows = 0;
  std::printf("\nblock %lld, window %lld, sinks %lld, mean k %g (k_max %lld), ctx %lld, %zu tokens\n",
              (long long)f.block, (long long)f.window, (long long)f.sinks, mean_k, (long long)cv.k_max,
              (long long)f.ctx, tokens);
  // Around groups: the far keys they read per row and head (their cost, to weigh against blocks).
  const bool grouped = !cv.group_keys.empty();
  double all_gkeys = 0;
  if (cv.metric == BlockMetric::Output)
    std::printf("missed: the heads' attention output error ||o_read - o|| per row (--metric output)\n");
  std::printf("layer | far prob | missed, k=%lld each | missed, budgets |%s k per head%s%s\n", (long long)ku,
              grouped ? " group keys |" : "", b.near.empty() ? "" : " (near+ranked)",
              b.group.empty() ? "" : " (* : the head reads its groups)");
  int64_t kept = 0, heads = 0;
  b.layer_missed.assign(cv.layers, 0.0);
  b.layer_far.assign(cv.layers, 0.0);
  for (int64_t L = 0; L < cv.layers; ++L) {
    if (b.k[L].empty()) continue;
    double far = 0, uni = 0, bud = 0, gk = 0;
    for (int64_t h = 0; h < H; ++h) {
      far += cv.far[L * H + h];
      if (grouped && keeps(L, h)) gk += cv.group_keys[L * H + h];
      uni += cv.missed_at(L, h, ku);
      bud += cv.missed_for(L, h, near_of(L, h), b.k[L][h], keeps(L, h));
      kept += keeps(L, h);
      ++heads;
    }
    const double per = 1.0 / ((double)cv.rows[L] * (double)H);
    b.layer_far[L] = far * per;
    b.layer_missed[L] = bud * per;
    all_far += far;
    all_uniform += uni;
    all_budget += bud;
    all_rows += cv.rows[L] * H;
    all_gkeys += gk;
    std::string ks, gcol;
    for (int64_t h = 0; h < H; ++h)
      ks += (h ? " " : "") + (b.near.empty() ? "" : std::to_string(near_of(L, h)) + "+") + std::to_string(b.k[L][h]) +
            (!b.group.empty() && keeps(L, h) ? "*" : "");
    if (grouped) {
      char buf[32];
      std::snprintf(buf, sizeof buf, " %10.1f |", gk * per);
      gcol = buf;
    }
    std::printf("%5lld | %8.4f | %18.4f | %15.4f |%s %s\n", (long long)L, far * per, uni * per, bud * per,
                gcol.c_str(), ks.c_str());
  }
  const double per = 1.0 / std::max<double>(1, (double)all_rows);
  std::printf("all   | %8.4f | %18.4f | %15.4f |", all_far * per, all_uniform * per, all_budget * per);
  if (grouped)
    std::printf(" %10.1f | (the groups' keys: %.1f blocks of %lld)", all_gkeys * per, all_gkeys * per / (double)f.block,
                (long long)f.block);
  std::printf("\n");
  if (!b.group.empty())
    std::printf("group switch (groups' mass weighted %g): %lld of %lld heads read their groups; the mean %g counts "
                "their keys in blocks\n", f.weights.group, (long long)kept, (long long)heads, mean_k);
  save_block_budget(out, b);
  if (grouped)  // measured around a hybrid's groups: for its routers
    std::printf("wrote %s (use: --focus DIR --mode hard --block-budget %s)\n", out.c_str(), out.c_str());
  else
    std::printf("wrote %s (use: --attention blocktopk:budget=%s)\n", out.c_str(), out.c_str());
  nlohmann::json j = {{"out", out},       {"block", f.block},         {"window", f.window},
                      {"sinks", f.sinks}, {"ctx", f.ctx},             {"mean_k", mean_k},
                      {"k_max", cv.k_max}, {"far", all_far * per},    {"missed_uniform", all_uniform * per},
                      {"missed_budget", all_budget * per}, {"tokens", tokens},
                      {"metric", block_metric_name(cv.metric)}};
  if (cv.near_max > 0) {
    j["near_max"] = cv.near_max;
    double near = 0;
    int64_t heads = 0;
    for (const auto& nl : b.near)
      for (int64_t n : nl) {
        near += (double)n;
        ++heads;
      }
    j["mean_near"] = heads ? near / (double)heads : 0.0;
    j["near_weight"] = f.weights.near;
  }
  if (grouped) j["group_keys"] = all_gkeys * per;
  if (!b.group.empty()) {
    j["heads_with_groups"] = kept;
    j["heads"] = heads;
    j["group_weight"] = f.weights.group;
  }
  return j;
}

int run_budget(const BudgetFlags& f) {
  double top = 0;
  std::set<std::string> outs;
  for (double k : f.mean_k) {
    FOCUS_CHECK(std::isfinite(k) && k > 0 && k <= (1 << 20), "budget: --mean-k must be in (0, 2^20], got ", k);
    top = std::max(top, k);
    FOCUS_CHECK(outs.insert(out_path(f.out, k)).second, "budget: two --mean-k values write ", out_path(f.out, k));
  }
  FOCUS_CHECK(f.group_switch || f.app->count("--group-weight") == 0, "budget: --group-weight needs --group-switch");
  FOCUS_CHECK(f.near_max > 0 || f.app->count("--near-weight") == 0 || !f.from_curves.empty(),
              "budget: --near-weight needs --near-max N");
  FOCUS_CHECK(f.mean_k.size() == 1 || f.out.find("{k}") != std::string::npos,
              "budget: with several --mean-k values, --out must hold {k} (e.g. budget_k{k}.json)");
  const int64_t k_max = f.k_max > 0 ? f.k_max : std::max<int64_t>(1, (int64_t)std::ceil(4 * top));
  FOCUS_CHECK(k_max >= top, "budget: --max-k ", k_max, " is below --mean-k ", top);
  BlockMassCurves cv;
  BudgetFlags g = f;  // the settings the budgets are written with: the curves' own when loaded
  size_t tokens = 0;
  if (!f.from_curves.empty()) {
    FOCUS_CHECK(f.s.model.empty() && f.texts.empty(), "budget: --from-curves replaces the calibration: drop --model and --text");
    for (const char* flag : {"--block-size", "--window", "--sinks", "--ctx", "--max-tokens", "--curves", "--focus",
                             "--topk", "--near-max", "--metric"})
      FOCUS_CHECK(f.app->count(flag) == 0, "budget: ", flag, " does not apply with --from-curves (the curves were measured with theirs)");
    cv = load_block_curves(f.from_curves, &g.ctx);
    FOCUS_CHECK(cv.near_max > 0 || f.app->count("--near-weight") == 0, f.from_curves,
                ": --near-weight needs curves measured with --near-max N");
    FOCUS_CHECK(!f.group_switch || !cv.missed_plain.empty(), f.from_curves,
                ": --group-switch needs curves measured around a hybrid's groups (focus budget --focus DIR --curves F)");
    g.block = cv.block;
    g.window = cv.window;
    g.sinks = cv.sinks;
    FOCUS_CHECK(cv.k_max >= top, f.from_curves, ": measured up to k ", cv.k_max, ", below --mean-k ", top);
  } else {
    FOCUS_CHECK(!f.s.model.empty() && !f.texts.empty(), "budget: give --model and --text (or --from-curves FILE)");
    FOCUS_CHECK(!f.group_switch || !f.focus_dir.empty(),
                "budget: --group-switch chooses per head between a hybrid's groups and blocks alone: give --focus DIR");
    const BlockMetric metric = parse_block_metric(f.metric, "budget: --metric");
    const Loaded l = f.s.load();
    const Model& m = *l.model;
    const std::vector<int32_t> ids = io::load_text_tokens(*m.tok, f.texts, f.max_tokens);
    tokens = ids.size();
    install_interrupt_handler();
    if (f.focus_dir.empty()) {
      cv = measure_block_mass(m, ids, f.ctx, f.block, f.window, f.sinks, k_max, true, f.near_max, metric);
    } else {
      // The hybrid's blocks: what its routers' groups leave unread is what the blocks must find.
      FocusRouters routers = load_focus(f.focus_dir, m.cfg);
      FOCUS_CHECK(routers.settings.asymmetric, f.focus_dir, ": block budgets for the hybrid need asymmetric routers");
      // Far-pair terms weight the pairs read but do not change which they are, so the budgets hold for
      // them too; group weights run on the soft kernel, which has no blocks.
      FOCUS_CHECK(!routers.settings.group_bias, f.focus_dir,
                  ": routers with group weights (group_bias) cannot be combined with blocks");
      cv = block_mass_curves(m.cfg, f.block, f.window, f.sinks, k_max, f.near_max);
      cv.metric = metric;
      FocusSettings& s = routers.settings;
      s.mode = FocusMode::Hard;
      s.local_window = f.window;
      s.sinks = f.sinks;
      if (f.topk > 0) s.topk = f.topk;
      FOCUS_CHECK(s.topk <= s.groups, "budget: --topk ", s.topk, " exceeds the routers' ", s.groups, " groups");
      s.topp = 0.f;
      s.blocks = 0;
      routers.block_budget.clear();
      s.block_calibration = &cv;
      const AttentionPlan plan = focus_plan(m.cfg, routers);
      run_block_calibration(m, ids, f.ctx, plan, cv, true);
    }
    FOCUS_CHECK(!interrupted(), "budget: interrupted before the calibration finished; nothing written");
    if (!f.curves.empty()) {
      save_block_curves(f.curves, cv, f.ctx);
      std::printf("wrote %s (curves: `focus budget --from-curves %s --mean-k K --out F` makes other budgets)\n",
                  f.curves.c_str(), f.curves.c_str());
    }
  }
  nlohmann::json all = nlohmann::json::array();
  for (double k : f.mean_k) all.push_back(write_budget(g, cv, k, tokens, f.k_max > 0 ? f.k_max : -1));
  if (f.s.as_json) std::cout << (all.size() == 1 ? all[0] : nlohmann::json{{"budgets", all}}).dump() << "\n";
  return 0;
}

}  // namespace

Command add_budget(CLI::App& app) {
  auto f = std::make_shared<BudgetFlags>();
  auto* sub = f->app = app.add_subcommand(
      "budget",
      "per-head block budgets for block top-k attention (--attention blocktopk:budget=FILE), measured on text");
  f->s.add_model(sub, false);
  sub->add_option("--text", f->texts, "calibration text files (keep them apart from the evaluation's)");
  sub->add_option("--curves", f->curves, "also write the measured curves here (safetensors)");
  sub->add_option("--from-curves", f->from_curves,
                  "make budgets from curves written by --curves instead of measuring (no --model, --text)");
  sub->add_option("--out", f->out, "budget file to write (JSON); {k} in it becomes the mean k")->required();
  sub->add_option("--mean-k", f->mean_k,
                  "blocks per query head on average over the routed layers (several: one file each, one calibration)")
      ->required()
      ->delimiter(',');
  sub->add_option("--max-k", f->k_max, "most blocks one head may get (default: 4 x mean k)");
  sub->add_option("--block-size", f->block, "keys per block");
  sub->add_option("--near-max", f->near_max,
                  "also let each head widen its window by up to N blocks (read whatever their bound; per-head "
                  "window widths), the mean k then counting them too (default 0: the window alone)")
      ->check(CLI::Range(0, 4096));
  sub->add_option("--window", f->window, "local window every query sees");
  sub->add_option("--sinks", f->sinks, "first keys every query sees");
  sub->add_option("--focus", f->focus_dir,
                  "asymmetric routers: budgets for the hybrid pattern, counting only what their groups leave "
                  "unread (run them with the same --window, --sinks and --topk)");
  sub->add_flag("--group-switch", f->group_switch,
               "with --focus (or curves measured with it): let each head drop its groups where blocks find more "
               "for the keys; the mean k then counts the kept groups' keys too, in blocks");
  sub->add_option("--near-weight", f->weights.near,
                  "with --near-max: what the mass of a near block is worth against a ranked block's (default 1)");
  sub->add_option("--group-weight", f->weights.group,
                  "with --group-switch: what the mass a group reads is worth against the mass blocks read "
                  "(default 1)");
  sub->add_option("--metric", f->metric,
                  "what the budgets minimise: mass (the attention probability left unread, default) or output "
                  "(how far each head's attention output moves, ||o_read - o||: the values count too)");
  sub->add_option("--topk", f->topk, "with --focus: the groups each query reads (default: the folder's)");
  sub->add_option("--ctx", f->ctx, "window length in tokens (incl. BOS): calibrate at the length you evaluate");
  sub->add_option("--max-tokens", f->max_tokens, "use only the first T text tokens");
  f->s.add_json(sub);
  return {sub, [f] { return run_budget(*f); }};
}

}  // namespace focus::cli
