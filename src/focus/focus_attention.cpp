#include "focus/focus_attention.h"

#include <algorithm>
#include <climits>
#include <cmath>

#include "core/error.h"
#include "core/threads.h"
#include "focus/focus_cache.h"
#include "focus/group_layout.h"
#include "focus/balancing.h"
#include "focus/block_budget.h"
#include "focus/block_topk.h"
#include "kernels/cpu/cached_attention.h"
#include "kernels/cpu/grouped_attention.h"
#include "kernels/cpu/soft_attention.h"
#include "kernels/cpu/sparse_attention.h"

namespace focus {
namespace {

// The routing of the cached positions of one layer.
struct RoutingState final : AttentionState {
  FocusLayerCache fc;
  void truncate(int64_t n) override {
    if (fc.len > n) fc.truncate(n);
  }
};

// What the soft training forward keeps for the backward pass.
struct RouterTape final : AttentionState {
  RouterCache rc;
  std::vector<float> dp, ds, scratch;
  void truncate(int64_t) override {}
};

// The kernels' shape of a Focus layer over n tokens (self-attention from position 0; the cached
// kernel reads its own pos0 and row count).
cpu::AttnShape focus_shape(const ModelConfig& c, const FocusSettings& fs, int64_t layer, int64_t n) {
  cpu::AttnShape s = layer_attn_shape(c, layer, 0, n);
  s.local_window = fs.local_window;
  s.sinks = fs.sinks;
  s.groups = fs.groups;
  s.eps = fs.eps;
  return s;
}

// The cached rows of a call: the cache's own view when the caller set one, else the floats.
cpu::KvView cache_or_floats(cpu::KvView view, const float* f) {
  return view.data ? view : cpu::KvView(f);
}

void add_causal(AttentionStats* stats, int64_t pos0, int64_t T, double pairs) {
  stats->computed_pairs += pairs;
  stats->causal_pairs += (double)T * (double)pos0 + 0.5 * (double)T * (double)(T + 1);
  stats->layers++;
}

// Window + sinks (no groups): the sliding-window baseline.
class WindowAttention final : public AttentionPolicy {
 public:
  explicit WindowAttention(const FocusSettings& fs) : fs_(fs) {}
  std::string name() const override { return "window"; }
  bool reads_cache_views() const override { return true; }

  void attend(const AttentionCall& a, std::unique_ptr<AttentionState>& state, AttentionStats* stats) const override {
    const ModelConfig& c = *a.cfg;
    const int64_t n = a.pos0 + a.T;
    if (n <= fs_.local_window) return dense_attention().attend(a, state, nullptr);
    if (a.pos0 == 0) {
      cpu::focus_window_attention(a.q, a.k, a.v, a.out, nullptr, focus_shape(c, fs_, a.layer, a.T));
      if (stats) {
        const int64_t T = a.T;
        const double w = (double)std::min(fs_.local_window, T);
        // Window pairs, plus sink keys j < S outside the window of rows i >= w.
        double pairs = w * (w + 1) / 2 + (double)(T - (int64_t)w) * w;
        for (int64_t j = 0; j < std::min(fs_.sinks, T); ++j)
          pairs += (double)std::max<int64_t>(0, T - (j + fs_.local_window));
        add_causal(stats, 0, T, pairs);
      }
      return;
    }
    static const FocusLayerCache none;
    const int64_t pairs = cpu::focus_cached_attention(a.q, cache_or_floats(a.cache_k, a.k),
                                                      cache_or_floats(a.cache_v, a.v), a.out,
                                                      focus_shape(c, fs_, a.layer, n), a.pos0, a.T, FocusMode::Window,
                                                      none);
    if (stats) add_causal(stats, a.pos0, a.T, (double)pairs);
  }

 private:
  FocusSettings fs_;
};

// Soft or hard Focus on one router layer.
class FocusAttention final : public AttentionPolicy {
 public:
  FocusAttention(const FocusSettings& fs, const RouterParams* rp, int64_t router, std::vector<float>* grad,
                 RouterAuxHook hook, bool detach_input = false)
      : fs_(fs), rp_(rp), router_(router), grad_(grad), hook_(std::move(hook)), detach_input_(detach_input) {
    if (!grad_) proj_ = router_projections({{rp_, RouterSide::Query}});  // inference: the router stays as it is
  }
  std::string name() const override { return fs_.mode == FocusMode::Soft ? "focus-soft" : "focus-hard"; }
  bool reads_cache_views() const override { return true; }
  bool trains_parameters() const override { return grad_ != nullptr; }

  void attend(const AttentionCall& a, std::unique_ptr<AttentionState>& state, AttentionStats* stats) const override {
    const ModelConfig& c = *a.cfg;
    const bool soft = fs_.mode == FocusMode::Soft;
    // Route the new rows into the layer's state.
    if (a.pos0 == 0 || !state) {
      FOCUS_CHECK(a.pos0 == 0, "forward: the KV cache holds ", a.pos0, " positions but no Focus routing (layer ",
                  a.layer, "); fill it from position 0 with the same routers");
      state = std::make_unique<RoutingState>();
    }
    auto* rs = dynamic_cast<RoutingState*>(state.get());
    FOCUS_CHECK(rs, "forward: the KV cache of layer ", a.layer, " was filled by another attention policy");
    FocusLayerCache& fc = rs->fc;
    if (a.pos0 == 0) fc.reset(fs_.groups, fs_.topk);
    FOCUS_CHECK(fc.len == a.pos0 && fc.groups == fs_.groups && fc.topk == fs_.topk, "forward: the KV cache holds ",
                a.pos0, " positions but the Focus routing of ", fc.len, " of them (layer ", a.layer,
                "); fill it from position 0 with the same routers");
    FOCUS_CHECK(!soft || a.pos0 == 0 || !fc.p.empty(),
                "forward: the KV cache was filled with hard routing; soft mode needs it filled in soft mode");
    RouterCache rc;
    const std::vector<float> pr = proj_.rows(a.xn, a.T);
    router_forward(*rp_, a.xn, a.T, rc, RouterSide::Query, soft, pr.empty() ? nullptr : pr.data(), proj_.stride);
    std::vector<int32_t> groups(a.T * fs_.topk);
    router_topk(rc.s.data(), rp_->bias.data(), a.T, fs_.groups, fs_.topk, groups.data());
    fc.append(groups.data(), soft ? rc.p.data() : nullptr, a.T);

    const int64_t n = a.pos0 + a.T;
    if (n <= fs_.local_window) return dense_attention().attend(a, state, nullptr);
    if (a.pos0 > 0) {
      const int64_t pairs = cpu::focus_cached_attention(a.q, cache_or_floats(a.cache_k, a.k),
                                                        cache_or_floats(a.cache_v, a.v), a.out,
                                                        focus_shape(c, fs_, a.layer, n), a.pos0, a.T, fs_.mode, fc);
      if (stats && !soft) add_causal(stats, a.pos0, a.T, (double)pairs);
      return;
    }
    if (soft) {
      cpu::soft_attention_forward(a.q, a.k, a.v, rc.p.data(), a.out, nullptr, focus_shape(c, fs_, a.layer, a.T));
      return;
    }
    const Routing routing{groups.data(), fs_.groups, fs_.topk};
    cpu::focus_attention_fused(a.q, a.k, a.v, a.out, nullptr, focus_shape(c, fs_, a.layer, a.T), routing);
    if (!stats) return;
    if (stats->groups) {
      if ((int64_t)stats->groups->size() < c.layers) stats->groups->resize(c.layers);
      (*stats->groups)[a.layer] = groups;
    }
    add_causal(stats, 0, a.T, (double)cpu::focus_pair_count(routing, a.T, fs_.local_window, fs_.sinks));
    const GroupLoadStats g = group_load_stats(groups.data(), a.T, fs_.topk, fs_.groups);
    stats->load_max_over_mean = std::max(stats->load_max_over_mean, g.max_over_mean);
  }

  void train_forward(const AttentionCall& a, AttentionTape& tape) const override {
    FOCUS_CHECK(fs_.mode == FocusMode::Soft, "Focus trains in soft mode only");
    auto t = std::make_unique<RouterTape>();
    router_forward(*rp_, a.xn, a.T, t->rc);
    tape.lse.resize(a.cfg->heads * a.T);
    cpu::soft_attention_forward(a.q, a.k, a.v, t->rc.p.data(), a.out, tape.lse.data(),
                           focus_shape(*a.cfg, fs_, a.layer, a.T));
    tape.data = std::move(t);
  }

  void train_backward(const AttentionCall& a, AttentionTape& tape, const float* dout, float* dq, float* dk,
                      float* dv) const override {
    auto& t = static_cast<RouterTape&>(*tape.data);
    t.dp.assign(a.T * fs_.groups, 0.f);
    cpu::soft_attention_backward(a.q, a.k, a.v, t.rc.p.data(), a.out, tape.lse.data(), dout, dq, dk, dv, t.dp.data(),
                            focus_shape(*a.cfg, fs_, a.layer, a.T));
  }

  void train_backward_input(const AttentionCall& a, AttentionTape& tape, float* dxn) const override {
    auto& t = static_cast<RouterTape&>(*tape.data);
    t.ds.assign(a.T * fs_.groups, 0.f);
    if (hook_) hook_(router_, t.rc, t.ds.data());
    // Without a gradient buffer the router still passes its input gradient on.
    float* gr = nullptr;
    if (grad_) {
      gr = grad_->data();
    } else {
      t.scratch.assign(rp_->params.size(), 0.f);
      gr = t.scratch.data();
    }
    router_backward(*rp_, a.xn, t.rc, t.dp.data(), t.ds.data(), gr, detach_input_ ? nullptr : dxn);
  }

 private:
  FocusSettings fs_;
  const RouterParams* rp_;
  int64_t router_;
  std::vector<float>* grad_;
  RouterProjections proj_;  // inference: the projection kept transposed (none when training)
  RouterAuxHook hook_;
  bool detach_input_;
};

// The routing of one asymmetric layer's cached keys under each of its RH routers: one group per
// key and the index of their members that the kernel reads (both in index), and the groups' loads.
struct KeyRoutingState final : AttentionState {
  int64_t route_heads = 1, groups = 0, sinks = 0;
  std::vector<int64_t> load;                    // [RH, G] keys at or after the sinks in each group
  cpu::GroupedKeyIndex index;
  std::unique_ptr<BlockTopKState> blocks;  // the hybrid pattern's positional blocks, or null
  std::vector<std::vector<float>> far_k;   // [RH][len] the keys' far-pair terms (far_bias), else empty
  // Decoding: each group's keys and values (and far-pair terms) copied into one run (made at the
  // first decoding step, then kept up to date), so that a step streams its groups instead of
  // gathering them.
  cpu::GroupedKvRuns runs;
  int64_t len() const { return index.n_keys; }
  void truncate(int64_t n) override {
    if (blocks) blocks->truncate(n);
    const int64_t old = len();
    if (old <= n) return;
    for (int64_t r = 0; r < route_heads; ++r) {
      const int32_t* kg = index.groups_of_keys(r);
      for (int64_t j = std::max(n, sinks); j < old; ++j) load[r * groups + kg[j]]--;
      if (!far_k.empty()) far_k[r].resize(n);
    }
    index.truncate(n);
    runs.truncate(index, n);
  }
};

// Keys at positions pos0 .. pos0+T-1 into groups [T]: each key takes its best group (scores s [T, G]
// + bias) with room left, room = key_capacity times the mean load of the keys so far (load [G]:
// keys at or after the sinks in each group, updated). A key's group depends on the keys before
// it only: causal.
void assign_keys(const FocusSettings& fs, const float* s, const float* bias, int64_t pos0, int64_t T, int64_t* load,
                 int32_t* groups) {
  const int64_t G = fs.groups;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t j = pos0 + t;
    const float* sc = s + t * G;
    const bool counted = j >= fs.sinks;
    const int64_t cap =
        counted ? std::max<int64_t>(1, (int64_t)std::ceil(fs.key_capacity * (double)(j - fs.sinks + 1) / (double)G))
                : INT64_MAX;
    int32_t best = -1;
    for (int64_t g = 0; g < G; ++g)
      if (load[g] < cap && (best < 0 || sc[g] + bias[g] > sc[best] + bias[best])) best = (int32_t)g;
    groups[t] = best;
    if (counted) load[best]++;
  }
}

// The largest of p[0 .. G-1] (the first of equals): the group a relative weight divides by.
int64_t best_group(const float* p, int64_t G) { return std::max_element(p, p + G) - p; }

// The memberships of one router's keys and queries in the soft kernel's form, [T, G] each: key j
// in its group kg[j], query i in its k groups top[i]; each of weight 1 (the hard pattern), or with
// group weights (pk, pq: the routers' softmax [T, G], else null) the router's probability of the
// group relative to its most probable one (a query's best group is always among those it reads).
void set_memberships(int64_t T, int64_t G, const int32_t* kg, const int32_t* top, int k, const float* pk,
                     const float* pq, float* mk, float* mq) {
  for (int64_t j = 0; j < T; ++j)
    mk[j * G + kg[j]] = pk ? pk[j * G + kg[j]] / pk[j * G + best_group(pk + j * G, G)] : 1.f;
  for (int64_t i = 0; i < T; ++i)
    for (int c = 0; c < k; ++c) {
      const int32_t g = top[i * k + c];
      mq[i * G + g] = pq ? pq[i * G + g] / pq[i * G + best_group(pq + i * G, G)] : 1.f;
    }
}

// dL/dp of the relative weights m_g = p_g / p_a (a the best group) of the groups a row holds
// (m_g > 0), given dL/dm: m_a = 1 is constant; each other m_g moves with p_g and against p_a.
void relative_weight_grad(const float* p, const float* m, const float* dm, int64_t G, float* dp) {
  const int64_t a = best_group(p, G);
  double to_a = 0;
  for (int64_t g = 0; g < G; ++g) {
    dp[g] = 0.f;
    if (g == a || m[g] <= 0.f) continue;
    dp[g] = dm[g] / p[a];
    to_a -= (double)dm[g] * m[g] / p[a];
  }
  dp[a] = (float)to_a;
}

// Far-pair terms (settings.far_bias) eq, ek [T] on memberships: each query's mq [T, G] scaled by
// exp(eq), each key's mk [T, G] by exp(ek), so a far pair read carries eq(i) + ek(j) in the
// kernel's log(sum_g mq mk + eps). apply_far_bias computes the terms of router rp over x [T, D]
// first (router_far_bias).
void scale_by_far_terms(const float* eq, const float* ek, int64_t T, int64_t G, float* mq, float* mk) {
  for (int64_t i = 0; i < T; ++i) {
    const float fq = std::exp(eq[i]), fk = std::exp(ek[i]);
    for (int64_t g = 0; g < G; ++g) {
      mq[i * G + g] *= fq;
      mk[i * G + g] *= fk;
    }
  }
}
void apply_far_bias(const RouterParams& rp, const float* x, int64_t T, int64_t G, float* eq, float* ek, float* mq,
                    float* mk) {
  router_far_bias(rp, x, T, RouterSide::Query, eq);
  router_far_bias(rp, x, T, RouterSide::Key, ek);
  scale_by_far_terms(eq, ek, T, G, mq, mk);
}

// What the sparse training forward keeps: per router the key and query caches and the
// memberships the kernel read (0/1, or weighted), and their gradients.
struct SparseTape final : AttentionState {
  std::vector<RouterCache> kc, qc;  // [RH]
  std::vector<float> mq, mk;        // [RH, T, G]: groups read by the queries, group of each key
  std::vector<float> dmq, dmk;      // their gradients
  std::vector<float> eq, ek;        // [RH, T]: far-pair terms (far_bias)
  // The hybrid pattern: the positional blocks each (head, row) reads, [H, T, words] bits, and the
  // terms' gradients through the pairs they read [RH, T].
  std::vector<uint64_t> block_bits;
  int64_t block_words = 0;
  std::vector<float> deq, dek;
  void truncate(int64_t) override {}
};

// The hybrid pattern's blocks as block top-k settings (uniform, or each head's budget).
BlockTopKSettings hybrid_blocks(const FocusSettings& fs) {
  BlockTopKSettings bs;
  bs.block = fs.block_size;
  bs.k = fs.blocks;
  bs.select_every = fs.block_select_every;
  if (!fs.block_head_k.empty()) bs.set_head_k(fs.block_head_k, fs.block_head_near);
  bs.window = fs.local_window;
  bs.sinks = fs.sinks;
  return bs;
}

// The blocks the hybrid (settings fs) reads for every (row, query head) of a whole window from
// position 0, as bits [heads, T, words] of the soft kernel's SoftKeys.
int64_t select_block_bits(const AttentionCall& a, const FocusSettings& fs, std::vector<uint64_t>& bits) {
  const int64_t T = a.T, H = a.cfg->heads, B = fs.block_size;
  std::vector<int32_t> qb;
  const int kq = block_topk_select_window(a, hybrid_blocks(fs), qb);
  const int64_t words = ((T + B - 1) / B + 63) / 64;
  bits.assign(H * T * words, 0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int c2 = 0; c2 < kq; ++c2) {
        const int32_t b = qb[(t * H + h) * kq + c2];
        if (b >= 0) bits[(h * T + t) * words + b / 64] |= uint64_t{1} << (b % 64);
      }
  return words;
}

// Asymmetric Focus, hard mode: keys in one group each (by W_k, causally balanced), queries read
// their top-k groups (by W_r); one router per layer or per kv head (its query heads follow it).
// The grouped kernel computes window, sinks and those groups.
class AsymmetricFocusAttention final : public AttentionPolicy {
 public:
  AsymmetricFocusAttention(const FocusSettings& fs, const RouterParams* rp, int64_t route_heads,
                            std::vector<float>* grads = nullptr, int64_t first_router = 0, RouterAuxHook hook = nullptr)
      : fs_(fs), blocks_(hybrid_blocks(fs)), rp_(rp), rh_(route_heads), grads_(grads), first_(first_router),
        hook_(std::move(hook)) {
    // Inference on the hidden state: the routers stay as they are, so the projections of every
    // router and side are kept transposed side by side and run in one pass per row.
    if (grads_ || fs_.route_on_qk) return;
    std::vector<std::pair<const RouterParams*, RouterSide>> list, far;
    for (int64_t r = 0; r < rh_; ++r) list.push_back({rp_ + r, RouterSide::Key}), list.push_back({rp_ + r, RouterSide::Query});
    if (fs_.far_bias) far = list;  // the far-pair terms' vectors too: the same pass computes them
    proj_ = router_projections(list, far);
  }
  std::string name() const override { return fs_.blocks > 0 ? "focus-hybrid" : "focus-asymmetric"; }
  bool reads_cache_views() const override { return true; }
  bool trains_parameters() const override { return grads_ != nullptr; }

  // Training through the pattern inference uses (retrofit --objective sparse): keys in their
  // capacity-balanced group, queries reading their top-k groups, as 0/1 memberships of the soft
  // kernel with a tiny eps (a masked pair keeps a weight of eps). The memberships' gradients
  // (for a masked pair: the first-order change of the loss if it were read) pass straight
  // through to the router scores of both sides. The hybrid pattern's blocks are selected as
  // inference selects them; a pair they read gives its gradient to the far-pair terms only.
  void train_forward(const AttentionCall& a, AttentionTape& tape) const override {
    FOCUS_CHECK(a.pos0 == 0, "Focus trains on whole windows from position 0");
    FOCUS_CHECK(!fs_.route_on_qk, "sparse training reads the hidden state (routers on q/k vectors train by distillation)");
    FOCUS_CHECK(fs_.blocks == 0 || !fs_.group_bias, "sparse training with positional blocks has no group weights");
    const int64_t G = fs_.groups, T = a.T, RH = rh_;
    auto t = std::make_unique<SparseTape>();
    t->kc.resize(RH);
    t->qc.resize(RH);
    t->mq.assign(RH * T * G, 0.f);
    t->mk.assign(RH * T * G, 0.f);
    std::vector<int32_t> kg(T), top(T * fs_.topk);
    std::vector<int64_t> load(G);
    if (fs_.far_bias) {
      t->eq.resize(RH * T);
      t->ek.resize(RH * T);
    }
    for (int64_t r = 0; r < RH; ++r) {
      router_forward(rp_[r], a.xn, T, t->kc[r], RouterSide::Key, true);
      std::fill(load.begin(), load.end(), 0);
      assign_keys(fs_, t->kc[r].s.data(), rp_[r].bias.data(), 0, T, load.data(), kg.data());
      router_forward(rp_[r], a.xn, T, t->qc[r], RouterSide::Query, true);
      router_topk(t->qc[r].s.data(), rp_[r].bias.data(), T, G, fs_.topk, top.data());
      set_memberships(T, G, kg.data(), top.data(), fs_.topk, fs_.group_bias ? t->kc[r].p.data() : nullptr,
                      fs_.group_bias ? t->qc[r].p.data() : nullptr, t->mk.data() + r * T * G, t->mq.data() + r * T * G);
      if (fs_.far_bias)
        apply_far_bias(rp_[r], a.xn, T, G, t->eq.data() + r * T, t->ek.data() + r * T, t->mq.data() + r * T * G,
                       t->mk.data() + r * T * G);
    }
    if (fs_.blocks > 0) t->block_words = select_block_bits(a, fs_, t->block_bits);
    tape.lse.resize(a.cfg->heads * T);
    cpu::soft_attention_forward(a.q, a.k, a.v, t->mq.data(), a.out, tape.lse.data(), sparse_shape(a), soft_keys(*t));
    tape.data = std::move(t);
  }

  // The soft kernel's view of a tape: the keys' memberships, the blocks and the far-pair terms.
  cpu::SoftKeys soft_keys(SparseTape& t) const {
    cpu::SoftKeys keys{t.mk.data(), t.dmk.empty() ? nullptr : t.dmk.data(), rh_};
    if (t.block_bits.empty()) return keys;
    keys.block_bits = t.block_bits.data();
    keys.block_size = fs_.block_size;
    keys.block_words = t.block_words;
    if (!fs_.block_head_group.empty()) keys.head_groups = fs_.block_head_group.data();  // the group switch
    if (fs_.far_bias) {
      keys.eq = t.eq.data();
      keys.ek = t.ek.data();
      if (!t.deq.empty()) keys.deq = t.deq.data(), keys.dek = t.dek.data();
    }
    return keys;
  }

  void train_backward(const AttentionCall& a, AttentionTape& tape, const float* dout, float* dq, float* dk,
                      float* dv) const override {
    auto& t = static_cast<SparseTape&>(*tape.data);
    t.dmq.assign(t.mq.size(), 0.f);
    t.dmk.assign(t.mk.size(), 0.f);
    if (!t.block_bits.empty() && fs_.far_bias) {
      t.deq.assign(t.eq.size(), 0.f);
      t.dek.assign(t.ek.size(), 0.f);
    }
    cpu::soft_attention_backward(a.q, a.k, a.v, t.mq.data(), a.out, tape.lse.data(), dout, dq, dk, dv, t.dmq.data(),
                                 sparse_shape(a), soft_keys(t));
  }

  void train_backward_input(const AttentionCall& a, AttentionTape& tape, float* dxn) const override {
    auto& t = static_cast<SparseTape&>(*tape.data);
    const int64_t G = fs_.groups, T = a.T;
    std::vector<float> scratch, ds_key, dp_query, dp_key, uq, uk, duq, duk, de;
    for (int64_t r = 0; r < rh_; ++r) {
      float* gr = nullptr;
      if (grads_) {
        gr = grads_[r].data();
      } else {
        scratch.assign(rp_[r].params.size(), 0.f);
        gr = scratch.data();
      }
      // The memberships before the far-pair terms (u) and their gradients (du).
      const float *mq = t.mq.data() + r * T * G, *mk = t.mk.data() + r * T * G;
      const float *dmq = t.dmq.data() + r * T * G, *dmk = t.dmk.data() + r * T * G;
      if (fs_.far_bias) {
        const float *eq = t.eq.data() + r * T, *ek = t.ek.data() + r * T;
        de.resize(T);
        // d e_q(i) = sum_g dmq(i, g) mq(i, g), plus what the pairs blocks read give (deq).
        const float* bq = t.deq.empty() ? nullptr : t.deq.data() + r * T;
        const float* bk = t.dek.empty() ? nullptr : t.dek.data() + r * T;
        for (int64_t i = 0; i < T; ++i) {
          double d = bq ? bq[i] : 0.0;
          for (int64_t g = 0; g < G; ++g) d += (double)dmq[i * G + g] * mq[i * G + g];
          de[i] = (float)d;
        }
        router_far_bias_backward(rp_[r], a.xn, T, RouterSide::Query, eq, de.data(), gr, dxn);
        for (int64_t j = 0; j < T; ++j) {
          double d = bk ? bk[j] : 0.0;
          for (int64_t g = 0; g < G; ++g) d += (double)dmk[j * G + g] * mk[j * G + g];
          de[j] = (float)d;
        }
        router_far_bias_backward(rp_[r], a.xn, T, RouterSide::Key, ek, de.data(), gr, dxn);
        uq.resize(T * G);
        uk.resize(T * G);
        duq.resize(T * G);
        duk.resize(T * G);
        for (int64_t i = 0; i < T; ++i) {
          const float fq = std::exp(eq[i]), fk = std::exp(ek[i]);
          for (int64_t g = 0; g < G; ++g) {
            uq[i * G + g] = mq[i * G + g] / fq;
            duq[i * G + g] = dmq[i * G + g] * fq;
            uk[i * G + g] = mk[i * G + g] / fk;
            duk[i * G + g] = dmk[i * G + g] * fk;
          }
        }
        mq = uq.data();
        mk = uk.data();
        dmq = duq.data();
        dmk = duk.data();
      }
      if (fs_.group_bias) {
        // A read membership is the router's relative probability of the group: its gradient goes
        // through the softmax; which groups are read (the selection) passes no gradient.
        dp_query.resize(T * G);
        dp_key.resize(T * G);
        for (int64_t i = 0; i < T; ++i) {
          relative_weight_grad(t.qc[r].p.data() + i * G, mq + i * G, dmq + i * G, G, dp_query.data() + i * G);
          relative_weight_grad(t.kc[r].p.data() + i * G, mk + i * G, dmk + i * G, G, dp_key.data() + i * G);
        }
        ds_key.assign(T * G, 0.f);
        if (hook_) hook_(first_ + r, t.kc[r], ds_key.data());  // balance on the keys' scores
        router_backward(rp_[r], a.xn, t.qc[r], dp_query.data(), nullptr, gr, dxn, RouterSide::Query);
        router_backward(rp_[r], a.xn, t.kc[r], dp_key.data(), ds_key.data(), gr, dxn, RouterSide::Key);
        continue;
      }
      ds_key.assign(dmk, dmk + T * G);
      if (hook_) hook_(first_ + r, t.kc[r], ds_key.data());  // balance on the keys' scores
      router_backward(rp_[r], a.xn, t.qc[r], nullptr, dmq, gr, dxn, RouterSide::Query);
      router_backward(rp_[r], a.xn, t.kc[r], nullptr, ds_key.data(), gr, dxn, RouterSide::Key);
    }
  }

  // The groups' runs (KeyRoutingState::runs).
  int64_t decode_kv_copies() const override { return 1; }

  void attend(const AttentionCall& a, std::unique_ptr<AttentionState>& state, AttentionStats* stats) const override {
    FOCUS_CHECK(fs_.mode == FocusMode::Hard, "asymmetric routers run in hard or window mode (they train by "
                "distillation, with no soft form)");
    const int64_t G = fs_.groups, T = a.T, n = a.pos0 + a.T, RH = rh_;
    if (a.pos0 == 0 || !state) {
      FOCUS_CHECK(a.pos0 == 0, "forward: the KV cache holds ", a.pos0, " positions but no Focus routing (layer ",
                  a.layer, "); fill it from position 0 with the same routers");
      auto ks = std::make_unique<KeyRoutingState>();
      ks->route_heads = RH;
      ks->groups = G;
      ks->sinks = fs_.sinks;
      ks->load.assign(RH * G, 0);
      ks->index.reset(G, RH);
      if (fs_.blocks > 0) {
        ks->blocks = std::make_unique<BlockTopKState>(fs_.block_size, a.cfg->kv_heads, a.cfg->head_dim);
      }
      if (fs_.far_bias) ks->far_k.resize(RH);
      state = std::move(ks);
    }
    auto* ks = dynamic_cast<KeyRoutingState*>(state.get());
    FOCUS_CHECK(ks && ks->route_heads == RH && ks->len() == a.pos0 && (fs_.blocks > 0) == (ks->blocks != nullptr) &&
                    fs_.far_bias == !ks->far_k.empty() &&
                    (!ks->blocks || (ks->blocks->len() == a.pos0 && ks->blocks->block == fs_.block_size)),
                "forward: the KV cache of layer ", a.layer,
                " was filled by another attention policy or holds another length");
    if (ks->blocks) ks->blocks->append(a.pos0 > 0 ? cache_or_floats(a.cache_k, a.k) : cpu::KvView(a.k), a.cfg->kv_dim(),
                                       a.pos0 + a.T);
    // Keys: the best group with room, room = key_capacity times the mean load of the keys so far
    // (a key's group depends on the keys before it only: causal).
    // The buffers of a call, kept per thread (a decoding step makes no allocations of its own).
    thread_local struct Scratch {
      std::vector<RouterCache> kc, qc;  // [RH]
      std::vector<int32_t> kg, top, qg, qb;
      std::vector<std::vector<float>> in;  // [RH]
      std::vector<float> pk, pq, pr, far_q;
      std::vector<const float*> far_qp, far_kp;
    } sc;
    std::vector<int32_t>& kg = sc.kg;  // [RH, T]
    kg.resize(RH * T);
    std::vector<float>&pk = sc.pk, &pq = sc.pq;  // pk, pq with group weights: the routers' softmax [RH, T, G]
    FOCUS_CHECK(!fs_.group_bias || a.pos0 == 0, "Focus with group weights runs whole windows from position 0 (layer ",
                a.layer, "): the grouped kernels that decode from a cache have no group weights");
    if (fs_.group_bias) {
      pk.resize(RH * T * G);
      pq.resize(RH * T * G);
    }
    std::vector<float>& pr = sc.pr;  // every router's key and query projections, if kept
    pr.resize(proj_.stride * T);
    if (proj_.stride > 0) proj_.project(a.xn, T, pr.data());
    const ModelConfig& c = *a.cfg;
    // Queries (past the window): the top-k groups of each router (or its top-p, up to k), for the
    // query heads that router serves.
    const bool far = n > fs_.local_window;
    const int k = fs_.topk;
    const int64_t heads_per = c.heads / RH;
    std::vector<int32_t>&top = sc.top, &qg = sc.qg;  // top: [RH, T, k]
    top.resize(RH * T * k);
    qg.resize(T * c.heads * k);
    // (References: inside the loop another thread's sc would be its own.)
    std::vector<RouterCache>&kcs = sc.kc, &qcs = sc.qc;
    std::vector<std::vector<float>>& ins = sc.in;
    kcs.resize(RH);
    qcs.resize(RH);
    ins.resize(RH);
    // Router r's keys and queries; the routers side by side when the rows are few (decoding: a
    // few microseconds each, on one thread otherwise while the others wait).
    auto route = [&](int64_t r) {
      RouterCache& kc = kcs[r];
      router_forward(rp_[r], router_input(a, fs_, r, RH, RouterSide::Key, ins[r]), T, kc, RouterSide::Key,
                     fs_.group_bias, kept_projection(pr, r, RouterSide::Key), proj_.stride);
      if (fs_.group_bias) std::copy(kc.p.begin(), kc.p.end(), pk.begin() + r * T * G);
      assign_keys(fs_, kc.s.data(), rp_[r].bias.data(), a.pos0, T, ks->load.data() + r * G, kg.data() + r * T);
      if (fs_.far_bias) {
        std::vector<float>& fk = ks->far_k[r];
        fk.resize(a.pos0 + T);
        far_terms(pr, r, RouterSide::Key, a.xn, T, fk.data() + a.pos0);
      }
      if (!far) return;
      RouterCache& qc = qcs[r];
      router_forward(rp_[r], router_input(a, fs_, r, RH, RouterSide::Query, ins[r]), T, qc, RouterSide::Query,
                     fs_.group_bias, kept_projection(pr, r, RouterSide::Query), proj_.stride);
      if (fs_.group_bias) std::copy(qc.p.begin(), qc.p.end(), pq.begin() + r * T * G);
      int32_t* rtop = top.data() + r * T * k;
      if (fs_.topp > 0.f)
        router_topp(qc.s.data(), rp_[r].bias.data(), T, G, fs_.topp, k, rtop);
      else
        router_topk(qc.s.data(), rp_[r].bias.data(), T, G, k, rtop);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = r * heads_per; h < (r + 1) * heads_per; ++h)
          std::copy_n(rtop + t * k, k, qg.data() + (t * c.heads + h) * k);
    };
    parallel_for_checked(RH, RH > 1 && T * c.heads <= cpu::kFewPairs && num_threads() > 1, route);
    ks->index.append(kg.data(), T);
    if (!far) return dense_attention().attend(a, state, nullptr);
    if (!fs_.block_head_group.empty() && !fs_.block_calibration) {  // the group switch: heads reading no group
      FOCUS_CHECK((int64_t)fs_.block_head_group.size() == c.heads, "Focus: ", fs_.block_head_group.size(),
                  " group switches for ", c.heads, " heads (layer ", a.layer, ")");
      for (int64_t h = 0; h < c.heads; ++h)
        if (!fs_.block_head_group[h])
          for (int64_t t = 0; t < T; ++t) std::fill_n(qg.data() + (t * c.heads + h) * k, k, -1);
    }
    if (fs_.block_calibration) {
      FOCUS_CHECK(a.k && fs_.topp == 0.f, "block budget calibration: needs float keys and top-k groups");
      const GroupReads reads{qg.data(), k, &ks->index.key_group, heads_per};
      measure_block_mass_call(a, *fs_.block_calibration, &reads);
      std::unique_ptr<AttentionState> none;
      return dense_attention().attend(a, none, nullptr);
    }
    cpu::AttnShape s = layer_attn_shape(c, a.layer, a.pos0, T);
    s.local_window = fs_.local_window;
    s.sinks = fs_.sinks;
    // The kernel reads the keys' groups from the index; only the pair count needs them flat.
    cpu::GroupedRouting routing{G, RH, nullptr, k, qg.data()};
    std::vector<int32_t>& qb = sc.qb;
    if (ks->blocks) {
      routing.kb = block_topk_select(a, *ks->blocks, blocks_, qb);
      routing.block_size = fs_.block_size;
      routing.query_blocks = qb.data();
    }
    // Far-pair terms without group weights: the queries' terms [RH, T] beside the keys' in the state.
    std::vector<float>& far_q = sc.far_q;
    std::vector<const float*>&far_qp = sc.far_qp, &far_kp = sc.far_kp;
    far_qp.clear();
    far_kp.clear();
    if (fs_.far_bias && !fs_.group_bias) {
      far_q.resize(RH * T);
      for (int64_t r = 0; r < RH; ++r) {
        far_terms(pr, r, RouterSide::Query, a.xn, T, far_q.data() + r * T);
        far_qp.push_back(far_q.data() + r * T);
        far_kp.push_back(ks->far_k[r].data());
      }
      routing.far_q = far_qp.data();
      routing.far_k = far_kp.data();
    }
    int64_t pairs = 0;  // visible pairs, for the statistics
    if (fs_.group_bias) {
      // The pattern's pairs with their weights (and far-pair terms), through the soft kernel (dense
      // work) as training computes them; the pair count below is the pattern's.
      std::vector<float> mk(RH * T * G, 0.f), mq(RH * T * G, 0.f), eq(T);
      for (int64_t r = 0; r < RH; ++r) {
        set_memberships(T, G, kg.data() + r * T, top.data() + r * T * k, k,
                        fs_.group_bias ? pk.data() + r * T * G : nullptr, fs_.group_bias ? pq.data() + r * T * G : nullptr,
                        mk.data() + r * T * G, mq.data() + r * T * G);
        if (fs_.far_bias) {  // the keys' terms are the state's (a whole window from position 0)
          router_far_bias(rp_[r], a.xn, T, RouterSide::Query, eq.data());
          scale_by_far_terms(eq.data(), ks->far_k[r].data(), T, G, mq.data() + r * T * G, mk.data() + r * T * G);
        }
      }
      const cpu::SoftKeys keys{mk.data(), nullptr, RH};
      cpu::soft_attention_forward(a.q, a.k, a.v, mq.data(), a.out, nullptr, sparse_shape(a), keys);
    } else if (a.pos0 > 0) {
      const cpu::KvView kc = cache_or_floats(a.cache_k, a.k), vc = cache_or_floats(a.cache_v, a.v);
      if (T * c.heads <= cpu::kFewPairs && c.kv_heads % RH == 0) {  // decoding: the groups from their runs
        ks->runs.sync(ks->index, kc, vc, c.kv_heads, c.head_dim, s.kv_stride, routing.far_k);
        routing.runs = &ks->runs;
      }
      cpu::grouped_attention(a.q, kc, vc, a.out, nullptr, s, routing, ks->index, stats ? &pairs : nullptr);
    } else {
      cpu::grouped_attention(a.q, a.k, a.v, a.out, nullptr, s, routing, ks->index, stats ? &pairs : nullptr);
    }
    if (!stats) return;
    if (stats->groups) {
      if ((int64_t)stats->groups->size() < c.layers) stats->groups->resize(c.layers);
      (*stats->groups)[a.layer] = ks->index.key_group[0];
    }
    if (fs_.group_bias) pairs = cpu::grouped_pair_count(s, routing, ks->index);  // (the soft kernel ran)
    add_causal(stats, a.pos0, T, (double)pairs / (double)c.heads);
    if (a.pos0 == 0) {
      const int64_t S = std::min(fs_.sinks, T);
      for (int64_t r = 0; r < RH; ++r) {
        const GroupLoadStats g = group_load_stats(kg.data() + r * T + S, T - S, 1, G);
        stats->load_max_over_mean = std::max(stats->load_max_over_mean, g.max_over_mean);
      }
    }
  }

 private:
  cpu::AttnShape sparse_shape(const AttentionCall& a) const {
    cpu::AttnShape s = focus_shape(*a.cfg, fs_, a.layer, a.T);
    s.eps = kSparseEps;
    return s;
  }
  // A masked pair's weight relative to a read one: small enough that the pattern is the hard one
  // (8K masked keys leak under 1e-5 of a row's mass), large enough that its gradient stays a
  // normal float.
  static constexpr float kSparseEps = 1e-9f;

  FocusSettings fs_;
  BlockTopKSettings blocks_;  // the hybrid's blocks (hybrid_blocks(fs_)), made once
  const RouterParams* rp_;  // rh_ routers
  int64_t rh_;
  // Router r's projection of `side` in rows pr of proj_ (null without kept projections).
  const float* kept_projection(const std::vector<float>& pr, int64_t r, RouterSide side) const {
    return pr.empty() ? nullptr : pr.data() + proj_.offset[2 * r + (side == RouterSide::Key ? 0 : 1)];
  }
  // Router r's far-pair terms of `side` for the T rows: from the kept projection's rows pr when it
  // holds them, else from x (the same numbers).
  void far_terms(const std::vector<float>& pr, int64_t r, RouterSide side, const float* x, int64_t T, float* e) const {
    if (pr.empty() || proj_.far.empty())
      router_far_bias(rp_[r], x, T, side, e);
    else
      router_far_bias_projected(rp_[r], side, pr.data() + proj_.far[2 * r + (side == RouterSide::Key ? 0 : 1)],
                                proj_.stride, T, e);
  }

  std::vector<float>* grads_;  // rh_ gradient buffers, or null (inference)
  RouterProjections proj_;  // inference on the hidden state: every router's key and query projections
  int64_t first_;              // index of rp_[0] among all routers
  RouterAuxHook hook_;
};

AttentionPlan make_plan(const ModelConfig& c, const FocusRouters& f, FocusMode mode,
                        std::vector<std::vector<float>>* grads, const RouterAuxHook& hook, bool detach_input) {
  FOCUS_CHECK((int64_t)f.router_of_layer.size() == c.layers, "routers: ", f.router_of_layer.size(),
              " layer entries for a model of ", c.layers, " layers");
  AttentionPlan plan;
  plan.layers.resize(c.layers);
  if (mode == FocusMode::Off) return plan;
  FocusSettings fs = f.settings;
  fs.mode = mode;
  auto window = mode == FocusMode::Window ? std::make_shared<WindowAttention>(fs) : nullptr;
  for (int64_t l = 0; l < c.layers; ++l) {
    const int64_t r = f.router_of_layer[l];
    if (r < 0 || c.layer_sliding_window[l] > 0) continue;
    if (mode == FocusMode::Hard && f.stays_dense(r)) continue;  // the model's own attention
    if (window || (mode == FocusMode::Hard && f.window_only(r)))
      plan.layers[l] = window ? window : std::make_shared<WindowAttention>(fs);
    else if (fs.asymmetric) {
      FocusSettings fl = fs;
      fl.topk = f.layer_topk(r);
      if (!f.block_budget.empty()) fl.block_head_k = f.block_budget[l];
      if (!f.block_near.empty()) fl.block_head_near = f.block_near[l];
      if (!f.block_group.empty()) fl.block_head_group = f.block_group[l];
      plan.layers[l] = std::make_shared<AsymmetricFocusAttention>(fl, &f.routers[r], f.routers_per_layer,
                                                                  grads ? &(*grads)[r] : nullptr, r, hook);
    }
    else
      plan.layers[l] =
          std::make_shared<FocusAttention>(fs, &f.routers[r], r, grads ? &(*grads)[r] : nullptr, hook, detach_input);
  }
  return plan;
}

}  // namespace

const float* router_input(const AttentionCall& a, const FocusSettings& fs, int64_t r, int64_t route_heads,
                          RouterSide side, std::vector<float>& buf) {
  if (!fs.route_on_qk) return a.xn;
  const ModelConfig& c = *a.cfg;
  const int64_t Dh = c.head_dim, T = a.T;
  const bool key = side == RouterSide::Key;
  // The heads averaged: router r's share of the kv heads (or its one kv head, when there are more
  // routers than kv heads) or of the query heads.
  const int64_t n = key ? c.kv_heads : c.heads;
  const int64_t h0 = r * n / route_heads, h1 = std::max(h0 + 1, (r + 1) * n / route_heads), per = h1 - h0;
  const int64_t stride = key ? c.kv_dim() : c.q_dim();
  const float* base = key ? (a.k_new ? a.k_new : a.k + a.pos0 * stride) : a.q;
  buf.assign(T * Dh, 0.f);
  const float inv = 1.f / (float)per;
  for (int64_t t = 0; t < T; ++t) {
    float* o = buf.data() + t * Dh;
    for (int64_t h = h0; h < h1; ++h) {
      const float* v = base + t * stride + h * Dh;
      for (int64_t d = 0; d < Dh; ++d) o[d] += v[d];
    }
    for (int64_t d = 0; d < Dh; ++d) o[d] *= inv;
  }
  return buf.data();
}

AttentionPlan focus_plan(const ModelConfig& c, const FocusRouters& f) {
  return make_plan(c, f, f.settings.mode, nullptr, nullptr, false);
}

AttentionPlan focus_train_plan(const ModelConfig& c, const FocusRouters& f, std::vector<std::vector<float>>* grads,
                               RouterAuxHook hook, bool detach_input) {
  return make_plan(c, f, FocusMode::Soft, grads, hook, detach_input);
}

}  // namespace focus
