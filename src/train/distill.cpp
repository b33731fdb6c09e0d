#include "train/distill.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "focus/balancing.h"
#include "focus/block_topk.h"
#include "focus/focus_attention.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/attention_mass.h"

namespace focus {

std::vector<float> DistillStats::far_mass() const {
  std::vector<float> out(far_sum.size(), 0.f);
  for (size_t r = 0; r < far_sum.size(); ++r)
    if (far_rows[r] > 0) out[r] = (float)(far_sum[r] / (double)far_rows[r]);
  return out;
}

namespace {

// Rows whose far mass is below this carry no target (the first w + S rows have none at all).
constexpr float kMinFar = 1e-6f;

// The pairs block top-k with budget b reads on layer a.layer, as MassExclusion bits over all the
// call's heads: by_row [H, T, words], by_key its transpose.
void block_read_bits(const AttentionCall& a, const BlockBudget& b, std::vector<uint64_t>& by_row,
                     std::vector<uint64_t>& by_key) {
  const ModelConfig& c = *a.cfg;
  const int64_t T = a.T, H = c.heads, words = (T + 63) / 64;
  BlockTopKSettings bs;
  bs.block = b.block;
  bs.window = b.window;
  bs.sinks = b.sinks;
  bs.set_head_k(b.k[a.layer], b.near.empty() ? std::vector<int64_t>{} : b.near[a.layer]);
  std::vector<int32_t> qg;
  const int kq = block_topk_select_window(a, bs, qg);
  by_row.assign(H * T * words, 0);
  by_key.assign(H * T * words, 0);
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t h = 0; h < H; ++h)
    for (int64_t t = 0; t < T; ++t)
      for (int q = 0; q < kq; ++q) {
        const int32_t blk = qg[(t * H + h) * kq + q];
        if (blk < 0) continue;
        for (int64_t j = blk * bs.block; j < std::min(T, (blk + 1) * bs.block); ++j) {
          by_row[(h * T + t) * words + j / 64] |= uint64_t{1} << (j % 64);
          by_key[(h * T + j) * words + t / 64] |= uint64_t{1} << (t % 64);
        }
      }
}

// Dense, exact attention on a router layer, and the router's distillation from it.
class DistillAttention final : public AttentionPolicy {
 public:
  // Routers router0 .. router0 + route_heads - 1 of f (grads may be null).
  DistillAttention(const FocusSettings& fs, const RouterParams* rp, int64_t route_heads,
                   std::vector<std::vector<float>>* grads, int64_t router0, float loss_scale, const DistillOptions& o,
                   DistillStats* stats)
      : fs_(fs), rp_(rp), rh_(route_heads), grads_(grads), router0_(router0), loss_scale_(loss_scale), o_(o),
        stats_(stats) {}
  std::string name() const override { return "focus-distill"; }

  void attend(const AttentionCall& a, std::unique_ptr<AttentionState>& /*state*/,
              AttentionStats* /*stats*/) const override {
    FOCUS_CHECK(a.pos0 == 0, "distillation runs on whole windows (position 0 on)");
    const int64_t T = a.T, H = a.cfg->heads, HKV = a.cfg->kv_heads, Dh = a.cfg->head_dim;
    cpu::AttnShape s = layer_attn_shape(*a.cfg, a.layer, 0, T);
    std::vector<float> lse(H * T);
    cpu::flash_attention(a.q, a.k, a.v, a.out, lse.data(), s);
    // Router r sees the heads it routes: query heads r H/RH .. and kv heads r HKV/RH .. (with more
    // routers than kv heads, one kv head: that of its query heads).
    s.local_window = fs_.local_window;
    s.sinks = fs_.sinks;
    s.heads = H / rh_;
    s.kv_heads = std::max<int64_t>(1, HKV / rh_);
    std::vector<uint64_t> by_row, by_key;
    if (o_.residual) block_read_bits(a, *o_.residual, by_row, by_key);
    const int64_t words = (T + 63) / 64;
    for (int64_t r = 0; r < rh_; ++r) {
      cpu::MassExclusion ex;
      if (o_.residual) ex = {by_row.data() + r * s.heads * T * words, by_key.data() + r * s.heads * T * words, words};
      distill_heads(a, s, a.q + r * s.heads * Dh, a.k + (r * HKV / rh_) * Dh, lse.data() + r * s.heads * T, r,
                    o_.residual ? &ex : nullptr);
    }
  }

 private:
  void distill_heads(const AttentionCall& a, const cpu::AttnShape& s, const float* q, const float* k,
                     const float* lse, int64_t r, const cpu::MassExclusion* ex) const {
    const int64_t T = a.T, G = fs_.groups;
    const RouterParams& rp = rp_[r];
    RouterCache keys, queries;
    std::vector<float> kin_buf, qin_buf;
    const float* kin = router_input(a, fs_, r, rh_, RouterSide::Key, kin_buf);
    const float* qin = router_input(a, fs_, r, rh_, RouterSide::Query, qin_buf);
    router_forward(rp, kin, T, keys, RouterSide::Key);
    router_forward(rp, qin, T, queries, RouterSide::Query);
    std::vector<float> M(T * G), far(T);
    cpu::attention_mass_forward(q, k, lse, keys.p.data(), G, s, cpu::MassHeads::Mean, M.data(), far.data(), ex);

    // Query cross-entropy and key purity, per row with far mass.
    std::vector<float> dsq(T * G, 0.f), dM(T * G, 0.f), dsk(T * G, 0.f);
    double ce = 0, purity = 0, far_sum = 0, captured = 0, far_total = 0;
    int64_t rows = 0;
    std::vector<int32_t> top(std::max(1, fs_.topk));
    for (int64_t i = 0; i < T; ++i) {
      far_sum += far[i];
      if (far[i] < kMinFar) continue;
      ++rows;
      const float* m = M.data() + i * G;
      const float* p = queries.p.data() + i * G;
      float* dq = dsq.data() + i * G;
      float* dm = dM.data() + i * G;
      for (int64_t g = 0; g < G; ++g) {
        ce -= (double)m[g] * std::log(std::max(p[g], 1e-30f));
        dq[g] = loss_scale_ * (far[i] * p[g] - m[g]);
        purity += (double)m[g] * m[g] / far[i];
        dm[g] = -o_.key_weight * loss_scale_ * 2.f * m[g] / far[i];
      }
      router_topk(queries.s.data() + i * G, rp.bias.data(), 1, G, fs_.topk, top.data());
      for (int t = 0; t < fs_.topk; ++t) captured += m[top[t]];
      far_total += far[i];
    }
    std::vector<float> dP(T * G, 0.f);
    cpu::attention_mass_backward(q, k, lse, dM.data(), G, s, cpu::MassHeads::Mean, dP.data(), ex);
    // Balanced key groups: SwAV targets from Sinkhorn over the window's key scores.
    std::vector<float> qt(T * G);
    sinkhorn_forward(keys.s.data(), T, G, 1.0f, 3, qt.data());
    const float swav = swav_loss_forward(keys.s.data(), rp.bias.data(), qt.data(), T, G);
    swav_loss_backward(keys.s.data(), rp.bias.data(), qt.data(), T, G, o_.balance_weight * loss_scale_ * (float)T,
                       dsk.data());
    if (grads_) {
      float* g = (*grads_)[router0_ + r].data();
      router_backward(rp, kin, keys, dP.data(), dsk.data(), g, nullptr, RouterSide::Key);
      router_backward(rp, qin, queries, nullptr, dsq.data(), g, nullptr, RouterSide::Query);
    }
    if (stats_) {
      stats_->query_ce += ce;
      stats_->key_purity += purity;
      stats_->swav += swav;
      stats_->rows += rows;
      stats_->far_sum[router0_ + r] += far_sum;
      stats_->far_rows[router0_ + r] += T;
      stats_->captured += captured;
      stats_->far_total += far_total;
    }
  }

  FocusSettings fs_;
  const RouterParams* rp_;
  int64_t rh_;
  std::vector<std::vector<float>>* grads_;
  int64_t router0_;
  float loss_scale_;
  DistillOptions o_;
  DistillStats* stats_;
};

}  // namespace

LossGrad distill_loss_and_grad(const Model& m, const FocusRouters& f, const TrainWindow& w, float loss_scale,
                               const DistillOptions& o, std::vector<std::vector<float>>* grads, DistillStats* stats) {
  const ModelConfig& c = m.cfg;
  FOCUS_CHECK(f.settings.asymmetric, "distillation trains asymmetric routers (keys by W_k, queries by W_r)");
  FOCUS_CHECK(w.T >= 1, "distillation: empty window");
  if (o.residual)
    check_block_budget(*o.residual, f.settings.local_window, f.settings.sinks, c, "residual distillation");
  DistillStats local;
  DistillStats& st = stats ? *stats : local;
  st.far_sum.resize(f.routers.size(), 0.0);
  st.far_rows.resize(f.routers.size(), 0);
  const double ce0 = st.query_ce;
  const int64_t rows0 = st.rows;
  AttentionPlan plan;
  plan.layers.resize(c.layers);
  for (int64_t l = 0; l < c.layers; ++l) {
    const int64_t r = f.router_of_layer[l];
    if (r < 0 || c.layer_sliding_window[l] > 0) continue;
    plan.layers[l] = std::make_shared<DistillAttention>(f.settings, &f.routers[r], f.routers_per_layer, grads, r,
                                                        loss_scale, o, &st);
  }
  KVCache cache;
  cache.init(c, w.T);
  std::vector<float> hidden(w.T * c.dim);
  forward(m, w.ids, w.T, cache, hidden.data(), &plan, nullptr);
  LossGrad lg;
  lg.loss_sum = st.query_ce - ce0;
  lg.scored = st.rows - rows0;
  return lg;
}

}  // namespace focus
