// Router distillation for asymmetric routing (focus/focus_model.h): the forward pass stays dense
// and exact, and on every router layer the frozen model's attention probabilities beyond the
// local window, summed by key group, teach the router. Nothing in the loss is helped by putting
// every key in one group, and the density is chosen at inference by the queries' top-k.
//
// For layer l with far pairs F(i, j) = (j <= i - w, j >= S) and A^h the dense attention of head h:
//   keys     P_j = softmax(scores of W_k x_j)           soft key assignment [T, G]
//   mass     M_i = mean_h sum_{j: F(i,j)} A^h_ij P_j     [T, G]; far_i = sum_g M_ig
//   queries  R_i = softmax(scores of W_r x_i)           the groups a query will read
//   L_query = -sum_i sum_g M_ig log R_ig                 cross-entropy to the normalised mass,
//                                                        weighted by the row's far mass (M held fixed)
//   L_key   = -key_weight sum_i sum_g M_ig^2 / far_i     a query's far mass gathered in few groups
//             + balance_weight * SwAV(scores of the keys) groups of keys kept spread (training only:
//                                                        inference assigns keys causally by capacity)
// The gradient of L_key reaches P through the transpose of the mass kernel
// (kernels/cpu/attention_mass.h); neither loss touches the model's weights.
//
// Residual distillation (DistillOptions::residual): for the groups of a hybrid pattern (focus.json
// "block_budget"), whose positional blocks read what block top-k with per-head budgets reads, the
// pairs those blocks read are left out of F(i, j) for each head: M and far are then the far
// attention the blocks miss, and the groups learn that.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "focus/block_budget.h"
#include "focus/focus_model.h"
#include "model/model.h"
#include "train/backward.h"

namespace focus {

struct DistillOptions {
  float key_weight = 1.0f;      // weight of the key purity term
  float balance_weight = 0.1f;  // weight of the SwAV balance on the key scores
  // Residual distillation: per-head block budgets (load_block_budget) whose block top-k reads
  // are left out of the target; null: plain distillation. Its window and sinks must be the
  // routers'. Every router layer needs its budgets.
  std::shared_ptr<const BlockBudget> residual;
};

// Sums over the router layers and rows of the windows it saw (rows with far mass only).
struct DistillStats {
  double query_ce = 0;     // L_query
  double key_purity = 0;   // sum_i sum_g M_ig^2 / far_i (before key_weight)
  double swav = 0;         // SwAV loss, summed over router layers and windows
  int64_t rows = 0;        // rows with far mass, over router layers
  std::vector<double> far_sum;   // per router: sum of far_i over its rows
  std::vector<int64_t> far_rows;  // per router: rows counted in far_sum (every row of the window)
  // Mean far mass per router (0 where none was seen).
  std::vector<float> far_mass() const;
  // Of the rows' far mass, the share the queries' top-k groups (of R) would read, k = topk.
  double captured = 0;     // sum over rows of the mass in the top-k groups of R_i
  double far_total = 0;    // sum over rows of far_i
};


// One window: a dense forward with the routers' distillation on every router layer. Accumulates
// the routers' gradients (scaled by loss_scale) into grads[router] when not null, and the losses
// into stats (may be null). Returns L_query summed (loss_sum) over the rows with far mass (scored).
LossGrad distill_loss_and_grad(const Model& m, const FocusRouters& f, const TrainWindow& w, float loss_scale,
                               const DistillOptions& o, std::vector<std::vector<float>>* grads, DistillStats* stats);

}  // namespace focus
