// LoRA adapters on the attention projections of a frozen model (the baseline Focus is compared
// with). For an adapted projection W [out, in] of layer l:
//   W' = W + (alpha / r) B A,    A [r, in],  B [out, r]
// A starts small and random (uniform in +-1/sqrt(in), the Kaiming-uniform bound of a Linear
// layer), B starts at zero, so an untrained adapter leaves the model exactly as it was.
//
// alpha defaults to 2 * r: the scale alpha / r is then 2 for every rank, so one learning rate
// serves all ranks (with Adam, alpha only rescales the step). Any alpha can be given.
//
// Training runs the adapters unmerged (backward.h); inference merges them into copies of the
// weights (apply_lora), so the forward pass needs no change.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/model.h"

namespace focus {

// The attention projections an adapter can sit on.
enum LoraTarget : int { kLoraQ = 0, kLoraK = 1, kLoraV = 2, kLoraO = 3 };
inline constexpr int kLoraTargets = 4;
const char* lora_target_name(int t);  // "q", "k", "v", "o"

struct LoraSettings {
  int64_t rank = 4;
  float alpha = 0.f;              // 0: 2 * rank
  std::string targets = "qkvo";   // adapted projections, a subset of "qkvo"
  float alpha_or_default() const { return alpha > 0.f ? alpha : 2.f * (float)rank; }
  float scale() const { return alpha_or_default() / (float)rank; }
  bool adapts(int t) const;
};

// "qkvo", "qv", "q,k,v,o" ... -> the canonical "qkvo"-ordered string; errors on anything else.
std::string parse_lora_targets(const std::string& s);

// One adapted projection: params = [A (r x in, row-major) | B (out x r, row-major)] in one flat
// vector (one optimizer block).
struct LoraMatrix {
  int64_t layer = 0;
  int target = kLoraQ;
  int64_t rank = 0, in = 0, out = 0;
  std::vector<float> params;

  float* a() { return params.data(); }
  const float* a() const { return params.data(); }
  float* b() { return params.data() + rank * in; }
  const float* b() const { return params.data() + rank * in; }
  int64_t size() const { return rank * (in + out); }
};

struct LoraAdapters {
  LoraSettings settings;
  std::vector<std::array<int64_t, kLoraTargets>> index;  // per layer and target: into mats, or -1
  std::vector<LoraMatrix> mats;

  const LoraMatrix* find(int64_t layer, int target) const {
    if (layer < 0 || layer >= (int64_t)index.size()) return nullptr;
    const int64_t i = index[layer][target];
    return i >= 0 ? &mats[i] : nullptr;
  }
  int64_t n_params() const;
};

// in and out widths of a projection of the model.
int64_t lora_in_dim(const ModelConfig& c, int target);
int64_t lora_out_dim(const ModelConfig& c, int target);

// Adapters on every layer for each target in s.targets; A seeded and deterministic, B = 0.
LoraAdapters lora_init(const ModelConfig& c, const LoraSettings& s, uint64_t seed);

// DIR/lora.safetensors (layers.L.{q,k,v,o}.lora_a [r, in], .lora_b [out, r]) and DIR/lora.json
// (rank, alpha, targets, model shape). Both writes are atomic.
void save_lora(const LoraAdapters& a, const std::string& dir, const ModelConfig& c, const std::string& model_path);
// Loads and checks against the model (dimensions, layers, shapes, finite values); errors name
// the file.
LoraAdapters load_lora(const std::string& dir, const ModelConfig& c);

// Merged copy of one adapted projection: W + (alpha / r) B A, [out, in].
std::vector<float> lora_merged(const float* W, const LoraMatrix& a, float scale);

// Writes merged copies of the adapted matrices into the model's owned storage and points the
// layers at them; the original matrices are left untouched (other views may still use them).
void apply_lora(Model& m, const LoraAdapters& a);

// A model sharing m's weights (and none of its storage or tokenizer) with the adapters merged:
// for evaluating adapters during training without copying the whole model.
Model lora_merged_view(const Model& m, const LoraAdapters& a);

// load_lora + apply_lora: what a command needs for --lora DIR.
void load_and_apply_lora(Model& m, const std::string& dir);

}  // namespace focus
