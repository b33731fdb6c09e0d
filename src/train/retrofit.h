// Retrofit: train only the Focus routers of a frozen pretrained model on a user's text (the
// shared loop of trainer.h with the routers as the trainable set).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "focus/focus_model.h"
#include "model/model.h"
#include "train/adamw.h"
#include "train/distill.h"
#include "train/trainer.h"

namespace focus {

enum class Balance { None, Swav, Bias };
Balance parse_balance(const std::string& s);  // "none" | "swav" | "bias"

struct RetrofitOptions : TrainOptions {
  FocusSettings focus;                    // window, sinks, groups, dg, topk (hard validation), tau
  Balance balance = Balance::None;
  float balance_weight = 0.1f;            // SwAV loss weight, or the bias update rate
  // Start from the routers of this folder (a finished or earlier retrofit) instead of random
  // ones: to continue training on more text or at a longer context. Its groups, d_g, tau and
  // learn_tau must equal `focus`; window and sinks may differ (they shape the pattern only).
  std::string init;
  // What trains the routers: "lm" (the language-model loss through soft attention, the paper's
  // retrofit) or "distill" (asymmetric routers taught the frozen model's attention mass by group,
  // train/distill.h; balance_weight is the SwAV weight on the key scores).
  std::string objective = "lm";
  DistillOptions distill;
  // Sparse training through the hybrid pattern with each head's own number of blocks
  // (focus.blocks > 0 gives every head the same): [layer][query head], empty for none.
  std::vector<std::vector<int64_t>> block_budget;
  // With it, each head's near blocks and its group switch (block_budget.h), as the budget file
  // gives them: empty for none.
  std::vector<std::vector<int64_t>> block_near, block_group;
};

struct ValidResult {
  double ppl_pretrained = 0, ppl_window = 0, ppl_soft = 0, ppl_hard = 0, ppl_hard_k2 = 0;
  double density_hard = 0, load_max_over_mean = 0;
  int64_t tokens = 0;
  // Asymmetric routers: of the frozen model's attention mass beyond the window, the share in the
  // groups the queries read (top-k), and each router layer's mean far mass.
  double captured = 0;
  std::vector<float> far_mass;
};

struct RetrofitResult : TrainStats {
  ValidResult before, after;  // before: the initial (random) routers; after: the trained ones
  int64_t router_params = 0;
  // With Balance::Swav: the SwAV loss (cross-entropy of p against the Sinkhorn targets, before
  // balance_weight) of the last step this run took, mean over its windows and routers; else 0.
  double swav_loss = 0;
};

// Validation perplexities of the pretrained model, the sliding-window baseline (with_pretrained)
// and of the routers (soft, hard top-k) on the same windows.
ValidResult validate(const Model& m, const FocusRouters& f, const std::vector<std::vector<int32_t>>& ids,
                     const std::vector<std::vector<int32_t>>& targets, bool with_pretrained);

RetrofitResult run_retrofit(const Model& m, const RetrofitOptions& o);

// Balancing by the SwAV loss inside the backward pass: targets from Sinkhorn over the window's
// router scores (no gradient), cross-entropy against p, its gradient (times scale) added to the
// scores' gradient; the loss values (before scale) are summed into *loss_sum, one term per
// router and window into *terms. f and the counters must outlive the hook.
RouterAuxHook swav_balance_hook(const FocusRouters& f, float scale, double* loss_sum, int64_t* terms);

}  // namespace focus
