#include "model/attention.h"

#include <cmath>
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

// Rows up to which a call over a filled cache goes through the decoding kernel (each row's keys
// split over the threads) instead of the tiled prefill kernel.
constexpr int64_t kDecodeRows = 4;

class DenseAttention final : public AttentionPolicy {
 public:
  std::string name() const override { return "dense"; }
  bool reads_cache_views() const override { return true; }

  void attend(const AttentionCall& c, std::unique_ptr<AttentionState>& /*state*/,
              AttentionStats* /*stats*/) const override {
    const cpu::AttnShape s = layer_attn_shape(*c.cfg, c.layer, c.pos0, c.T);
    if (c.pos0 > 0 && c.T <= kDecodeRows)  // decoding: flash-decoding over the cached keys
      cpu::decode_attention(c.q, c.cache_k.data ? c.cache_k : cpu::KvView(c.k),
                            c.cache_v.data ? c.cache_v : cpu::KvView(c.v), c.out, s);
    else if (c.cache_k.data)
      cpu::flash_attention(c.q, c.cache_k, c.cache_v, c.out, nullptr, s);
    else
      cpu::flash_attention(c.q, c.k, c.v, c.out, nullptr, s);
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

AttentionOptions AttentionOptions::parse(const std::string& list, const std::string& spec) {
  AttentionOptions o;
  o.spec_ = spec;
  size_t at = 0;
  while (at < list.size()) {
    size_t end = list.find(',', at);
    if (end == std::string::npos) end = list.size();
    const std::string item = list.substr(at, end - at);
    const size_t eq = item.find('=');
    FOCUS_CHECK(eq != std::string::npos && eq > 0 && eq + 1 < item.size(), "attention spec '", spec,
                "': option '", item, "' is not key=value");
    const std::string key = item.substr(0, eq);
    FOCUS_CHECK(!o.kv_.count(key), "attention spec '", spec, "': option '", key, "' given twice");
    o.kv_[key] = item.substr(eq + 1);
    at = end + 1;
  }
  return o;
}

int64_t AttentionOptions::get_int(const std::string& key, int64_t def) const {
  auto it = kv_.find(key);
  if (it == kv_.end()) return def;
  read_.insert(key);
  size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(it->second, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  FOCUS_CHECK(used == it->second.size() && used > 0, "attention spec '", spec_, "': ", key,
              " must be an integer, got '", it->second, "'");
  return v;
}

double AttentionOptions::get_double(const std::string& key, double def) const {
  auto it = kv_.find(key);
  if (it == kv_.end()) return def;
  read_.insert(key);
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(it->second, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  FOCUS_CHECK(used == it->second.size() && used > 0 && std::isfinite(v), "attention spec '", spec_, "': ", key,
              " must be a number, got '", it->second, "'");
  return v;
}

std::string AttentionOptions::get(const std::string& key, const std::string& def) const {
  auto it = kv_.find(key);
  if (it == kv_.end()) return def;
  read_.insert(key);
  return it->second;
}

void AttentionOptions::check_all_read(const std::string& policy) const {
  for (const auto& [k, v] : kv_)
    FOCUS_CHECK(read_.count(k), "attention spec '", spec_, "': policy '", policy, "' has no option '", k, "'");
}

AttentionPlan make_attention_plan(const ModelConfig& c, const std::string& spec) {
  const size_t colon = spec.find(':');
  const std::string name = spec.substr(0, colon);
  const AttentionOptions opts =
      AttentionOptions::parse(colon == std::string::npos ? "" : spec.substr(colon + 1), spec);
  AttentionPlan plan;
  plan.layers.resize(c.layers);
  if (name == "dense") {
    opts.check_all_read(name);
    return plan;
  }
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
    if (c.layer_sliding_window[l] == 0) plan.layers[l] = factory(c, l, opts);
  opts.check_all_read(name);
  return plan;
}

}  // namespace focus
