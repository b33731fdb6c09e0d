// The LoRA baseline trainer: adapters (lora.h) on the attention projections of a frozen model,
// trained on the same data, windows, optimizer, schedule and validation windows as the Focus
// routers (the shared loop of trainer.h), with plain causal attention. Validation compares the
// pretrained model with the adapters merged into it.
#pragma once
#include <cstdint>
#include <vector>

#include "model/model.h"
#include "train/lora.h"
#include "train/trainer.h"

namespace focus {

struct LoraOptions : TrainOptions {
  LoraSettings lora;  // rank, alpha, targets
  LoraOptions() { adam.lr = 1e-3f; }
};

struct LoraValid {
  double ppl_pretrained = 0, ppl_lora = 0;
  int64_t tokens = 0;
};

struct LoraResult : TrainStats {
  LoraValid before, after;  // before: the initial adapters (B = 0, the pretrained model)
  LoraSettings settings;    // as trained (alpha resolved)
  int64_t params = 0;       // trainable adapter parameters
};

// Perplexity of the model with the adapters merged in (and of the model alone, with_pretrained)
// on the given windows.
LoraValid validate_lora(const Model& m, const LoraAdapters& a, const std::vector<std::vector<int32_t>>& ids,
                        const std::vector<std::vector<int32_t>>& targets, bool with_pretrained);

// Trains the adapters; writes DIR/lora.safetensors + DIR/lora.json, metrics.jsonl and the
// checkpoint into o.out.
LoraResult run_lora(const Model& m, const LoraOptions& o);

}  // namespace focus
