// Per-layer attention as a policy. The transformer block (block.h) computes q, k and v and hands
// the attention itself to the layer's AttentionPolicy: dense causal (or sliding-window) attention
// is one policy, Focus soft and hard attention and the window + sinks baseline are others
// (src/focus/focus_attention.h). The model never knows which one runs.
//
// A policy is stateless and shared; what it remembers about a sequence (e.g. the routing of the
// cached positions) lives in an AttentionState that the KV cache holds for each layer and the
// policy alone creates and reads.
//
// Adding a variant: a class deriving from AttentionPolicy in one file, plus one registration line
//   static const bool registered = register_attention_policy("name", factory);
// after which make_attention_plan(cfg, "name") (or "name:key=value,...", the options the factory
// reads) runs it on every global layer; `focus eval --attention SPEC` takes the same spec.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "kernels/cpu/attn_shape.h"
#include "kernels/cpu/kv_types.h"
#include "model/config.h"

namespace focus {

// Statistics of the attention pattern over the layers that report one (sparse policies): visible
// pairs against causal pairs, and the balance of their groups.
struct AttentionStats {
  double computed_pairs = 0;      // visible (query, key) pairs summed over reporting layers
  double causal_pairs = 0;        // causal pairs over the same layers
  double load_max_over_mean = 0;  // worst layer's largest group / mean group size
  int64_t layers = 0;
  // When not null, routing policies store each routed layer's memberships of the last prefill
  // here: (*groups)[layer] = [T, topk] group ids (other layers stay empty). Asymmetric routers
  // store their keys' groups under routing head 0 after every call, a decoding step's too: the
  // groups of all n keys in the cache so far.
  std::vector<std::vector<int32_t>>* groups = nullptr;
  double density() const { return causal_pairs > 0 ? computed_pairs / causal_pairs : 1.0; }
};

// What a policy keeps about the positions of one layer's KV cache.
class AttentionState {
 public:
  virtual ~AttentionState() = default;
  // Keeps positions 0 .. n-1.
  virtual void truncate(int64_t n) = 0;
};

// One layer's attention call: the new rows pos0 .. pos0+T-1 against keys 0 .. pos0+T-1.
struct AttentionCall {
  const ModelConfig* cfg = nullptr;
  int64_t layer = 0;
  int64_t pos0 = 0, T = 0;
  const float* xn = nullptr;  // [T, dim] the block's normed input (what routers read)
  const float* q = nullptr;   // [T, q_dim] queries (normed, rotated)
  const float* k = nullptr;   // [pos0 + T, kv_dim] keys, the new rows last
  const float* v = nullptr;   // [pos0 + T, kv_dim] values
  float* out = nullptr;       // [T, q_dim]
  // Inference: the same keys and values as the KV cache holds them (its element type; k and v
  // above are their float values). A policy whose reads_cache_views() is true reads these when
  // pos0 > 0, and k and v are then null for a cache of 16-bit elements (no float copy is made).
  cpu::KvView cache_k, cache_v;
  const float* k_new = nullptr;  // [T, kv_dim] the new rows' keys as floats (null: k + pos0 rows)
};

// What a training forward keeps for its backward (per layer).
struct AttentionTape {
  std::vector<float> lse;                // [heads, T] log-sum-exp of each row
  std::unique_ptr<AttentionState> data;  // the policy's own (e.g. the router's activations)
};

class AttentionPolicy {
 public:
  virtual ~AttentionPolicy() = default;
  virtual std::string name() const = 0;

  // Inference: routes the new rows of c (into *state, which the policy creates when a sequence
  // starts at pos0 == 0) and computes c.out. A call with pos0 == 0 is a prefill; pos0 > 0 attends
  // over the cached positions (decoding, chunked prefill), which must have been filled by the same
  // policy. Policies with a sparse pattern add their pair counts to stats (may be null).
  virtual void attend(const AttentionCall& c, std::unique_ptr<AttentionState>& state,
                      AttentionStats* stats) const = 0;

  // Training, over a whole window (c.pos0 == 0): the forward fills c.out and the tape.
  virtual void train_forward(const AttentionCall& c, AttentionTape& tape) const;
  // Given dout = dL/dout [T, q_dim], accumulates (+=) dq, dk, dv (zeroed by the caller) and
  // anything the policy itself trains.
  virtual void train_backward(const AttentionCall& c, AttentionTape& tape, const float* dout, float* dq, float* dk,
                              float* dv) const;
  // After train_backward: adds the policy's own share of dL/dxn (e.g. through a router) into dxn.
  virtual void train_backward_input(const AttentionCall& /*c*/, AttentionTape& /*tape*/, float* /*dxn*/) const {}
  // Whether train_backward accumulates gradients of parameters of its own.
  virtual bool trains_parameters() const { return false; }
  // Whether attend, when pos0 > 0, reads the keys and values through c.cache_k / c.cache_v only.
  // Otherwise a cache of 16-bit elements is widened into a float copy for each such call.
  virtual bool reads_cache_views() const { return false; }
  // Copies of the layer's keys and values the policy keeps beside the cache while decoding (grouped
  // Focus: its groups' runs), for the memory estimate of a generation.
  virtual int64_t decode_kv_copies() const { return 0; }
};

// The kernels' shape for layer `layer` of c: T query rows at positions pos0 .. pos0+T-1 against
// keys 0 .. pos0+T-1, rows laid out as the block lays them out, the layer's sliding window.
cpu::AttnShape layer_attn_shape(const ModelConfig& c, int64_t layer, int64_t pos0, int64_t T);

// Plain causal attention, limited to the layer's sliding window when the model has one
// (cfg.layer_sliding_window): the model's own attention, exact. One shared instance.
const AttentionPolicy& dense_attention();

// The policy of every layer of a model.
struct AttentionPlan {
  std::vector<std::shared_ptr<const AttentionPolicy>> layers;
  // Layer l's policy (dense when the plan does not name one).
  const AttentionPolicy& at(int64_t l) const {
    return l < (int64_t)layers.size() && layers[l] ? *layers[l] : dense_attention();
  }
};

// The options of a policy spec "name:key=value,key=value". A factory reads what it knows; a key
// nobody read is an error after the plan is made (a misspelt option never passes silently).
class AttentionOptions {
 public:
  AttentionOptions() = default;
  // "key=value,key=value" (may be empty); errors name the spec.
  static AttentionOptions parse(const std::string& list, const std::string& spec);
  int64_t get_int(const std::string& key, int64_t def) const;
  double get_double(const std::string& key, double def) const;
  std::string get(const std::string& key, const std::string& def) const;
  bool has(const std::string& key) const { return kv_.count(key) > 0; }
  // Throws naming the first key no get_* call asked for.
  void check_all_read(const std::string& policy) const;

 private:
  std::map<std::string, std::string> kv_;
  std::string spec_;
  mutable std::set<std::string> read_;
};

// Registered policies, made per global layer (sliding-window layers are already local and keep
// dense_attention()).
using AttentionFactory = std::function<std::shared_ptr<const AttentionPolicy>(const ModelConfig& c, int64_t layer,
                                                                              const AttentionOptions& options)>;
// Returns true, so that a registration can initialise a static; a name registered twice throws.
bool register_attention_policy(const std::string& name, AttentionFactory factory);
std::vector<std::string> registered_attention_policies();
// The plan with the policy of spec "name" or "name:key=value,..." on every global layer; errors
// list the registered names.
AttentionPlan make_attention_plan(const ModelConfig& c, const std::string& spec);

}  // namespace focus
