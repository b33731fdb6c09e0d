// Training through a frozen transformer: the loss of one window and the gradient of the small
// trainable parts, Focus routers and/or LoRA adapters on the attention projections (lora.h).
// Only activation gradients flow through frozen weights; training from scratch (ModelGrads) also
// accumulates the gradients of every weight of the model.
// Every architecture of forward() is covered (Llama family with GQA, Gemma 3 with its
// sliding-window layers, QK norms and extra norms, GPT-2).
//
// The blocks are model/block.h's, with the attention plan of focus_train_plan: router layers run
// Focus soft attention (the additive log-bias of spec section 2), other layers plain causal (or
// sliding-window) attention. Adapted projections run unmerged: y = x W^T + b + (alpha / r) (x A^T) B^T.
// Layer activations are either kept from the forward pass or recomputed layer by layer from the
// stored residual inputs, whichever the memory budget allows; both give the same numbers.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "focus/focus_attention.h"
#include "focus/focus_model.h"
#include "focus/router.h"
#include "model/block.h"
#include "model/model.h"
#include "train/lora.h"

namespace focus {

// One training window: the model input ids[0..T) (positions 0..T-1) and, per row, the token to
// predict (targets[t] < 0: row not scored).
struct TrainWindow {
  const int32_t* ids = nullptr;
  int64_t T = 0;
  const int32_t* targets = nullptr;
};

struct LossGrad {
  double loss_sum = 0;  // sum of -log p(target) over scored rows (unscaled)
  int64_t scored = 0;
};

struct BackwardOptions {
  // Keep every layer's activations when they fit in this many bytes; otherwise keep only each
  // layer's input and recompute the rest during the backward pass.
  double keep_activations_bytes = 2.0 * (1 << 30);
  int force_recompute = -1;  // -1: decide by the budget; 0: keep; 1: recompute
};

// Where the gradients of the model's own weights accumulate (training from scratch): every
// pointer set, laid out like ModelWeights (lm_head == tok_emb when the output is tied). The model's
// matrices must then be float32.
struct ModelGrads {
  float* tok_emb = nullptr;
  float* pos_emb = nullptr;
  float* out_norm = nullptr;  float* out_norm_b = nullptr;
  float* lm_head = nullptr;
  std::vector<LayerGrads> layers;
};

// What one loss-and-gradient call runs and trains. Either part may be absent: no routers is
// plain causal attention everywhere, no adapters the frozen projections. A part whose gradient
// buffers are null is applied in the forward pass but not trained.
struct TrainableSet {
  const FocusRouters* routers = nullptr;
  std::vector<std::vector<float>>* router_grads = nullptr;  // per router, sized like its params
  RouterAuxHook router_hook = nullptr;
  bool router_detach_input = false;  // the routers' input gradient stops at the routers
  const LoraAdapters* lora = nullptr;
  std::vector<std::vector<float>>* lora_grads = nullptr;    // per adapter matrix (lora->mats)
  const ModelGrads* model_grads = nullptr;                  // the model's weights, when trained
};

// Loss L = loss_scale * sum_t -log p(targets[t] | ids[0..t]) with Focus soft attention on router
// layers and the adapters applied. Accumulates (+=) dL/dparams into the gradient buffers given.
// Layers below the lowest trained part get no backward pass.
// What one loss-and-gradient call over a window of T tokens allocates (layer inputs, the kept or
// recomputed activations, the head's logits, routing scratch for G groups, LoRA's kept columns),
// for check_memory before training starts.
MemoryNeed training_memory(const ModelConfig& c, int64_t T, int64_t G, int64_t lora_cols,
                           const BackwardOptions& opt = {});

LossGrad train_loss_and_grad(const Model& m, const TrainableSet& ts, const TrainWindow& w, float loss_scale,
                             const BackwardOptions& opt = {});

// The same loss without gradients; for tests and checks.
double train_loss(const Model& m, const TrainableSet& ts, const TrainWindow& w, int64_t* scored = nullptr);

// Router training alone: train_loss_and_grad with the routers' gradients into (*grads)[r].
LossGrad focus_router_loss_and_grad(const Model& m, const FocusRouters& f, const TrainWindow& w, float loss_scale,
                                    std::vector<std::vector<float>>* grads, const RouterAuxHook& hook = nullptr,
                                    const BackwardOptions& opt = {});

// The same loss without gradients (the forward part of the above); for tests and checks.
double focus_router_loss(const Model& m, const FocusRouters& f, const TrainWindow& w, int64_t* scored = nullptr);

}  // namespace focus
