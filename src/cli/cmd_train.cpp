// focus train: a small model trained from scratch, dense or with Focus routers trained jointly.
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "cli/process.h"
#include "cli/setup.h"
#include "train/pretrain.h"

namespace focus::cli {
namespace {

struct TrainFlags {
  PretrainOptions o;
  bool as_json = false;
};

int run_train_cmd(const TrainFlags& f) {
  install_interrupt_handler();
  const PretrainResult r = run_pretrain(f.o);
  std::printf("\ntrained %s (%s attention) from scratch: %lld parameters%s, %lld steps, %lld training tokens, "
              "%.1f tok/s, %.2f GFLOP/s of useful training FLOPs (%.0f%% of the sgemm peak, %.1f GFLOP/s)\n",
              r.arch.c_str(), f.o.attention.c_str(), (long long)r.params,
              r.router_params ? (" + " + std::to_string(r.router_params) + " router").c_str() : "",
              (long long)r.steps, (long long)r.train_tokens, r.tokens_per_s, r.model_gflops, 100 * r.mfu,
              r.sgemm_gflops);
  if (r.interrupted) {
    std::printf("interrupted: checkpoint in %s, continue with --resume\n", f.o.out.c_str());
  } else {
    std::printf("validation perplexity (%lld tokens): %.3f", (long long)r.valid_tokens, r.valid_ppl);
    if (f.o.attention == "focus")
      std::printf(" (soft), hard top-%d %.3f at density %.3f", f.o.focus.topk, r.valid_ppl_hard, r.valid_density_hard);
    std::printf("\nmodel written to %s%s%s\n", r.model_dir.c_str(), r.routers_dir.empty() ? "" : ", routers to ",
                r.routers_dir.c_str());
  }
  if (f.as_json) {
    nlohmann::json j{{"arch", r.arch},
                     {"attention", f.o.attention},
                     {"valid_ppl", r.valid_ppl},
                     {"valid_ppl_initial", r.valid_ppl_initial},
                     {"valid_tokens", r.valid_tokens},
                     {"train_tokens", r.train_tokens},
                     {"tokens_per_s", r.tokens_per_s},
                     {"steps", r.steps},
                     {"params", r.params},
                     {"flops_per_token", r.flops_per_token},
                     {"model_gflops", r.model_gflops},
                     {"sgemm_gflops", r.sgemm_gflops},
                     {"mfu", r.mfu},
                     {"interrupted", r.interrupted},
                     {"model", r.model_dir}};
    if (f.o.attention == "focus") {
      j["valid_ppl_hard"] = r.valid_ppl_hard;
      j["valid_density_hard"] = r.valid_density_hard;
      j["router_params"] = r.router_params;
      j["routers"] = r.routers_dir;
    }
    std::cout << j.dump() << "\n";
  }
  return r.interrupted ? 130 : 0;
}

}  // namespace

Command add_train(CLI::App& app) {
  auto f = std::make_shared<TrainFlags>();
  auto* sub = app.add_subcommand("train", "train a small model from scratch (dense or Focus attention)");
  sub->add_option("--arch", f->o.arch, "architecture preset: mha, gqa, mqa, local-global, mla");
  sub->add_option("--config", f->o.config,
                  "a Hugging Face config.json instead of a preset (llama, gemma3_text, deepseek_v2)");
  sub->add_option("--tokenizer", f->o.tokenizer, "tokenizer (llama2.c .bin or tokenizer.json); sets the vocabulary")
      ->required();
  add_train_loop_options(sub, f->o, "weight");
  sub->add_option("--attention", f->o.attention, "dense, or focus (routers trained jointly)");
  sub->add_option("--window", f->o.focus.local_window, "focus: local window w");
  sub->add_option("--sinks", f->o.focus.sinks, "focus: sink tokens");
  sub->add_option("--groups", f->o.focus.groups, "focus: groups G");
  sub->add_option("--dg", f->o.focus.dg, "focus: routing dimension d_g");
  sub->add_option("--topk", f->o.focus.topk, "focus: groups kept per token in hard validation");
  sub->add_option("--tau", f->o.focus.tau, "focus: router temperature");
  sub->add_option("--balance", f->o.balance, "focus: none, or swav (balancing loss on the router scores)");
  sub->add_option("--balance-weight", f->o.balance_weight, "focus: weight of the SwAV loss");
  sub->add_flag("--router-detach", f->o.router_detach,
                "focus: the routers learn from the loss but pass no gradient into the model's hidden states");
  sub->add_flag("--json", f->as_json, "print the result as one JSON line at the end");
  return {sub, [f] { return run_train_cmd(*f); }};
}

}  // namespace focus::cli
