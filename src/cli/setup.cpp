#include "cli/setup.h"

#include <cstdio>

#include "core/error.h"
#include "focus/block_budget.h"
#include "kernels/cpu/ops.h"
#include "train/lora.h"

namespace focus::cli {

void FocusFlags::add(CLI::App* app) {
  app_ = app;
  app->add_option("--focus", dir, "router folder (focus.json + router.safetensors), or 'random'");
  app->add_option("--mode", mode, "Focus mode: soft (training form), hard (top-k sparse), window (local window + sinks only) or off");
  app->add_option("--topk", topk, "hard mode: groups kept per token (symmetric: 1 or 2; asymmetric: groups a query reads)");
  app->add_option("--routing", routing, "random routers: symmetric (same-group rule) or asymmetric (keys in one group, queries read top-k)");
  app->add_option("--key-capacity", key_capacity, "asymmetric routing: a group holds at most this times the mean key load");
  app->add_option("--window-only-below", window_only_below,
                  "layers whose measured far attention mass (focus.json far_mass) is below this run window + sinks only");
  app->add_option("--dense-above", dense_above, "layers whose measured far attention mass is above this stay dense");
  app->add_flag("--topk-by-mass", topk_by_mass,
                "asymmetric routers: each layer reads topk * (its far mass / the mean far mass) groups");
  app->add_option("--topp", topp,
                  "asymmetric routers: a query reads its best groups until they hold this share of its router's "
                  "softmax, at most --topk of them (default then: all groups); 0: exactly --topk");
  app->add_flag("--group-bias", group_bias,
                "asymmetric routers: weight each far pair a query reads by the routers' probabilities of its group "
                "relative to their best (routers trained with retrofit --objective sparse --group-bias carry it)");
  app->add_option("--blocks", blocks,
                  "asymmetric routers, the hybrid pattern: each query head also reads the block of its last far "
                  "key and this many more positional blocks, those with the largest bound of q.k (0: groups only; "
                  "replaces a router folder's per-head block budgets)");
  app->add_option("--block-size", block_size, "positional blocks of the hybrid pattern: keys per block (default 64)");
  app->add_option("--block-select-every", block_select_every,
                  "the hybrid pattern: blocks chosen once every this many rows, by each tile's first row (its "
                  "later rows read them and the blocks from there to their own; 1: every row chooses)")
      ->check(CLI::Range(1, 1 << 20));
  app->add_option("--block-budget", block_budget,
                  "asymmetric routers, the hybrid pattern with each head's own number of blocks: a budget file of "
                  "`focus budget` (it sets the block size; its window and sinks must be the routers')");
  app->add_option("--window", window, "Focus local window (default 64)");
  app->add_option("--sinks", sinks, "sink tokens visible to all (default 1)");
  app->add_option("--groups", groups, "groups G for a random router");
  app->add_option("--dg", dg, "routing dimension d_g for a random router");
  app->add_option("--tau", tau, "temperature for a random router");
  app->add_option("--router-seed", seed, "seed for a random router");
}

void FocusFlags::check() const {
  if (dir.empty()) {
    for (const char* f : {"--mode", "--topk", "--window", "--sinks", "--groups", "--dg", "--tau", "--router-seed",
                          "--routing", "--key-capacity", "--window-only-below", "--dense-above",
                          "--topk-by-mass", "--topp", "--group-bias", "--blocks", "--block-size", "--block-budget",
                          "--block-select-every"})
      FOCUS_CHECK(!given(f), f, " needs --focus DIR (or --focus random)");
  } else if (dir != "random") {
    for (const char* f : {"--groups", "--dg", "--tau", "--router-seed", "--routing"})
      FOCUS_CHECK(!given(f), f, " applies only to --focus random (the routers in ", dir, " fix it)");
  }
}

std::unique_ptr<FocusRouters> FocusFlags::make(const Model& m) const {
  check();
  if (dir.empty()) return nullptr;
  std::unique_ptr<FocusRouters> f;
  bool moves_window = false;
  if (dir == "random") {
    FocusSettings s;
    s.groups = groups;
    s.dg = dg;
    s.tau = tau;
    FOCUS_CHECK(routing.empty() || routing == "symmetric" || routing == "asymmetric",
                "--routing must be symmetric or asymmetric, got '", routing, "'");
    s.asymmetric = routing == "asymmetric";
    if (window >= 0) s.local_window = window;
    if (sinks >= 0) s.sinks = sinks;
    if (topk) s.topk = topk;
    f = std::make_unique<FocusRouters>(focus_init(m.cfg, s, seed));
  } else {
    f = std::make_unique<FocusRouters>(load_focus(dir, m.cfg));
    // A window or sink count the folder's own leaves its per-head block budgets valid.
    moves_window = (window >= 0 && window != f->settings.local_window) || (sinks >= 0 && sinks != f->settings.sinks);
    if (window >= 0) f->settings.local_window = window;
    if (sinks >= 0) f->settings.sinks = sinks;
    if (topk) f->settings.topk = topk;
  }
  if (!mode.empty()) f->settings.mode = parse_focus_mode(mode);
  if (key_capacity >= 0) f->settings.key_capacity = key_capacity;
  if (window_only_below >= 0) f->settings.window_only_below = window_only_below;
  if (dense_above >= 0) f->settings.dense_above = dense_above;
  if (topk_by_mass) f->settings.topk_by_mass = true;
  if (topp >= 0) {
    FOCUS_CHECK(topp <= 1.f, "--topp must be in [0, 1], got ", topp);
    FOCUS_CHECK(topp == 0.f || f->settings.asymmetric, "--topp needs asymmetric routers");
    f->settings.topp = topp;
    if (topp > 0 && !topk) f->settings.topk = (int)f->settings.groups;
  }
  if (!f->block_budget.empty() && block_budget.empty()) {
    // The folder's per-head budgets were measured at its window, sinks and block size.
    FOCUS_CHECK(block_size < 0 || blocks >= 0, dir,
                " holds per-head block budgets measured with blocks of ", f->settings.block_size,
                "; --block-size needs --blocks K too (uniform blocks in their place)");
    FOCUS_CHECK(blocks >= 0 || !moves_window, dir,
                " holds per-head block budgets measured with its window and sinks; give --blocks K (uniform blocks "
                "in their place) or --block-budget with a budget measured at the new window");
    if (blocks >= 0) {  // uniform blocks replace them
      f->block_budget.clear();
      f->block_near.clear();
      f->block_group.clear();
    }
  }
  if (blocks >= 0) {
    FOCUS_CHECK(blocks == 0 || f->settings.asymmetric, "--blocks needs asymmetric routers");
    f->settings.blocks = blocks;
  }
  if (block_size >= 0) {
    FOCUS_CHECK(block_size >= 1, "--block-size must be >= 1");
    FOCUS_CHECK(f->settings.blocks > 0, "--block-size applies to the hybrid pattern: give --blocks K too");
    f->settings.block_size = block_size;
  }
  if (!block_budget.empty()) {
    FOCUS_CHECK(blocks < 0 && block_size < 0,
                "--block-budget sets each head's blocks and their size: drop --blocks and --block-size");
    FOCUS_CHECK(f->settings.asymmetric, "--block-budget needs asymmetric routers");
    const BlockBudget b = load_block_budget(block_budget);
    check_block_budget(b, f->settings.local_window, f->settings.sinks, m.cfg, block_budget);
    f->settings.block_size = b.block;
    f->block_budget.clear();
    f->block_near.clear();
    f->block_group.clear();
    set_block_budget(*f, m.cfg, b.k, block_budget, b.near, b.group);
  }
  if (block_select_every >= 0) {  // (its range is checked where it is parsed)
    FOCUS_CHECK(f->settings.blocks > 0, "--block-select-every applies to the hybrid pattern (routers with blocks, or "
                "--blocks K)");
    f->settings.block_select_every = block_select_every;
  }
  if (group_bias) {
    FOCUS_CHECK(f->settings.asymmetric && f->settings.blocks == 0 && f->settings.topp == 0.f && !f->settings.route_on_qk,
                "--group-bias needs asymmetric routers reading the hidden state, with top-k groups and no blocks");
    f->settings.group_bias = true;
  }
  FOCUS_CHECK(f->settings.local_window >= 1, "--window must be >= 1");
  FOCUS_CHECK(f->settings.topk >= 1 && (f->settings.asymmetric || f->settings.topk <= 2) &&
                  f->settings.topk <= f->settings.groups,
              "--topk must be 1 or 2 with symmetric routing, at least 1 with asymmetric (and at most the number of groups)");
  FOCUS_CHECK(!f->settings.asymmetric || f->settings.key_capacity >= 1.f, "--key-capacity must be >= 1");
  FOCUS_CHECK(f->settings.window_only_below <= 1.f, "--window-only-below must be in [0, 1]");
  FOCUS_CHECK(f->settings.dense_above <= 1.f, "--dense-above must be in [0, 1]");
  return f;
}

namespace {
// The mean of the per-head block budgets of the layers that have them, as "96.0".
std::string mean_budget(const std::vector<std::vector<int64_t>>& k) {
  double sum = 0;
  int64_t n = 0;
  for (const auto& kl : k)
    for (int64_t x : kl) {
      sum += (double)x;
      ++n;
    }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", n ? sum / (double)n : 0.0);
  return buf;
}
// ", groups read by 5 of 90 heads" for a group switch, "" without one.
std::string groups_read(const std::vector<std::vector<int64_t>>& g) {
  int64_t on = 0, n = 0;
  for (const auto& gl : g)
    for (int64_t x : gl) {
      on += x != 0;
      ++n;
    }
  return n ? ", groups read by " + std::to_string(on) + " of " + std::to_string(n) + " heads" : "";
}
}  // namespace

void Loaded::check_decodes(const char* what) const {
  FOCUS_CHECK(!focus || focus->settings.mode != FocusMode::Hard || !focus->settings.group_bias, what,
              ": routers with group weights score whole windows from position 0 (focus eval); decoding from a KV "
              "cache needs group weights in the grouped kernels, which are not built");
}

std::string describe_focus(const FocusRouters* f) {
  if (!f) return "off";
  const FocusSettings& s = f->settings;
  return to_string(s.mode) + (s.asymmetric ? " asymmetric" : "") + " (window " + std::to_string(s.local_window) + ", sinks " + std::to_string(s.sinks) +
         ", groups " + std::to_string(s.groups) + ", d_g " + std::to_string(s.dg) +
         (s.mode == FocusMode::Hard ? ", top-" + std::to_string(s.topk) : "") +
         (s.mode == FocusMode::Hard && s.topp > 0 ? ", top-p " + std::to_string(s.topp) : "") +
         (s.mode == FocusMode::Hard && s.group_bias ? ", group weights" : "") +
         (s.mode == FocusMode::Hard && s.far_bias ? ", far-pair terms" : "") +
         (s.mode == FocusMode::Hard && s.blocks > 0
              ? (f->block_budget.empty() ? ", blocks 1+" + std::to_string(s.blocks)
                                         : ", blocks 1+" + mean_budget(f->block_budget) + " per head on average" +
                                               (f->block_near.empty() ? ""
                                                                      : " (+" + mean_budget(f->block_near) + " near)")) +
                    " of " + std::to_string(s.block_size) + groups_read(f->block_group) +
                    (s.block_select_every > 1 ? ", chosen every " + std::to_string(s.block_select_every) + " rows"
                                              : "")
              : "") +
         ", " +
         std::to_string(f->routers.size()) + " routers)";
}

void ModelSetup::add_model(CLI::App* app, bool required, bool positional) {
  CLI::Option* o =
      positional ? app->add_option("model", model, "MODEL (.gguf, llama2.c .bin, safetensors folder, smollm2, gemma3-270m)")
                 : app->add_option("--model", model, "MODEL");
  if (required) o->required();
  app->add_option("--tokenizer", tokenizer, "tokenizer file (llama2.c models)");
  app->add_option("--weights", weights,
                  "how the matrices are held: native (the file's format, quantised kernels; default), f32 "
                  "(dequantised at load: the exact path) or bf16")
      ->check(CLI::IsMember({"native", "f32", "bf16"}));
  app->add_option("--prefill-gemm", prefill_gemm,
                  "quantised weights times many rows (prefill, scoring): int8 (integer GEMM on int8 "
                  "activations where the CPU has AVX-512 VNNI or AVX2; default) or dequant (float32 tiles through sgemm: "
                  "the f32 path's result)")
      ->check(CLI::IsMember({"int8", "dequant"}));
}

void ModelSetup::add_kv_type(CLI::App* app) {
  app->add_option("--kv-type", kv_type,
                  "element type of the KV cache: f16 or bf16 (half the memory and bandwidth of f32), f32; auto "
                  "(default): f32 with --weights f32, else f16")
      ->check(CLI::IsMember({"auto", "f32", "f16", "bf16"}));
}

cpu::KvType ModelSetup::kv() const {
  if (kv_type != "auto") return cpu::parse_kv_type(kv_type);
  return weights == "f32" ? cpu::KvType::F32 : cpu::KvType::F16;
}

void ModelSetup::add_lora(CLI::App* app) {
  app->add_option("--lora", lora, "LoRA folder (lora.json + lora.safetensors) merged into the weights");
}

void ModelSetup::add_json(CLI::App* app, const std::string& help) { app->add_flag("--json", as_json, help); }

void ModelSetup::check() const {
  if (!uses_focus_) return;
  focus.check();
  FOCUS_CHECK(attention.empty() || focus.dir.empty(), "--attention and --focus exclude each other (--focus DIR is "
              "the Focus policy with trained routers)");
}

void ModelSetup::add_focus(CLI::App* app) {
  focus.add(app);
  uses_focus_ = true;
  std::string names;
  for (const auto& n : registered_attention_policies()) names += (names.empty() ? "" : ", ") + n;
  app->add_option("--attention", attention,
                  "attention policy without routers, NAME or NAME:key=value,... (registered: " + names + ")");
}

std::string Loaded::describe() const {
  if (focus) return describe_focus(focus.get());
  return attention_spec.empty() ? "off" : attention_spec;
}

Loaded ModelSetup::load() const {
  check();
  LoadOptions lo;
  lo.tokenizer = tokenizer;
  lo.weights = parse_weights_mode(weights);
  cpu::set_prefill_gemm(prefill_gemm == "dequant" ? cpu::PrefillGemm::Dequant : cpu::PrefillGemm::Int8);
  Loaded l;
  l.model = load_model(model, lo);
  if (!lora.empty()) {
    load_and_apply_lora(*l.model, lora);  // adapters merged into the weights
    std::printf("lora %s merged\n", lora.c_str());
  }
  if (uses_focus_) l.focus = focus.make(*l.model);
  if (l.focus) l.plan = focus_plan(l.model->cfg, *l.focus);
  if (!attention.empty()) {
    l.attention_spec = attention;
    l.plan = make_attention_plan(l.model->cfg, attention);
  }
  return l;
}

void add_train_options(CLI::App* app, TrainOptions& o, ModelSetup& s, const std::string& what) {
  s.add_model(app);
  add_train_loop_options(app, o, what);
  s.add_json(app);
}

void add_train_loop_options(CLI::App* app, TrainOptions& o, const std::string& what) {
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
}

}  // namespace focus::cli
