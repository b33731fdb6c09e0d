// focus lora: train LoRA adapters on the attention projections (the baseline to Focus).
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "cli/process.h"
#include "cli/setup.h"
#include "train/lora_train.h"

namespace focus::cli {
namespace {

struct LoraFlags {
  ModelSetup s;
  LoraOptions o;
};

int run_lora_cmd(const LoraFlags& f) {
  const Loaded l = f.s.load();
  const Model& m = *l.model;
  install_interrupt_handler();
  const LoraResult r = run_lora(m, f.o);
  std::printf("\nLoRA of %s: rank %lld, alpha %g, targets %s, %lld steps, %lld training tokens, %.1f tok/s, "
              "%lld adapter parameters\n",
              m.path.c_str(), (long long)r.settings.rank, r.settings.alpha, r.settings.targets.c_str(),
              (long long)r.steps, (long long)r.train_tokens, r.tokens_per_s, (long long)r.params);
  if (r.interrupted)
    std::printf("validation perplexity (%lld tokens): pretrained %.3f (interrupted: no final validation)\n",
                (long long)r.before.tokens, r.before.ppl_pretrained);
  else
    std::printf("validation perplexity (%lld tokens): pretrained %.3f, LoRA merged %.3f\n", (long long)r.before.tokens,
                r.before.ppl_pretrained, r.after.ppl_lora);
  std::printf("adapters written to %s (lora.json, lora.safetensors, metrics.jsonl)\n", f.o.out.c_str());
  if (f.s.as_json) {
    nlohmann::json j{{"valid_ppl_pretrained", r.before.ppl_pretrained},
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
                     {"out", f.o.out}};
    std::cout << j.dump() << "\n";
  }
  return r.interrupted ? 130 : 0;
}

}  // namespace

Command add_lora(CLI::App& app) {
  auto f = std::make_shared<LoraFlags>();
  auto* sub = app.add_subcommand("lora", "train LoRA adapters on the attention projections (the baseline)");
  add_train_options(sub, f->o, f->s, "adapter");
  sub->add_option("--rank", f->o.lora.rank, "adapter rank r");
  sub->add_option("--alpha", f->o.lora.alpha, "adapter alpha; the update is (alpha / r) B A (default 2 * rank)");
  sub->add_option("--targets", f->o.lora.targets, "adapted projections, letters of qkvo (default qkvo)");
  return {sub, [f] { return run_lora_cmd(*f); }};
}

}  // namespace focus::cli
