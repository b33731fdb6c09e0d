// focus eval: perplexity of a model on text, with or without Focus routers and LoRA adapters.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "cli/process.h"
#include "cli/setup.h"
#include "core/threads.h"
#include "eval/perplexity.h"
#include "io/text.h"

namespace focus::cli {
namespace {

struct EvalFlags {
  ModelSetup s;
  std::vector<std::string> texts;
  int64_t ctx = 512, stride = 0, max_tokens = 0;
  bool no_bos = false, decode = false;
};

int run_eval(const EvalFlags& f) {
  const Loaded l = f.s.load();
  const Model& m = *l.model;
  const std::vector<int32_t> ids = io::load_text_tokens(*m.tok, f.texts, f.max_tokens);
  PplOptions o;
  o.ctx = f.ctx;
  o.stride = f.stride;
  o.bos = !f.no_bos;
  o.decode = f.decode;
  o.kv_type = f.s.kv();
  o.progress = true;
  o.attention = l.attention();
  install_interrupt_handler();
  const PplResult r = perplexity(m, ids, o);
  const std::string focus_desc = l.describe();
  // Sparse policies report their pairs (soft mode computes every pair and reports none).
  const bool sparse = r.attention.layers > 0;
  if (l.attention()) {
    std::printf("attention %s\n", focus_desc.c_str());
    if (sparse)
      std::printf("pattern: density %.4f of causal pairs, group load max/mean %.2f (worst layer)\n",
                  r.attention.density(), r.attention.load_max_over_mean);
  }
  const double tps = r.processed / std::max(r.seconds, 1e-9);
  std::printf("model %s | ctx %lld | tokens scored %lld in %lld windows | nll %.5f | ppl %.4f | %.1f tok/s%s\n",
              m.path.c_str(), (long long)f.ctx, (long long)r.tokens, (long long)r.windows, r.nll(), r.ppl(), tps,
              r.interrupted ? " | INTERRUPTED (partial)" : "");
  if (f.s.as_json) {
    nlohmann::json j{{"model", m.path},     {"texts", f.texts},      {"ctx", f.ctx},
                     {"stride", o.stride ? o.stride : f.ctx},       {"ppl", r.ppl()},
                     {"nll", r.nll()},      {"tokens", r.tokens},    {"windows", r.windows},
                     {"tok_per_s", tps},    {"seconds", r.seconds},  {"threads", num_threads()},
                     {"interrupted", r.interrupted},                {"focus", focus_desc},
                     {"weights", m.w.weights_mode},                 {"decode", f.decode}, {"kv_type", cpu::to_string(o.kv_type)}};
    if (!f.s.lora.empty()) j["lora"] = f.s.lora;
    if (sparse) {
      j["density"] = r.attention.density();
      j["load_max_over_mean"] = r.attention.load_max_over_mean;
    }
    std::cout << j.dump() << "\n";
  }
  return r.interrupted ? 130 : 0;
}

}  // namespace

Command add_eval(CLI::App& app) {
  auto f = std::make_shared<EvalFlags>();
  auto* sub = app.add_subcommand("eval", "perplexity of a model on text");
  f->s.add_model(sub);
  sub->add_option("--text", f->texts, "text files (raw Gutenberg files are prepared on the way in)")->required();
  sub->add_option("--ctx", f->ctx, "window length in tokens (incl. BOS)");
  sub->add_option("--stride", f->stride, "window stride (default: ctx, non-overlapping)");
  sub->add_option("--max-tokens", f->max_tokens, "use only the first T text tokens");
  sub->add_flag("--no-bos", f->no_bos, "do not put BOS at the start of each window");
  sub->add_flag("--decode", f->decode,
                "score through the decoding path: tokens one at a time over the cache, as generation runs them");
  f->s.add_json(sub);
  f->s.add_focus(sub);
  f->s.add_kv_type(sub);
  f->s.add_lora(sub);
  return {sub, [f] { return run_eval(*f); }};
}

}  // namespace focus::cli
