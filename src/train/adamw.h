// AdamW over flat parameter vectors, with the learning-rate schedule (linear warm-up, cosine decay).
#pragma once
#include <cstdint>
#include <vector>

namespace focus {

struct AdamWConfig {
  float lr = 1e-2f;
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
  float weight_decay = 0.0f;
  float grad_clip = 1.0f;  // global L2 norm clip (0 = off)
};

// Learning rate at `step` (0-based) of `total`: linear warm-up over `warmup` steps to lr, then
// cosine decay to min_ratio * lr.
float lr_schedule(float lr, int64_t step, int64_t total, int64_t warmup, float min_ratio = 0.1f);

struct AdamWState {
  std::vector<std::vector<float>> m, v;  // per parameter block
  int64_t t = 0;                         // steps taken
};

// One update of every block params[b] with grads[b] (grads are read, not cleared). Returns the
// gradient norm before clipping. decay (optional, per block): whether weight decay applies to it.
double adamw_step(const AdamWConfig& c, float lr, std::vector<std::vector<float>*>& params,
                  const std::vector<std::vector<float>>& grads, AdamWState& st,
                  const std::vector<bool>* decay = nullptr);

}  // namespace focus
