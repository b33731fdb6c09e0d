// The focus command: subcommands parse flags and call the library; no logic of their own.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>

#include "core/error.h"
#include "core/progress.h"
#include "core/threads.h"
#include "eval/groups_report.h"
#include "eval/perplexity.h"
#include "eval/tasks.h"
#include "eval/bench_attention.h"
#include "focus/focus_attention.h"
#include "focus/focus_model.h"
#include "io/text.h"
#include "io/tokenizer.h"
#include "kernels/cpu/ops.h"
#include "model/model.h"
#include "train/lora.h"
#include "train/lora_train.h"
#include "train/retrofit.h"

using namespace focus;
using json = nlohmann::json;

namespace {

std::string shape_str(const ModelConfig& c) {
  char b[512];
  std::snprintf(b, sizeof(b),
                "vocab %lld, dim %lld, layers %lld, heads %lld, kv heads %lld, head dim %lld, ffn %lld, ctx %lld",
                (long long)c.vocab, (long long)c.dim, (long long)c.layers, (long long)c.heads, (long long)c.kv_heads,
                (long long)c.head_dim, (long long)c.ffn, (long long)c.max_ctx);
  return b;
}

int cmd_info(const std::string& model, const std::string& tokenizer, bool as_json) {
  LoadOptions lo;
  lo.tokenizer = tokenizer;
  auto m = load_model(model, lo);
  const ModelConfig& c = m->cfg;
  json j;
  j["path"] = m->path;
  j["format"] = m->format;
  j["architecture"] = c.arch_name;
  j["vocab"] = c.vocab;
  j["dim"] = c.dim;
  j["layers"] = c.layers;
  j["heads"] = c.heads;
  j["kv_heads"] = c.kv_heads;
  j["head_dim"] = c.head_dim;
  j["ffn"] = c.ffn;
  j["context"] = c.max_ctx;
  j["params"] = m->w.n_params;
  j["tied_output"] = c.tied_output;
  j["tensor_types"] = m->w.tensor_types;
  j["layer_sliding_window"] = c.layer_sliding_window;
  j["rope"] = c.rope_dim == 0 ? "none"
                              : (c.rope_style == cpu::RopeStyle::Interleaved ? "interleaved" : "split-half");
  j["rope_theta"] = c.rope_theta;
  if (m->tok) j["tokenizer_vocab"] = m->tok->vocab_size();
  if (as_json) {
    std::cout << j.dump() << "\n";
    return 0;
  }
  std::printf("model:        %s (%s)\n", m->path.c_str(), m->format.c_str());
  std::printf("architecture: %s\n", c.arch_name.c_str());
  std::printf("sizes:        %s\n", shape_str(c).c_str());
  std::printf("parameters:   %lld (%.1f M)%s\n", (long long)m->w.n_params, m->w.n_params / 1e6,
              c.tied_output ? ", output tied to embeddings" : "");
  std::printf("positions:    %s, theta %g\n", j["rope"].get<std::string>().c_str(), c.rope_theta);
  int64_t local = 0;
  for (auto w : c.layer_sliding_window) local += w > 0;
  if (local) std::printf("attention:    %lld sliding-window layers (window %lld), %lld global\n", (long long)local,
                         (long long)c.layer_sliding_window[0], (long long)(c.layers - local));
  std::string types;
  for (auto& t : m->w.tensor_types) types += (types.empty() ? "" : ", ") + t;
  std::printf("tensor types: %s\n", types.c_str());
  if (m->tok) std::printf("tokenizer:    %d tokens, bos %d, eos %d\n", m->tok->vocab_size(), m->tok->bos(), m->tok->eos());
  return 0;
}

// Focus flags shared by the commands that run a model with routers.
struct FocusFlags {
  std::string dir;       // router folder, or "random"
  std::string mode;      // soft | hard | off (default: the folder's, or soft)
  int64_t window = -1, sinks = -1, groups = 16, dg = 16;
  int topk = 0;
  float tau = 0.1f;
  uint64_t seed = 1;
  void add(CLI::App* app) {
    app->add_option("--focus", dir, "router folder (focus.json + router.safetensors), or 'random'");
    app->add_option("--mode", mode, "Focus mode: soft (training form), hard (top-k sparse), window (local window + sinks only) or off");
    app->add_option("--topk", topk, "hard mode: groups kept per token (1 or 2)");
    app->add_option("--window", window, "Focus local window (default 64)");
    app->add_option("--sinks", sinks, "sink tokens visible to all (default 1)");
    app->add_option("--groups", groups, "groups G for a random router");
    app->add_option("--dg", dg, "routing dimension d_g for a random router");
    app->add_option("--tau", tau, "temperature for a random router");
    app->add_option("--router-seed", seed, "seed for a random router");
  }
  // Routers as the flags say, or none.
  std::unique_ptr<FocusRouters> make(const Model& m) const {
    if (dir.empty()) {
      FOCUS_CHECK(mode.empty() && topk == 0 && window < 0, "--mode/--topk/--window need --focus DIR (or --focus random)");
      return nullptr;
    }
    std::unique_ptr<FocusRouters> f;
    if (dir == "random") {
      FocusSettings s;
      s.groups = groups;
      s.dg = dg;
      s.tau = tau;
      if (window >= 0) s.local_window = window;
      if (sinks >= 0) s.sinks = sinks;
      if (topk) s.topk = topk;
      f = std::make_unique<FocusRouters>(focus_init(m.cfg, s, seed));
    } else {
      f = std::make_unique<FocusRouters>(load_focus(dir, m.cfg));
      if (window >= 0) f->settings.local_window = window;
      if (sinks >= 0) f->settings.sinks = sinks;
      if (topk) f->settings.topk = topk;
    }
    if (!mode.empty()) f->settings.mode = parse_focus_mode(mode);
    FOCUS_CHECK(f->settings.local_window >= 1, "--window must be >= 1");
    FOCUS_CHECK(f->settings.topk >= 1 && f->settings.topk <= 2 && f->settings.topk <= f->settings.groups,
                "--topk must be 1 or 2 (and at most the number of groups)");
    return f;
  }
};

// The text files prepared (Gutenberg boilerplate, BOM, CRLF) and tokenized, concatenated.
std::vector<int32_t> text_tokens(const Model& m, const std::vector<std::string>& texts, int64_t max_tokens) {
  std::vector<int32_t> ids;
  for (const auto& path : texts) {
    const std::string text = io::load_text(path);
    auto t = m.tok->encode(text, false);
    FOCUS_CHECK(!t.empty(), path, ": the text encodes to no tokens");
    ids.insert(ids.end(), t.begin(), t.end());
  }
  if (max_tokens > 0 && (int64_t)ids.size() > max_tokens) ids.resize(max_tokens);
  return ids;
}

int cmd_groups(const std::string& model, const std::string& tokenizer, const std::vector<std::string>& texts,
               int64_t ctx, int64_t max_tokens, int top_n, bool as_json, const FocusFlags& ff) {
  LoadOptions lo;
  lo.tokenizer = tokenizer;
  auto m = load_model(model, lo);
  FOCUS_CHECK(!ff.dir.empty(), "groups: give --focus DIR (routers to inspect)");
  auto focus = ff.make(*m);
  const std::vector<int32_t> ids = text_tokens(*m, texts, max_tokens);
  install_interrupt_handler();
  const GroupsReport r = groups_report(*m, *focus, ids, ctx, max_tokens, top_n, true);
  std::fputs(groups_report_text(*m, r).c_str(), stdout);
  if (as_json) std::cout << groups_report_json(*m, r).dump(-1, ' ', false, json::error_handler_t::replace) << "\n";
  return interrupted() ? 130 : 0;
}

int cmd_eval(const std::string& model, const std::string& tokenizer, const std::vector<std::string>& texts,
             int64_t ctx, int64_t stride, int64_t max_tokens, bool no_bos, bool as_json, const FocusFlags& ff,
             const std::string& lora_dir) {
  LoadOptions lo;
  lo.tokenizer = tokenizer;
  auto m = load_model(model, lo);
  if (!lora_dir.empty()) {
    load_and_apply_lora(*m, lora_dir);  // adapters merged into the weights
    std::printf("lora %s merged\n", lora_dir.c_str());
  }
  auto focus = ff.make(*m);
  const AttentionPlan plan = focus ? focus_plan(m->cfg, *focus) : AttentionPlan{};
  const AttentionPlan* attention = focus ? &plan : nullptr;
  const std::vector<int32_t> ids = text_tokens(*m, texts, max_tokens);
  PplOptions o;
  o.ctx = ctx;
  o.stride = stride;
  o.bos = !no_bos;
  o.progress = true;
  o.attention = attention;
  install_interrupt_handler();
  PplResult r = perplexity(*m, ids, o);
  std::string focus_desc = "off";
  if (focus) {
    const FocusSettings& s = focus->settings;
    focus_desc = to_string(s.mode) + " (window " + std::to_string(s.local_window) + ", sinks " + std::to_string(s.sinks) +
                 ", groups " + std::to_string(s.groups) + ", d_g " + std::to_string(s.dg) +
                 (s.mode == FocusMode::Hard ? ", top-" + std::to_string(s.topk) : "") + ", " +
                 std::to_string(focus->routers.size()) + " routers)";
    std::printf("focus %s\n", focus_desc.c_str());
    if ((s.mode == FocusMode::Hard || s.mode == FocusMode::Window) && r.attention.layers > 0)
      std::printf("%s pattern: density %.4f of causal pairs, group load max/mean %.2f (worst layer)\n",
                  to_string(s.mode).c_str(), r.attention.density(), r.attention.load_max_over_mean);
  }
  const double tps = r.processed / std::max(r.seconds, 1e-9);
  std::printf("model %s | ctx %lld | tokens scored %lld in %lld windows | nll %.5f | ppl %.4f | %.1f tok/s%s\n",
              m->path.c_str(), (long long)ctx, (long long)r.tokens, (long long)r.windows, r.nll(), r.ppl(), tps,
              r.interrupted ? " | INTERRUPTED (partial)" : "");
  if (as_json) {
    json j{{"model", m->path}, {"texts", texts},           {"ctx", ctx},           {"stride", o.stride ? o.stride : ctx},
           {"ppl", r.ppl()},   {"nll", r.nll()},           {"tokens", r.tokens},   {"windows", r.windows},
           {"tok_per_s", tps}, {"seconds", r.seconds},     {"threads", num_threads()},
           {"interrupted", r.interrupted}, {"focus", focus_desc}};
    if (!lora_dir.empty()) j["lora"] = lora_dir;
    if (focus && (focus->settings.mode == FocusMode::Hard || focus->settings.mode == FocusMode::Window) &&
        r.attention.layers > 0) {
      j["density"] = r.attention.density();
      j["load_max_over_mean"] = r.attention.load_max_over_mean;
    }
    std::cout << j.dump() << "\n";
  }
  return r.interrupted ? 130 : 0;
}

int cmd_generate(const std::string& model, const std::string& tokenizer, std::string prompt,
                 const std::string& prompt_file, int64_t n, float temp, uint64_t seed, bool print_ids,
                 const FocusFlags& ff) {
  LoadOptions lo;
  lo.tokenizer = tokenizer;
  auto m = load_model(model, lo);
  auto focus = ff.make(*m);
  const AttentionPlan plan = focus ? focus_plan(m->cfg, *focus) : AttentionPlan{};
  const AttentionPlan* attention = focus ? &plan : nullptr;
  if (!prompt_file.empty()) {
    FOCUS_CHECK(prompt.empty(), "generate: give --prompt or --prompt-file, not both");
    prompt = io::load_text(prompt_file);
    FOCUS_CHECK(!prompt.empty(), prompt_file, ": empty prompt file");
  }
  std::vector<int32_t> ids = m->tok->encode(prompt, m->tok->add_bos_default() || prompt.empty());
  FOCUS_CHECK(!ids.empty(), "generate: empty prompt and the model has no BOS token");
  const int64_t cap = std::min<int64_t>((int64_t)ids.size() + n, m->cfg.max_ctx > 0 ? m->cfg.max_ctx : 1 << 20);
  FOCUS_CHECK((int64_t)ids.size() < cap, "generate: the prompt fills the model's context (", m->cfg.max_ctx, ")");
  KVCache cache;
  cache.init(m->cfg, cap);
  std::vector<float> hidden(ids.size() * m->cfg.dim), logits(m->cfg.vocab);
  std::mt19937_64 rng(seed);
  install_interrupt_handler();
  if (prompt_file.empty()) std::fputs(prompt.c_str(), stdout);
  const auto tp = std::chrono::steady_clock::now();
  forward(*m, ids.data(), (int64_t)ids.size(), cache, hidden.data(), attention);
  compute_logits(*m, hidden.data() + (ids.size() - 1) * m->cfg.dim, 1, logits.data());
  std::vector<int32_t> out = ids;
  const auto t0 = std::chrono::steady_clock::now();
  AttentionStats decode_stats;
  int64_t made = 0;
  while (made < n && cache.len < cap && !interrupted()) {
    int32_t next = 0;
    if (temp <= 0.f) {
      next = (int32_t)(std::max_element(logits.begin(), logits.end()) - logits.begin());
    } else {
      float mx = *std::max_element(logits.begin(), logits.end());
      std::vector<double> p(logits.size());
      for (size_t i = 0; i < p.size(); ++i) p[i] = std::exp((logits[i] - mx) / temp);
      std::discrete_distribution<int32_t> d(p.begin(), p.end());
      next = d(rng);
    }
    std::fputs(m->tok->piece(next, out.back()).c_str(), stdout);
    std::fflush(stdout);
    out.push_back(next);
    ++made;
    if (next == m->tok->eos() && m->tok->eos() >= 0) break;
    if (made < n && cache.len < cap) {
      forward(*m, &next, 1, cache, hidden.data(), attention, &decode_stats);
      compute_logits(*m, hidden.data(), 1, logits.data());
    }
  }
  const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("\n");
  const double pl = std::chrono::duration<double>(t0 - tp).count();
  std::fprintf(stderr, "[generate] prompt %lld tokens in %.2fs (%.1f tok/s); %lld tokens in %.2fs (%.1f tok/s)\n",
               (long long)ids.size(), pl, ids.size() / std::max(pl, 1e-9), (long long)made, el,
               made / std::max(el, 1e-9));
  if (focus && decode_stats.layers > 0)
    std::fprintf(stderr, "[generate] Focus %s: decoding read %.3f of the causal keys in its Focus layers\n",
                 to_string(focus->settings.mode).c_str(), decode_stats.density());
  if (print_ids) {
    std::string s;
    for (size_t i = 0; i < out.size(); ++i) s += (i ? " " : "") + std::to_string(out[i]);
    std::printf("ids: %s\n", s.c_str());
  }
  return 0;
}

int cmd_tokenize(const std::string& model, const std::string& tokenizer, const std::string& prompt, bool bos) {
  std::unique_ptr<io::Tokenizer> tok;
  std::unique_ptr<Model> m;
  if (!model.empty()) {
    LoadOptions lo;
    lo.tokenizer = tokenizer;
    m = load_model(model, lo);
    tok = std::move(m->tok);
  } else {
    FOCUS_CHECK(!tokenizer.empty(), "tokenize: give --model or --tokenizer");
    tok = io::load_tokenizer(tokenizer);
  }
  auto ids = tok->encode(prompt, bos);
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? " " : "") + std::to_string(ids[i]);
  std::printf("%s\n", s.c_str());
  return 0;
}

int cmd_prepare(const std::string& in, const std::string& out) {
  io::PrepareStats st;
  const std::string s = io::load_text(in, &st);
  std::ofstream f(out, std::ios::binary);
  FOCUS_CHECK(f, out, ": cannot open for writing");
  f << s;
  FOCUS_CHECK(f.good(), out, ": write failed");
  std::fprintf(stderr, "%s -> %s: %zu -> %zu bytes%s%s%s\n", in.c_str(), out.c_str(), st.bytes_in, st.bytes_out,
               st.had_bom ? ", BOM dropped" : "", st.had_crlf ? ", CRLF -> LF" : "",
               st.gutenberg ? ", Gutenberg boilerplate stripped" : "");
  return 0;
}

// Which router-shaping flags the command line gave; with --init the others follow the folder.
struct RouterShapeGiven {
  bool groups, dg, tau, learn_tau;
};

int cmd_retrofit(const std::string& model, const std::string& tokenizer, RetrofitOptions o,
                 const RouterShapeGiven& given, const std::string& balance, bool as_json) {
  LoadOptions lo;
  lo.tokenizer = tokenizer;
  auto m = load_model(model, lo);
  if (!o.init.empty()) {
    const FocusSettings s = load_focus_settings(o.init, m->cfg);
    if (!given.groups) o.focus.groups = s.groups;
    if (!given.dg) o.focus.dg = s.dg;
    if (!given.tau) o.focus.tau = s.tau;
    if (!given.learn_tau) o.focus.learn_tau = s.learn_tau;
  }
  o.balance = parse_balance(balance);
  RetrofitResult r = run_retrofit(*m, o);
  auto row = [](const char* name, double a, double b) {
    std::printf("  %-28s %10.3f %10.3f\n", name, a, b);
  };
  std::printf("\nretrofit of %s: %lld steps, %lld training tokens, %.1f tok/s, %lld router parameters\n",
              m->path.c_str(), (long long)r.steps, (long long)r.train_tokens, r.tokens_per_s,
              (long long)r.router_params);
  std::printf("validation perplexity (%lld tokens)      before      after\n", (long long)r.before.tokens);
  row("pretrained (full attention)", r.before.ppl_pretrained, r.before.ppl_pretrained);
  row("sliding window + sinks only", r.before.ppl_window, r.before.ppl_window);
  row("Focus soft", r.before.ppl_soft, r.after.ppl_soft);
  row("Focus hard top-1", r.before.ppl_hard, r.after.ppl_hard);
  if (r.after.ppl_hard_k2 > 0) row("Focus hard top-2", r.before.ppl_hard_k2, r.after.ppl_hard_k2);
  std::printf("  hard top-1 density %.3f -> %.3f of causal pairs; group load max/mean %.2f -> %.2f\n",
              r.before.density_hard, r.after.density_hard, r.before.load_max_over_mean, r.after.load_max_over_mean);
  std::printf("routers written to %s (focus.json, router.safetensors, metrics.jsonl)\n", o.out.c_str());
  if (as_json) {
    json j{{"valid_ppl_pretrained", r.before.ppl_pretrained},
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
    std::cout << j.dump() << "\n";
  }
  return r.interrupted ? 130 : 0;
}

int cmd_lora(const std::string& model, const std::string& tokenizer, LoraOptions o, bool as_json) {
  LoadOptions lo;
  lo.tokenizer = tokenizer;
  auto m = load_model(model, lo);
  const LoraResult r = run_lora(*m, o);
  std::printf("\nLoRA of %s: rank %lld, alpha %g, targets %s, %lld steps, %lld training tokens, %.1f tok/s, "
              "%lld adapter parameters\n",
              m->path.c_str(), (long long)r.settings.rank, r.settings.alpha, r.settings.targets.c_str(),
              (long long)r.steps, (long long)r.train_tokens, r.tokens_per_s, (long long)r.params);
  if (r.interrupted)
    std::printf("validation perplexity (%lld tokens): pretrained %.3f (interrupted: no final validation)\n",
                (long long)r.before.tokens, r.before.ppl_pretrained);
  else
    std::printf("validation perplexity (%lld tokens): pretrained %.3f, LoRA merged %.3f\n", (long long)r.before.tokens,
                r.before.ppl_pretrained, r.after.ppl_lora);
  std::printf("adapters written to %s (lora.json, lora.safetensors, metrics.jsonl)\n", o.out.c_str());
  if (as_json) {
    json j{{"valid_ppl_pretrained", r.before.ppl_pretrained},
           {"valid_ppl_lora", r.interrupted ? 0.0 : r.after.ppl_lora},
           {"valid_tokens", r.before.tokens},
           {"train_tokens", r.train_tokens},
           {"tokens_per_s", r.tokens_per_s},
           {"steps", r.steps},
           {"params", r.params},
           {"rank", r.settings.rank},
           {"alpha", r.settings.alpha},
           {"targets", r.settings.targets},
           {"interrupted", r.interrupted},
           {"out", o.out}};
    std::cout << j.dump() << "\n";
  }
  return r.interrupted ? 130 : 0;
}

// The bench folder: --bench-dir, else $FOCUS_DATA/bench, else ../shared/data/bench.
std::string default_bench_dir() {
  if (const char* d = std::getenv("FOCUS_DATA"); d && *d) return std::string(d) + "/bench";
  return "../shared/data/bench";
}

int cmd_bench_tasks(const std::string& model, const std::string& tokenizer, std::string bench_dir,
                    std::vector<std::string> tasks, int64_t limit, bool list_only, bool as_json, const FocusFlags& ff,
                    const std::string& lora_dir) {
  if (bench_dir.empty()) bench_dir = default_bench_dir();
  if (list_only) {
    for (const auto& t : known_tasks()) {
      const bool present = std::filesystem::is_regular_file(std::filesystem::path(bench_dir) / t.rel_path);
      std::printf("%-16s %-8s %6lld items  %s\n", t.name.c_str(), present ? "present" : "missing",
                  (long long)t.expected_items, t.description.c_str());
    }
    return 0;
  }
  FOCUS_CHECK(std::filesystem::is_directory(bench_dir), bench_dir,
              ": no such folder (give --bench-dir, or set FOCUS_DATA to the shared data folder)");
  if (tasks.empty()) tasks = {"hellaswag", "truthfulqa_mc1", "truthfulqa_mc2"};
  if (tasks.size() == 1 && tasks[0] == "all") {
    tasks.clear();
    for (const auto& t : list_tasks(bench_dir)) tasks.push_back(t.name);
    FOCUS_CHECK(!tasks.empty(), bench_dir, ": no known task file is present");
  }
  std::vector<TaskSet> sets;
  for (const auto& name : tasks) sets.push_back(load_task(name, bench_dir));  // every file checked first
  LoadOptions lo;
  lo.tokenizer = tokenizer;
  auto m = load_model(model, lo);
  if (!lora_dir.empty()) {
    load_and_apply_lora(*m, lora_dir);  // adapters merged into the weights
    std::printf("lora %s merged\n", lora_dir.c_str());
  }
  auto focus = ff.make(*m);
  const AttentionPlan plan = focus ? focus_plan(m->cfg, *focus) : AttentionPlan{};
  const AttentionPlan* attention = focus ? &plan : nullptr;
  install_interrupt_handler();
  json results = json::array();
  std::printf("%-16s %-6s %8s %8s %8s %7s %9s\n", "task", "metric", "acc", "acc_norm", "mc2", "items", "seconds");
  int rc = 0;
  for (const auto& t : sets) {
    const TaskResult r = score_task(*m, t, attention, limit, true);
    std::printf("%-16s %-6s %8.4f %8.4f %8s %7lld %9.1f%s\n", r.name.c_str(), to_string(r.metric).c_str(), r.acc,
                r.acc_norm, r.metric == TaskMetric::MC2 ? std::to_string(r.mc2).substr(0, 6).c_str() : "-",
                (long long)r.count, r.seconds, r.interrupted ? "  INTERRUPTED (partial)" : "");
    std::fflush(stdout);
    results.push_back(task_result_json(r));
    if (r.interrupted) {
      rc = 130;
      break;
    }
  }
  if (as_json) {
    json j{{"model", m->path}, {"bench_dir", bench_dir}, {"limit", limit}, {"tasks", results},
           {"focus", focus ? to_string(focus->settings.mode) : "off"}, {"threads", num_threads()}};
    if (focus) j["focus_dir"] = ff.dir;
    if (!lora_dir.empty()) j["lora"] = lora_dir;
    std::cout << j.dump() << "\n";
  }
  return rc;
}

// The flags every trainer shares (data, schedule, checkpoints, output); `what` names the
// trained parameters in the --seed help.
void add_train_options(CLI::App* app, TrainOptions& o, std::string& model, std::string& tokenizer, bool& as_json,
                       const std::string& what) {
  app->add_option("--model", model, "MODEL")->required();
  app->add_option("--tokenizer", tokenizer, "tokenizer file (llama2.c models)");
  app->add_option("--train", o.train, "training text files (each file is a document)")->required();
  app->add_option("--valid", o.valid, "validation text files (never the same documents)")->required();
  app->add_option("--ctx", o.ctx, "window length in tokens");
  app->add_option("--steps", o.steps, "optimizer steps");
  app->add_option("--batch", o.batch, "windows per step");
  app->add_option("--lr", o.adam.lr, "peak learning rate (AdamW)");
  app->add_option("--warmup", o.warmup, "warm-up steps");
  app->add_option("--weight-decay", o.adam.weight_decay, "AdamW weight decay");
  app->add_option("--eval-every", o.eval_every, "validate every N steps");
  app->add_option("--valid-windows", o.valid_windows, "validation windows");
  app->add_option("--checkpoint-seconds", o.checkpoint_seconds, "seconds between checkpoints");
  app->add_option("--seed", o.seed, "seed (" + what + " init and window sampling)");
  app->add_option("--out", o.out, "output folder")->required();
  app->add_flag("--resume", o.resume, "continue from the checkpoint in --out");
  app->add_option("--stop-after", o.stop_after, "end this run after N steps with a checkpoint (resume later)");
  app->add_flag("--json", as_json, "last stdout line is a JSON object");
}

}  // namespace

int main(int argc, char** argv) {
  select_blas_kernels(argv);
  CLI::App app{"focus: Focus sparse attention for pretrained language models"};
  app.require_subcommand(1);
  int threads = 0;
  app.add_option("-t,--threads", threads, "threads (default: all cores)");

  std::string model, tokenizer, prompt, out;
  std::vector<std::string> texts;
  int64_t ctx = 512, stride = 0, max_tokens = 0, n = 64;
  float temp = 0.f;
  uint64_t seed = 1;
  bool as_json = false, no_bos = false, print_ids = false, bos = false;

  auto* info = app.add_subcommand("info", "architecture, sizes, parameter count, tensor types");
  info->add_option("model", model, "MODEL (.gguf, llama2.c .bin, safetensors folder, smollm2, gemma3-270m)")->required();
  info->add_option("--tokenizer", tokenizer, "tokenizer file (llama2.c models)");
  info->add_flag("--json", as_json, "print JSON");

  auto* ev = app.add_subcommand("eval", "perplexity of a model on text");
  ev->add_option("--model", model, "MODEL")->required();
  ev->add_option("--tokenizer", tokenizer, "tokenizer file (llama2.c models)");
  ev->add_option("--text", texts, "text files (raw Gutenberg files are prepared on the way in)")->required();
  ev->add_option("--ctx", ctx, "window length in tokens (incl. BOS)");
  ev->add_option("--stride", stride, "window stride (default: ctx, non-overlapping)");
  ev->add_option("--max-tokens", max_tokens, "use only the first T text tokens");
  ev->add_flag("--no-bos", no_bos, "do not put BOS at the start of each window");
  ev->add_flag("--json", as_json, "last stdout line is a JSON object");
  FocusFlags ff;
  ff.add(ev);
  std::string eval_lora;
  ev->add_option("--lora", eval_lora, "LoRA folder (lora.json + lora.safetensors) merged into the weights");

  auto* gen = app.add_subcommand("generate", "generate text (greedy at --temp 0)");
  gen->add_option("--model", model, "MODEL")->required();
  gen->add_option("--tokenizer", tokenizer, "tokenizer file (llama2.c models)");
  gen->add_option("-p,--prompt", prompt, "prompt text");
  std::string prompt_file;
  gen->add_option("--prompt-file", prompt_file, "read the prompt from a file (not echoed)");
  FocusFlags genf;
  genf.add(gen);
  gen->add_option("-n", n, "tokens to generate");
  gen->add_option("--temp", temp, "temperature (0 = greedy)");
  gen->add_option("--seed", seed, "sampling seed");
  gen->add_flag("--ids", print_ids, "also print the token ids");

  auto* tk = app.add_subcommand("tokenize", "print token ids of a text");
  tk->add_option("--model", model, "MODEL whose tokenizer to use");
  tk->add_option("--tokenizer", tokenizer, "tokenizer file or folder");
  tk->add_option("-p,--prompt", prompt, "text")->required();
  tk->add_flag("--bos", bos, "prepend BOS");

  auto* prep = app.add_subcommand("prepare", "strip Gutenberg boilerplate, BOM and CRLF");
  prep->add_option("input", tokenizer, "input text file")->required();
  prep->add_option("output", out, "output file")->required();

  RetrofitOptions ro;
  std::string balance = "none";
  auto* rf = app.add_subcommand("retrofit", "train the Focus routers of a frozen model on text");
  add_train_options(rf, ro, model, tokenizer, as_json, "router");
  rf->add_option("--window", ro.focus.local_window, "Focus local window");
  rf->add_option("--sinks", ro.focus.sinks, "sink tokens");
  rf->add_option("--groups", ro.focus.groups, "groups G");
  rf->add_option("--dg", ro.focus.dg, "routing dimension d_g");
  rf->add_option("--topk", ro.focus.topk, "top-k for hard validation");
  rf->add_option("--tau", ro.focus.tau, "router temperature (the initial value with --learn-tau)");
  rf->add_flag("--learn-tau", ro.focus.learn_tau, "train each router's temperature too");
  rf->add_option("--balance", balance, "group balancing: none, swav (Sinkhorn targets), bias (load-driven bias)");
  rf->add_option("--balance-weight", ro.balance_weight, "SwAV loss weight or bias rate");
  rf->add_option("--init", ro.init,
                 "start from the routers in this folder (continue training: more text, longer --ctx); "
                 "--groups, --dg, --tau, --learn-tau default to the folder's");

  LoraOptions lro;
  auto* lr = app.add_subcommand("lora", "train LoRA adapters on the attention projections (the baseline)");
  add_train_options(lr, lro, model, tokenizer, as_json, "adapter");
  lr->add_option("--rank", lro.lora.rank, "adapter rank r");
  lr->add_option("--alpha", lro.lora.alpha, "adapter alpha; the update is (alpha / r) B A (default 2 * rank)");
  lr->add_option("--targets", lro.lora.targets, "adapted projections, letters of qkvo (default qkvo)");

  int top_n = 8;
  FocusFlags gf;
  auto* gr = app.add_subcommand("groups", "what the routers learned: group sizes and frequent tokens per layer");
  gr->add_option("--model", model, "MODEL")->required();
  gr->add_option("--tokenizer", tokenizer, "tokenizer file (llama2.c models)");
  gr->add_option("--text", texts, "text files")->required();
  gr->add_option("--ctx", ctx, "window length in tokens (incl. BOS)");
  gr->add_option("--max-tokens", max_tokens, "use only the first T text tokens");
  gr->add_option("--top", top_n, "tokens listed per group");
  gr->add_flag("--json", as_json, "last stdout line is a JSON object");
  gf.add(gr);

  std::string bench_dir;
  std::vector<std::string> task_names;
  int64_t task_limit = 0;
  bool list_tasks_only = false;
  FocusFlags tf;
  auto* bt = app.add_subcommand("bench-tasks", "multiple-choice benchmarks scored by log-likelihood (HellaSwag, TruthfulQA, ARC, ...)");
  bt->add_option("--model", model, "MODEL");
  bt->add_option("--tokenizer", tokenizer, "tokenizer file (llama2.c models)");
  bt->add_option("--tasks", task_names, "task names, comma separated, or 'all' (default: hellaswag,truthfulqa_mc1,truthfulqa_mc2)")
      ->delimiter(',');
  bt->add_option("--bench-dir", bench_dir, "folder of the benchmark files (default: $FOCUS_DATA/bench or ../shared/data/bench)");
  bt->add_option("--limit", task_limit, "score only the first N items of each task (0: all)");
  bt->add_flag("--list", list_tasks_only, "list the known tasks and whether their files are present");
  bt->add_flag("--json", as_json, "last stdout line is a JSON object");
  std::string task_lora;
  bt->add_option("--lora", task_lora, "LoRA folder (lora.json + lora.safetensors), merged into the weights");
  tf.add(bt);

  AttnBenchOptions bo;
  auto* bench = app.add_subcommand("bench", "benchmarks");
  bench->require_subcommand(1);
  auto* ba = bench->add_subcommand("attention", "dense causal vs Focus fused vs two-call attention on random inputs");
  ba->add_option("--n", bo.n, "tokens");
  ba->add_option("--heads", bo.heads, "query heads H");
  ba->add_option("--kv-heads", bo.kv_heads, "key/value heads (default: --heads)");
  ba->add_option("--dim", bo.dim, "head dimension");
  ba->add_option("--window", bo.local_window, "Focus local window");
  ba->add_option("--groups", bo.groups, "groups G");
  ba->add_option("--topk", bo.topk, "groups per token (1 or 2)");
  ba->add_option("--sinks", bo.sinks, "sink tokens");
  ba->add_option("--reps", bo.reps, "timed repetitions (median, after a warm-up)");
  ba->add_option("--dense-reps", bo.dense_reps, "dense repetitions (-1: as --reps, 0: skip dense)");
  ba->add_flag("!--no-dense-tiles", bo.dense_tiles, "skip the dense run on the sparse tile engine (dense-t)");
  ba->add_option("--decode", bo.decode, "also time decoding the last N positions from a cache (0: skip; default 32)");
  ba->add_option("--seed", bo.seed, "seed of the random inputs and router");
  ba->add_flag("--json", bo.json, "last stdout line is a JSON object");
  bool kv_given = false;
  ba->callback([&] { kv_given = ba->count("--kv-heads") > 0; });

  CLI11_PARSE(app, argc, argv);
  try {
    set_threads(threads);
    if (*info) return cmd_info(model, tokenizer, as_json);
    if (*ev) return cmd_eval(model, tokenizer, texts, ctx, stride, max_tokens, no_bos, as_json, ff, eval_lora);
    if (*gen) return cmd_generate(model, tokenizer, prompt, prompt_file, n, temp, seed, print_ids, genf);
    if (*tk) return cmd_tokenize(model, tokenizer, prompt, bos);
    if (*prep) return cmd_prepare(tokenizer, out);
    if (*rf) {
      const RouterShapeGiven given{rf->count("--groups") > 0, rf->count("--dg") > 0, rf->count("--tau") > 0,
                                   rf->count("--learn-tau") > 0};
      return cmd_retrofit(model, tokenizer, ro, given, balance, as_json);
    }
    if (*lr) return cmd_lora(model, tokenizer, lro, as_json);
    if (*bt) {
      FOCUS_CHECK(list_tasks_only || !model.empty(), "bench-tasks: give --model MODEL");
      return cmd_bench_tasks(model, tokenizer, bench_dir, task_names, task_limit, list_tasks_only, as_json, tf,
                             task_lora);
    }
    if (*gr) return cmd_groups(model, tokenizer, texts, ctx, max_tokens, top_n, as_json, gf);
    if (*ba) {
      if (!kv_given) bo.kv_heads = bo.heads;
      bo.threads = threads;
      return run_attention_bench(bo);
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "error: out of memory\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
