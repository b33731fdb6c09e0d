#include "model/attention.h"

#include <map>
#include <mutex>

#include "core/error.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/soft_attention.h"

namespace focus {

void AttentionPolicy::train_forward(const AttentionCall& /*c*/, AttentionTape& /*tape*/) const {
  fail("attention policy '", name(), "' cannot be trained");
}

void AttentionPolicy::train_backward(const AttentionCall& /*c*/, AttentionTape& /*tape*/, const float* /*dout*/,
                                     float* /*dq*/, float* /*dk*/, float* /*dv*/) const {
  fail("attention policy '", name(), "' cannot be trained");
}

namespace {

class DenseAttention final : public AttentionPolicy {
 public:
  std::string name() const override { return "dense"; }

  void attend(const AttentionCall& c, std::unique_ptr<AttentionState>& /*state*/,
              AttentionStats* /*stats*/) const override {
    cpu::flash_attention(c.q, c.k, c.v, c.out, nullptr, layer_attn_shape(*c.cfg, c.layer, c.pos0, c.T));
  }

  void train_forward(const AttentionCall& c, AttentionTape& tape) const override {
    tape.lse.resize(c.cfg->heads * c.T);
    cpu::soft_attention_forward(c.q, c.k, c.v, nullptr, c.out, tape.lse.data(),
                                layer_attn_shape(*c.cfg, c.layer, c.pos0, c.T));
  }

  void train_backward(const AttentionCall& c, AttentionTape& tape, const float* dout, float* dq, float* dk,
                      float* dv) const override {
    cpu::soft_attention_backward(c.q, c.k, c.v, nullptr, c.out, tape.lse.data(), dout, dq, dk, dv, nullptr,
                                 layer_attn_shape(*c.cfg, c.layer, c.pos0, c.T));
  }
};

struct Registry {
  std::mutex mu;
  std::map<std::string, AttentionFactory> factories;
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

cpu::AttnShape layer_attn_shape(const ModelConfig& c, int64_t layer, int64_t pos0, int64_t T) {
  cpu::AttnShape s;
  s.n_q = T;
  s.n_kv = pos0 + T;
  s.q_pos0 = pos0;
  s.heads = c.heads;
  s.kv_heads = c.kv_heads;
  s.head_dim = c.head_dim;
  s.q_stride = c.q_dim();
  s.kv_stride = c.kv_dim();
  s.o_stride = c.q_dim();
  s.scale = c.attn_scale;
  s.sliding_window = c.layer_sliding_window[layer];
  return s;
}

const AttentionPolicy& dense_attention() {
  static const DenseAttention dense;
  return dense;
}

bool register_attention_policy(const std::string& name, AttentionFactory factory) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  FOCUS_CHECK(!name.empty() && factory, "register_attention_policy: a policy needs a name and a factory");
  FOCUS_CHECK(!r.factories.count(name), "attention policy '", name, "' is registered twice");
  r.factories[name] = std::move(factory);
  return true;
}

std::vector<std::string> registered_attention_policies() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::string> names{"dense"};
  for (const auto& [n, f] : r.factories) names.push_back(n);
  return names;
}

AttentionPlan make_attention_plan(const ModelConfig& c, const std::string& name) {
  AttentionPlan plan;
  plan.layers.resize(c.layers);
  if (name == "dense") return plan;
  AttentionFactory factory;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.factories.find(name);
    if (it != r.factories.end()) factory = it->second;
  }
  if (!factory) {
    std::string known;
    for (const auto& n : registered_attention_policies()) known += (known.empty() ? "" : ", ") + n;
    fail("unknown attention policy '", name, "' (registered: ", known, ")");
  }
  for (int64_t l = 0; l < c.layers; ++l)
    if (c.layer_sliding_window[l] == 0) plan.layers[l] = factory(c, l);
  return plan;
}

}  // namespace focus
