// The set-up the focus subcommands share: the model flags (--model, --tokenizer), LoRA
// (--lora), Focus routers (--focus and the flags that shape them), --json, and how a
// subcommand is registered and run. Subcommands parse their own flags, call the library and print.
#pragma once
#include <CLI/CLI.hpp>
#include <functional>
#include <memory>
#include <string>

#include "focus/focus_attention.h"
#include "focus/focus_model.h"
#include "model/model.h"
#include "train/trainer.h"

namespace focus::cli {

// A registered subcommand: `run` is called when `app` was selected on the command line.
struct Command {
  CLI::App* app = nullptr;
  std::function<int()> run;
};

// The Focus router flags: --focus DIR|random and the flags that shape the routers.
struct FocusFlags {
  std::string dir;   // router folder, or "random"
  std::string mode;  // soft | hard | window | off (default: the folder's, or soft)
  std::string routing;  // random routers: symmetric | asymmetric
  int64_t window = -1, sinks = -1, groups = 16, dg = 16;
  int topk = 0;
  float tau = 0.1f;
  float key_capacity = -1.f, window_only_below = -1.f, dense_above = -1.f, topp = -1.f;
  bool topk_by_mass = false, group_bias = false;
  int64_t blocks = -1, block_size = -1, block_select_every = -1;
  std::string block_budget;  // --block-budget FILE
  uint64_t seed = 1;
  void add(CLI::App* app);
  // Error naming the flag when a router flag is given without --focus, or a flag of random
  // routers (--groups, --dg, --tau, --router-seed) with a router folder.
  void check() const;
  // Routers as the flags say, or none without --focus.
  std::unique_ptr<FocusRouters> make(const Model& m) const;

 private:
  CLI::App* app_ = nullptr;
  bool given(const char* flag) const { return app_ && app_->count(flag) > 0; }
};

// "hard (window 64, sinks 1, groups 16, d_g 16, top-1, 12 routers)", or "off".
std::string describe_focus(const FocusRouters* f);

// A loaded model with its LoRA adapters merged and its routers.
struct Loaded {
  std::unique_ptr<Model> model;
  std::unique_ptr<FocusRouters> focus;
  std::string attention_spec;  // --attention SPEC (a registered policy), or empty
  AttentionPlan plan;  // focus_plan of the routers, or the --attention plan (empty without either)
  // The per-layer attention to run: the routers' or --attention's plan, or null (the model's own).
  const AttentionPlan* attention() const { return focus || !attention_spec.empty() ? &plan : nullptr; }
  // What runs: the routers (describe_focus), the --attention spec, or "off".
  std::string describe() const;
  // Throws focus::Error naming `what` when the routers cannot decode from a KV cache (hard mode
  // with group weights scores whole windows only).
  void check_decodes(const char* what) const;
};

// What the model-running subcommands share. add_* register the flags; load() checks them (before
// anything is loaded), loads the model, merges --lora (printing so) and builds the routers.
// A subcommand with a long loop installs the Ctrl-C handler (cli/process.h) just before it.
struct ModelSetup {
  std::string model, tokenizer, lora;
  std::string weights = "native";  // --weights native|f32|bf16
  std::string kv_type = "auto";    // --kv-type auto|f32|f16|bf16 (add_kv_type)
  std::string prefill_gemm = "int8";  // --prefill-gemm int8|dequant
  FocusFlags focus;
  std::string attention;  // --attention SPEC (registered with add_focus)
  bool as_json = false;
  // --model MODEL (required or not), or with `positional` a MODEL argument; --tokenizer, --weights
  // and --prefill-gemm.
  void add_model(CLI::App* app, bool required = true, bool positional = false);
  void add_lora(CLI::App* app);
  // --kv-type (subcommands that run a KV cache: generate, eval, bench model).
  void add_kv_type(CLI::App* app);
  // The KV cache's element type: --kv-type, or for auto float32 with --weights f32 (the exact
  // path) and half precision otherwise.
  cpu::KvType kv() const;
  // --focus and the router flags, and --attention SPEC.
  void add_focus(CLI::App* app);
  void add_json(CLI::App* app, const std::string& help = "last stdout line is a JSON object");
  void check() const;
  Loaded load() const;

 private:
  bool uses_focus_ = false;
};

// The flags every trainer shares (model, data, schedule, checkpoints, output, --json); `what`
// names the trained parameters in the --seed help.
void add_train_options(CLI::App* app, TrainOptions& o, ModelSetup& s, const std::string& what);
// The same without the model flags and --json (training from scratch has no model to load).
void add_train_loop_options(CLI::App* app, TrainOptions& o, const std::string& what);

// The subcommands (one file each).
Command add_info(CLI::App& app);
Command add_eval(CLI::App& app);
Command add_generate(CLI::App& app);
Command add_tokenize(CLI::App& app);
Command add_prepare(CLI::App& app);
Command add_retrofit(CLI::App& app);
Command add_lora(CLI::App& app);
Command add_train(CLI::App& app);
Command add_groups(CLI::App& app);
Command add_budget(CLI::App& app);
Command add_bench_tasks(CLI::App& app);
Command add_bench(CLI::App& app);

}  // namespace focus::cli
