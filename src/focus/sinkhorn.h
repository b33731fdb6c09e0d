// Balanced groups (spec section 4). Everything here is gradient-free except the SwAV loss.
//   sinkhorn_forward         balanced targets q [N, G] over a batch of tokens (log domain, fp32)
//   swav_loss_*              cross-entropy between stop-gradient targets q and p = softmax(s + b)
//   BiasBalancer             per-group bias b from running group loads (inference stays per-token)
//   capacity_route_causal    hard top-k routing with a causal per-group capacity
//   sinkhorn_assign_noncausal_for_analysis   full-sequence balanced assignment: NOT causal
//   group_load_stats         the load metric (max / mean group size, histogram)
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
//   kSign:         b_g -= lr * sign(load_g - 1/G)
//   kProportional: b_g -= lr * (G * load_g - 1)
// then b is shifted to mean zero (softmax and top-k ignore a common shift).
enum class BiasRule { kSign, kProportional };

struct BiasBalancer {
  int64_t num_groups = 0;
  float lr = 0.05f;
  float decay = 0.f;  // 0: use only the latest batch
  BiasRule rule = BiasRule::kSign;
  std::vector<double> load;  // [G] running share of memberships, sums to 1 once observed

  BiasBalancer() = default;
  BiasBalancer(int64_t g, float lr_, float decay_ = 0.f, BiasRule rule_ = BiasRule::kSign);
  void observe(const int32_t* groups, int64_t n, int64_t k);  // hard memberships [N, k]
  void observe_soft(const float* p, int64_t n);               // soft assignment [N, G]
  void update(float* bias) const;                             // bias [G]
};

// Causal capacity routing for hard mode. Token i takes its k best groups (by logits_i + bias; bias
// [G] may be null) among the admissible ones, those whose membership count over tokens 0..i-1 is below
//   cap_i = k * i / G * (1 + slack) + 1
// (the "+1" is one token of integer headroom so that token 0 has somewhere to go). If fewer than k
// groups are admissible (possible for k = 2 when slack < 1 / (G - 1)), the rest come from the
// least-loaded groups. Output: groups [N, k], each row ascending. Depends only on the prefix:
// row i is a function of logits rows 0..i. Every group ends with fewer than
//   k * (N - 1) / G * max(1 + slack, G / (G - 1)) + 2 members (the G / (G - 1) term only for k = 2).
void capacity_route_causal(const float* logits, const float* bias, int64_t n, int64_t g, int k, float slack,
                           int32_t* groups);

// NON-CAUSAL, for analysis only: Sinkhorn over the whole sequence, then each token's top-k groups
// of log q. Row i depends on every token of the sequence, future ones included.
void sinkhorn_assign_noncausal_for_analysis(const float* logits, int64_t n, int64_t g, int k, float scale,
                                            int iters, int32_t* groups);

struct GroupLoadStats {
  std::vector<int64_t> histogram;  // [G] members per group
  int64_t max = 0, min = 0;
  double mean = 0.0;           // N * k / G
  double max_over_mean = 0.0;  // 1 is perfectly balanced
};
GroupLoadStats group_load_stats(const int32_t* groups, int64_t n, int64_t k, int64_t g);

}  // namespace focus
