// Balanced groups (spec section 4). Everything here is gradient-free except the SwAV loss.
//   sinkhorn_forward         balanced targets q [N, G] over a batch of tokens (log domain, fp32)
//   swav_loss_*              cross-entropy between stop-gradient targets q and p = softmax(s + b)
//   BiasBalancer             per-group bias b from running group loads (inference stays per-token)
//   group_load_stats         the load metric of a hard routing (max / mean group size, histogram)
// Causality: q from sinkhorn_forward mixes every token of the batch, so it may only shape the
// router through a training loss; it must never decide routing at evaluation time.
#pragma once
#include <cstdint>
#include <vector>

namespace focus {

// logits [N, G] -> q [N, G] with rows summing to 1 and columns to N / G:
//   q_ig = exp(scale * logits_ig + u_i + v_g), alternately fitting v (columns) and u (rows) for
//   `iters` rounds. Ends on the rows, so the row sums are exact and the column sums approach
//   N / G as iters grows. Stable for any finite logits (log-sum-exp throughout).
void sinkhorn_forward(const float* logits, int64_t n, int64_t g, float scale, int iters, float* q);

// SwAV-style auxiliary loss: L = -(1/N) sum_i sum_g q_ig log p_ig with p_i = softmax(s_i + b).
// s [N, G] are the router scores, bias [G] may be null, q [N, G] are constant targets.
float swav_loss_forward(const float* s, const float* bias, const float* q, int64_t n, int64_t g);
// Accumulates dL/ds [N, G] scaled by dloss (feed it to router_backward as ds).
void swav_loss_backward(const float* s, const float* bias, const float* q, int64_t n, int64_t g, float dloss,
                        float* ds);

// Per-group balancing bias updated from running group loads (no gradient):
//   load  <- decay * load + (1 - decay) * (this batch's share of memberships per group)
//   b_g   -= lr * sign(load_g - 1/G)
// then b is shifted to mean zero (softmax and top-k ignore a common shift).
struct BiasBalancer {
  int64_t num_groups = 0;
  float lr = 0.05f;
  float decay = 0.f;  // 0: use only the latest batch
  std::vector<double> load;  // [G] running share of memberships, sums to 1 once observed

  BiasBalancer() = default;
  BiasBalancer(int64_t g, float lr_, float decay_ = 0.f);
  void observe(const int32_t* groups, int64_t n, int64_t k);  // hard memberships [N, k]
  void observe_soft(const float* p, int64_t n);               // soft assignment [N, G]
  void update(float* bias) const;                             // bias [G]
};

// Group sizes of a hard routing: groups [N, k] holds each token's k group ids in [0, G).
struct GroupLoadStats {
  std::vector<int64_t> histogram;  // [G] members per group
  int64_t max = 0, min = 0;
  double mean = 0.0;           // N * k / G
  double max_over_mean = 0.0;  // 1 is perfectly balanced
};
GroupLoadStats group_load_stats(const int32_t* groups, int64_t n, int64_t k, int64_t g);

}  // namespace focus
