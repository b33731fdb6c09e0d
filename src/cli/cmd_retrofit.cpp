// focus retrofit: train the Focus routers of a frozen model on text.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "cli/process.h"
#include "core/error.h"
#include "cli/setup.h"
#include "train/retrofit.h"

namespace focus::cli {
namespace {

struct RetrofitFlags {
  ModelSetup s;
  RetrofitOptions o;
  std::string balance = "none";
  std::string residual_budget, block_budget;
  CLI::App* app = nullptr;
};

int run_retrofit_cmd(const RetrofitFlags& f) {
  const Loaded l = f.s.load();
  const Model& m = *l.model;
  RetrofitOptions o = f.o;
  if (!o.init.empty()) {  // the router shape follows the --init folder unless a flag gives it
    const FocusSettings s = load_focus_settings(o.init, m.cfg);
    if (!f.app->count("--groups")) o.focus.groups = s.groups;
    if (!f.app->count("--dg")) o.focus.dg = s.dg;
    if (!f.app->count("--tau")) o.focus.tau = s.tau;
    if (!f.app->count("--learn-tau")) o.focus.learn_tau = s.learn_tau;
    o.focus.far_bias = o.focus.far_bias || s.far_bias;  // trained terms are kept
    if (s.asymmetric) {  // and so does the routing shape of asymmetric routers
      if (!f.app->count("--per-kv-head")) o.focus.per_kv_head = s.per_kv_head;
      if (!f.app->count("--per-head")) o.focus.per_head = s.per_head;
      if (!f.app->count("--route-on-qk")) o.focus.route_on_qk = s.route_on_qk;
      if (!f.app->count("--key-capacity")) o.focus.key_capacity = s.key_capacity;
    }
  }
  if (!f.residual_budget.empty()) {
    FOCUS_CHECK(o.objective == "distill", "--residual-budget needs --objective distill");
    auto b = std::make_shared<BlockBudget>(load_block_budget(f.residual_budget));
    FOCUS_CHECK(b->group.empty(), f.residual_budget,
                ": a budget with a group switch is for the hybrid's evaluation; the residual is block top-k's own");
    check_block_budget(*b, o.focus.local_window, o.focus.sinks, m.cfg, f.residual_budget);
    o.distill.residual = b;
  }
  if (!f.block_budget.empty()) {
    FOCUS_CHECK(!f.app->count("--blocks") && !f.app->count("--block-size"),
                "--block-budget sets each head's blocks and their size: drop --blocks and --block-size");
    const BlockBudget b = load_block_budget(f.block_budget);
    check_block_budget(b, o.focus.local_window, o.focus.sinks, m.cfg, f.block_budget);
    o.focus.block_size = b.block;
    o.block_budget = b.k;
    o.block_near = b.near;
    o.block_group = b.group;
  }
  FOCUS_CHECK(!f.app->count("--block-select-every") || o.focus.blocks > 0 || !o.block_budget.empty(),
              "--block-select-every applies to the hybrid pattern: give --blocks K or --block-budget too");
  FOCUS_CHECK(!f.app->count("--block-size") || o.focus.blocks > 0, "--block-size applies to the hybrid pattern: give --blocks K too");
  o.balance = parse_balance(f.balance);
  if (o.objective == "distill" && !f.app->count("--balance")) o.balance = Balance::Swav;
  install_interrupt_handler();
  const RetrofitResult r = run_retrofit(m, o);
  auto row = [](const char* name, double a, double b) { std::printf("  %-28s %10.3f %10.3f\n", name, a, b); };
  std::printf("\nretrofit of %s: %lld steps, %lld training tokens, %.1f tok/s, %lld router parameters\n",
              m.path.c_str(), (long long)r.steps, (long long)r.train_tokens, r.tokens_per_s,
              (long long)r.router_params);
  std::printf("validation perplexity (%lld tokens)      before      after\n", (long long)r.before.tokens);
  row("pretrained (full attention)", r.before.ppl_pretrained, r.before.ppl_pretrained);
  row("sliding window + sinks only", r.before.ppl_window, r.before.ppl_window);
  const bool asym = o.objective != "lm";
  const int k = o.focus.topk, k2 = asym ? (int)std::min<int64_t>(2 * k, o.focus.groups) : 2;
  const std::string hk = "Focus hard top-" + std::to_string(k), hk2 = "Focus hard top-" + std::to_string(k2);
  if (!asym) row("Focus soft", r.before.ppl_soft, r.after.ppl_soft);
  row(hk.c_str(), r.before.ppl_hard, r.after.ppl_hard);
  if (r.after.ppl_hard_k2 > 0) row(hk2.c_str(), r.before.ppl_hard_k2, r.after.ppl_hard_k2);
  std::printf("  hard top-%d density %.3f -> %.3f of causal pairs; group load max/mean %.2f -> %.2f\n", k,
              r.before.density_hard, r.after.density_hard, r.before.load_max_over_mean, r.after.load_max_over_mean);
  if (asym)
    std::printf("  far attention mass read by the top-%d groups: %.3f -> %.3f\n", k, r.before.captured, r.after.captured);
  std::printf("routers written to %s (focus.json, router.safetensors, metrics.jsonl)\n", o.out.c_str());
  if (f.s.as_json) {
    nlohmann::json j{{"valid_ppl_pretrained", r.before.ppl_pretrained},
                     {"valid_ppl_window", r.before.ppl_window},
                     {"valid_ppl_soft", r.after.ppl_soft},
                     {"valid_ppl_hard", r.after.ppl_hard},
                     {"valid_ppl_hard_k2", r.after.ppl_hard_k2},
                     {"valid_ppl_soft_before", r.before.ppl_soft},
                     {"valid_ppl_hard_before", r.before.ppl_hard},
                     {"density_hard", r.after.density_hard},
                     {"load_max_over_mean", r.after.load_max_over_mean},
                     {"train_tokens", r.train_tokens},
                     {"tokens_per_s", r.tokens_per_s},
                     {"steps", r.steps},
                     {"router_params", r.router_params},
                     {"interrupted", r.interrupted},
                     {"out", o.out}};
    if (o.balance == Balance::Swav) j["swav_loss"] = r.swav_loss;
    if (asym) {
      j["captured"] = r.after.captured;
      j["captured_before"] = r.before.captured;
      j["far_mass"] = r.after.far_mass;
    }
    std::cout << j.dump() << "\n";
  }
  return r.interrupted ? 130 : 0;
}

}  // namespace

Command add_retrofit(CLI::App& app) {
  auto f = std::make_shared<RetrofitFlags>();
  auto* sub = app.add_subcommand("retrofit", "train the Focus routers of a frozen model on text");
  f->app = sub;
  RetrofitOptions& o = f->o;
  add_train_options(sub, o, f->s, "router");
  sub->add_option("--window", o.focus.local_window, "Focus local window");
  sub->add_option("--sinks", o.focus.sinks, "sink tokens");
  sub->add_option("--groups", o.focus.groups, "groups G");
  sub->add_option("--dg", o.focus.dg, "routing dimension d_g");
  sub->add_option("--topk", o.focus.topk, "top-k for hard validation");
  sub->add_option("--tau", o.focus.tau, "router temperature (the initial value with --learn-tau)");
  sub->add_flag("--learn-tau", o.focus.learn_tau, "train each router's temperature too");
  sub->add_option("--balance", f->balance, "group balancing: none, swav (Sinkhorn targets), bias (load-driven bias)");
  sub->add_option("--balance-weight", o.balance_weight, "SwAV loss weight or bias rate");
  sub->add_option("--objective", o.objective,
                  "lm: the language-model loss through soft attention; distill: asymmetric routers taught the "
                  "frozen model's attention mass by group (dense forward, SwAV-balanced keys); sparse: asymmetric "
                  "routers trained with the language-model loss through the pattern inference uses (keys in their "
                  "capacity-balanced group, queries reading their top-k; straight-through gradients), usually from "
                  "--init routers trained by distillation")
      ->check(CLI::IsMember({"lm", "distill", "sparse"}));
  sub->add_flag("--group-bias", o.focus.group_bias,
                "sparse: each far pair read carries log(p_query(g) / max p_query) + log(p_key(g) / max p_key), the "
                "routers' probabilities of its group relative to their best (trained through them; saved in "
                "focus.json, evaluated on whole windows)");
  sub->add_flag("--far-bias", o.focus.far_bias,
                "sparse: each far pair read also carries e_query(i) + e_key(j), each linear in the router's input and "
                "zero at the start (a learned weighting of the far keys read; saved in focus.json, evaluated on whole "
                "windows; --init routers without it start from the unweighted pattern)");
  sub->add_flag("--route-on-qk", o.focus.route_on_qk,
                "distill: routers read the rotated query and key vectors (width head_dim) instead of the hidden state");
  sub->add_flag("--per-kv-head", o.focus.per_kv_head, "distill, sparse: one router per kv head (its query heads follow it)");
  sub->add_flag("--per-head", o.focus.per_head, "distill, sparse: one router per query head (keys routed once per router)");
  sub->add_option("--key-weight", o.distill.key_weight, "distill: weight of the key purity term");
  sub->add_option("--residual-budget", f->residual_budget,
                  "distill: per-head block budgets (`focus budget`, same window and sinks); the routers learn only "
                  "the far attention that block top-k with them leaves unread (the groups of a hybrid pattern)");
  sub->add_option("--blocks", o.focus.blocks,
                  "sparse: train through the hybrid pattern: each query head also reads the block of its last far "
                  "key and this many more positional blocks with the largest bound of q.k (as `focus eval --blocks`); "
                  "saved in focus.json")
      ->check(CLI::Range(0, 1 << 20));
  sub->add_option("--block-size", o.focus.block_size, "sparse, the hybrid pattern: keys per block (default 64)")
      ->check(CLI::Range(1, 1 << 20));
  sub->add_option("--block-select-every", o.focus.block_select_every,
                  "sparse, the hybrid pattern: blocks chosen once every this many rows, by each tile's first row "
                  "(as `focus eval --block-select-every`); saved in focus.json")
      ->check(CLI::Range(1, 1 << 20));
  sub->add_option("--block-budget", f->block_budget,
                  "sparse: the hybrid pattern with each head's own number of blocks, a budget file of `focus budget` "
                  "(it sets the block size; its window and sinks must be this run's; its near blocks and group switch, if any, "
                  "are trained through too); saved in focus.json");
  sub->add_option("--key-capacity", o.focus.key_capacity,
                  "distill, sparse: a group holds at most this times the mean key load (sparse: in training too)");
  sub->add_option("--init", o.init,
                  "start from the routers in this folder (continue training: more text, longer --ctx); "
                  "--groups, --dg, --tau, --learn-tau (and for asymmetric routers --per-kv-head, --per-head, "
                  "--route-on-qk, --key-capacity) default to the folder's");
  return {sub, [f] { return run_retrofit_cmd(*f); }};
}

}  // namespace focus::cli
