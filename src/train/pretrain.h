// Training a model from scratch (`focus train`): every weight of a small model of a preset
// architecture (model_params.h), with dense attention or with Focus routers trained jointly
// (soft attention, the additive log-bias; validated soft and hard), on the shared loop of
// trainer.h (AdamW with weight decay on matrices and embeddings, clipping, warm-up + cosine,
// progress, Ctrl-C, atomic checkpoints and exact resume). Output: OUT/model (safetensors +
// config.json + tokenizer, which `focus eval --model` loads), OUT/routers with Focus, metrics.jsonl.
#pragma once
#include <cstdint>
#include <string>

#include "focus/focus_model.h"
#include "train/model_params.h"
#include "train/trainer.h"

namespace focus {

struct PretrainOptions : TrainOptions {
  std::string arch = "gqa";    // a preset of model_params.h
  std::string config;          // or a Hugging Face config.json (llama, gemma3_text, deepseek_v2): the
                               // architecture and sizes; its vocab_size must be the tokenizer's
  std::string tokenizer;       // tokenizer file (llama2.c .bin or tokenizer.json); sets the vocabulary
  std::string attention = "dense";  // dense | focus
  FocusSettings focus;         // with focus: window, sinks, groups, d_g, top-k (hard validation), tau
  std::string balance = "none";  // with focus: none | swav (the SwAV loss on the router scores)
  float balance_weight = 0.1f;
  bool router_detach = false;  // with focus: the routers' gradient does not flow into the model
  bool measure_peak = true;    // time the sgemm peak after training (sgemm_gflops, mfu below)
  PretrainOptions() {
    adam.lr = 1e-3f;
    adam.beta2 = 0.95f;
    adam.weight_decay = 0.1f;
    warmup = 20;
  }
};

struct PretrainResult : TrainStats {
  double valid_ppl_initial = 0;  // the initial model (before the first step of the run's start)
  double valid_ppl = 0;       // the trained model as trained (dense, or Focus soft attention)
  double valid_ppl_hard = 0;  // Focus: hard top-k routing
  double valid_density_hard = 0;
  int64_t valid_tokens = 0;
  int64_t params = 0, router_params = 0;
  double flops_per_token = 0;  // useful training FLOPs per token (forward + backward, 6 per weight
                               // and multiply, plus causal attention)
  double model_gflops = 0;     // flops_per_token * tokens_per_s / 1e9
  double sgemm_gflops = 0;     // the sgemm peak measured after training (2048^3, same threads; 0
                               // without measure_peak)
  double mfu = 0;              // model_gflops / sgemm_gflops
  std::string arch;  // the preset, or the config's model type
  std::string model_dir, routers_dir;
};

PretrainResult run_pretrain(const PretrainOptions& o);

}  // namespace focus
