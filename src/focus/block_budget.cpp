#include "focus/block_budget.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <queue>
#include <tuple>

#include "core/error.h"
#include "core/mapped_file.h"
#include "eval/perplexity.h"
#include "focus/block_topk.h"
#include "io/safetensors.h"
#include "kernels/cpu/decode_slices.h"
#include "io/safetensors_writer.h"
#include "model/attention.h"

namespace focus {
namespace {

// A layer's dense attention that also measures the block curves of its rows.
class BlockMassProbe final : public AttentionPolicy {
 public:
  explicit BlockMassProbe(BlockMassCurves* c) : c_(c) {}
  std::string name() const override { return "blockmass"; }

  void attend(const AttentionCall& a, std::unique_ptr<AttentionState>& state, AttentionStats* stats) const override {
    dense_attention().attend(a, state, stats);
    FOCUS_CHECK(a.k && a.q, "block budget: the calibration needs float keys (run it with a float32 KV cache)");
    measure_block_mass_call(a, *c_);
  }

 private:
  BlockMassCurves* c_;
};

}  // namespace

void measure_block_mass_call(const AttentionCall& a, BlockMassCurves& cv, const GroupReads* groups) {
  const ModelConfig& c = *a.cfg;
  const int64_t n = a.pos0 + a.T, H = c.heads, kvh_n = c.kv_heads, hpk = H / kvh_n, hd = c.head_dim;
  const int64_t kvd = c.kv_dim(), B = cv.block, w = cv.window, S = cv.sinks, KM = cv.k_max, NM = cv.near_max;
  const int64_t per_head = (NM + 1) * (KM + 1);
  const bool output = cv.metric == BlockMetric::Output;
  FOCUS_CHECK(!output || a.v, "block budget: the output metric needs the values (float v)");
  const float scale = layer_attn_shape(c, a.layer, a.pos0, a.T).scale;
  // Bounds of the complete blocks, made as the block top-k policy makes them.
  BlockTopKState st(B, kvh_n, hd);
  st.append(cpu::KvView(a.k), kvd, n);
  const int64_t lo = S / B;
  std::vector<double> miss(H * per_head, 0.0), plain(groups ? H * per_head : 0, 0.0), far(H, 0.0), gkeys(H, 0.0);
  int64_t rows = 0;
#pragma omp parallel
  {
    std::vector<double> miss_t(H * per_head, 0.0), plain_t(plain.size(), 0.0), far_t(H, 0.0), gkeys_t(H, 0.0);
    std::vector<float> e(n);
    std::vector<double> bm;
    std::vector<float> bound;
    std::vector<std::pair<float, int32_t>> cand;
    // Metric Output: the head's dense output o, each complete far block's share of it (bv, keys from
    // the sinks on) and the residual r = m o - u of the keys a selection leaves unread.
    std::vector<float> o(output ? hd : 0), r0(o.size()), r(o.size());
    std::vector<float> bv;
    int64_t rows_t = 0;
#pragma omp for schedule(dynamic, 8)
    for (int64_t t = 0; t < a.T; ++t) {
      const int64_t p = a.pos0 + t, f = p - w;
      if (f < S) continue;
      ++rows_t;
      const int64_t cur = f / B, nb = cur - lo;
      for (int64_t h = 0; h < H; ++h) {
        const float* q = a.q + t * c.q_dim() + h * hd;
        const float* k0 = a.k + (h / hpk) * hd;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j <= p; ++j) {
          e[j] = cpu::decode_detail::dot(q, k0 + j * kvd, hd) * scale;  // the decoding kernel's dot product
          mx = std::max(mx, e[j]);
        }
        double z = 0;
        for (int64_t j = 0; j <= p; ++j) {
          e[j] = std::exp(e[j] - mx);
          z += e[j];
        }
        auto mass = [&](int64_t j0, int64_t j1) {  // probability of keys j0 .. j1-1
          double m = 0;
          for (int64_t j = std::max(j0, S); j < j1; ++j) m += e[j];
          return m / z;
        };
        const float* v0 = output ? a.v + (h / hpk) * hd : nullptr;
        auto add_value = [&](float* acc, int64_t j, float wgt) {  // acc += wgt * v_j
          const float* vj = v0 + j * kvd;
          for (int64_t i = 0; i < hd; ++i) acc[i] += wgt * vj[i];
        };
        if (output) {
          std::fill(o.begin(), o.end(), 0.f);
          bv.assign(nb * hd, 0.f);
          for (int64_t j = 0; j <= p; ++j) {
            const int64_t b = j / B;
            add_value(j >= S && b >= lo && b < cur ? bv.data() + (b - lo) * hd : o.data(), j, (float)(e[j] / z));
          }
          for (int64_t b = 0; b < nb; ++b)
            for (int64_t i = 0; i < hd; ++i) o[i] += bv[b * hd + i];
        }
        // The ranking depends on q and the keys only: one order for both curves.
        cand.resize(nb);
        bound.resize(nb);
        block_bounds(q, st, h / hpk, lo, cur, bound.data());
        for (float& x : bound)
          if (std::isnan(x)) x = -std::numeric_limits<float>::infinity();  // ranked last, as the selection does
        for (int64_t b = lo; b < cur; ++b) cand[b - lo] = {bound[b - lo], (int32_t)b};
        // The order block top-k chooses in: of the first KM + NM, at most NM are near ones.
        const int64_t kk = std::min(KM + NM, nb);
        std::partial_sort(cand.begin(), cand.begin() + kk, cand.end(), block_ranks_before);
        // Adds to out (per_head entries) what the selections leave unread of e (and bv) as they
        // stand, mass or output error; returns the far mass.
        auto curves = [&](double* out) {
          const double F = mass(S, f + 1);
          const double mcur = mass(cur * B, f + 1);
          bm.assign(nb, 0.0);
          for (int64_t b = lo; b < cur; ++b) bm[b - lo] = mass(b * B, (b + 1) * B);
          // Output: r = m o - u with m, u of the unread complete blocks; reading block b takes its
          // share out of both. The error is ||r|| / (1 - m).
          double left0 = std::max(0.0, F - mcur);
          if (output) {
            std::fill(r0.begin(), r0.end(), 0.f);
            for (int64_t b = 0; b < nb; ++b)
              for (int64_t i = 0; i < hd; ++i) r0[i] -= bv[b * hd + i];
            for (int64_t i = 0; i < hd; ++i) r0[i] += (float)left0 * o[i];
          }
          auto read = [&](std::vector<float>& res, double& left, int64_t b) {  // block b (index from lo) read
            left = std::max(0.0, left - bm[b]);
            if (output) {
              const float* vb = bv.data() + b * hd;
              const float mb = (float)bm[b];
              for (int64_t i = 0; i < hd; ++i) res[i] += vb[i] - mb * o[i];
            }
          };
          auto cost = [&](const std::vector<float>& res, double left) {
            if (!output) return left;
            const double s2 = cpu::decode_detail::dot(res.data(), res.data(), hd);
            return std::sqrt(std::max(0.0, s2)) / std::max(1e-9, 1.0 - left);
          };
          for (int64_t nn = 0; nn <= NM; ++nn) {
            const int64_t first_near = std::max(lo, cur - nn);  // near blocks: first_near .. cur-1
            if (nn > 0 && cur - nn >= lo) read(r0, left0, cur - nn - lo);
            double left = left0;
            if (output) r = r0;
            double* mrow = out + nn * (KM + 1);
            mrow[0] += cost(r, left);
            for (int64_t i = 0, x = 0; i < KM; ++i) {
              while (x < kk && cand[x].second >= first_near) ++x;  // read as near blocks already
              if (x >= kk) break;  // every candidate read: nothing far is left unread
              read(r, left, cand[x++].second - lo);
              mrow[i + 1] += cost(r, left);
            }
          }
          return F;
        };
        if (groups) {  // keys the groups read count as neither far nor block mass
          curves(plain_t.data() + h * per_head);  // first as if they were not read
          const int32_t* qg = groups->query_groups + (t * H + h) * groups->k;
          const int32_t* kg = (*groups->key_group)[h / groups->heads_per_router].data();
          int64_t read = 0;
          for (int64_t j = S; j <= f; ++j)
            if (std::find(qg, qg + groups->k, kg[j]) != qg + groups->k) {
              if (output && j / B < cur) add_value(bv.data() + (j / B - lo) * hd, j, (float)(-e[j] / z));
              e[j] = 0.f;
              ++read;
            }
          gkeys_t[h] += (double)read;
        }
        far_t[h] += curves(miss_t.data() + h * per_head);
      }
    }
#pragma omp critical
    {
      for (size_t i = 0; i < miss.size(); ++i) miss[i] += miss_t[i];
      for (size_t i = 0; i < plain.size(); ++i) plain[i] += plain_t[i];
      for (int64_t h = 0; h < H; ++h) {
        far[h] += far_t[h];
        gkeys[h] += gkeys_t[h];
      }
      rows += rows_t;
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t x = 0; x < per_head; ++x) cv.missed[(a.layer * H + h) * per_head + x] += miss[h * per_head + x];
    cv.far[a.layer * H + h] += far[h];
  }
  if (groups) {
    if (cv.group_keys.empty()) cv.group_keys.assign(cv.layers * H, 0.0);
    if (cv.missed_plain.empty()) cv.missed_plain.assign(cv.missed.size(), 0.0);
    for (int64_t h = 0; h < H; ++h) {
      cv.group_keys[a.layer * H + h] += gkeys[h];
      for (int64_t x = 0; x < per_head; ++x)
        cv.missed_plain[(a.layer * H + h) * per_head + x] += plain[h * per_head + x];
    }
  }
  cv.rows[a.layer] += rows;
}

const char* block_metric_name(BlockMetric m) { return m == BlockMetric::Output ? "output" : "mass"; }

BlockMetric parse_block_metric(const std::string& name, const std::string& source) {
  if (name == "mass") return BlockMetric::Mass;
  if (name == "output") return BlockMetric::Output;
  fail(source, ": unknown block metric '", name, "' (mass: the attention probability left unread; output: the "
       "output error it leaves)");
}

BlockMassCurves block_mass_curves(const ModelConfig& c, int64_t block, int64_t window, int64_t sinks, int64_t k_max,
                                  int64_t near_max) {
  FOCUS_CHECK(block >= 1 && window >= 1 && sinks >= 0 && k_max >= 1, "block budget: block (", block, ") window (",
              window, ") and k_max (", k_max, ") must be at least 1, sinks (", sinks, ") at least 0");
  FOCUS_CHECK(near_max >= 0 && near_max <= 4096, "block budget: near blocks (", near_max, ") must be in [0, 4096]");
  BlockMassCurves cv;
  cv.block = block;
  cv.window = window;
  cv.sinks = sinks;
  cv.k_max = k_max;
  cv.near_max = near_max;
  cv.layers = c.layers;
  cv.heads = c.heads;
  cv.missed.assign(c.layers * c.heads * (near_max + 1) * (k_max + 1), 0.0);
  cv.far.assign(c.layers * c.heads, 0.0);
  cv.rows.assign(c.layers, 0);
  return cv;
}

void run_block_calibration(const Model& m, const std::vector<int32_t>& ids, int64_t ctx, const AttentionPlan& plan,
                           const BlockMassCurves& cv, bool progress) {
  FOCUS_CHECK(ctx > cv.window + cv.sinks, "block budget: ctx ", ctx, " leaves no key beyond the window ", cv.window,
              " and the sinks ", cv.sinks);
  PplOptions o;
  o.ctx = ctx;
  o.progress = progress;
  o.attention = &plan;
  o.kv_type = cpu::KvType::F32;
  perplexity(m, ids, o);
}

BlockMassCurves measure_block_mass(const Model& m, const std::vector<int32_t>& ids, int64_t ctx, int64_t block,
                                   int64_t window, int64_t sinks, int64_t k_max, bool progress,
                                   int64_t near_max, BlockMetric metric) {
  const ModelConfig& c = m.cfg;
  BlockMassCurves cv = block_mass_curves(c, block, window, sinks, k_max, near_max);
  cv.metric = metric;
  AttentionPlan plan;
  plan.layers.resize(c.layers);
  for (int64_t l = 0; l < c.layers; ++l)
    if (c.layer_sliding_window[l] == 0) plan.layers[l] = std::make_shared<BlockMassProbe>(&cv);
  run_block_calibration(m, ids, ctx, plan, cv, progress);
  return cv;
}

namespace {

// Each head's least missed mass with c = 0 .. top blocks under the curves miss(l, h, n, k), split
// at best between n near and k ranked ones (ties to fewer near blocks): best[(l * H + h) * (top + 1)
// + c], and its near part in split. Heads of layers not measured (k[l] empty) stay 0.
struct BestSplits {
  std::vector<double> best;
  std::vector<int64_t> split;
};
template <class Miss>
BestSplits best_splits(const BlockMassCurves& cv, int64_t top, const std::vector<std::vector<int64_t>>& k, Miss miss) {
  const int64_t NM = cv.near_max, KM = cv.k_max, L = cv.layers, H = cv.heads;
  BestSplits b{std::vector<double>(L * H * (top + 1), 0.0), std::vector<int64_t>(L * H * (top + 1), 0)};
  for (int64_t l = 0; l < L; ++l) {
    if (k[l].empty()) continue;
    for (int64_t h = 0; h < H; ++h)
      for (int64_t c = 0; c <= top; ++c) {
        double m = std::numeric_limits<double>::infinity();
        int64_t bn = 0;
        for (int64_t n = std::max<int64_t>(0, c - KM); n <= std::min(NM, c); ++n) {
          const double x = miss(l, h, n, c - n);
          if (x < m) {
            m = x;
            bn = n;
          }
        }
        b.best[(l * H + h) * (top + 1) + c] = m;
        b.split[(l * H + h) * (top + 1) + c] = bn;
      }
  }
  return b;
}

// Gives `left` more blocks to the heads (given[l * H + h] each, of the measured layers), in steps
// of best mean gain per block on each head's curve best_of[l * H + h] (top + 1 entries): the most
// missed mass saved per block, ties to the shorter step, then to the lower layer and head.
void fill_greedy(const std::vector<const double*>& best_of, const std::vector<std::vector<int64_t>>& k, int64_t H,
                 int64_t top, std::vector<int64_t>& given, int64_t left) {
  auto step = [&](int64_t l, int64_t h, int64_t room) {
    const double* b = best_of[l * H + h];
    const int64_t c = given[l * H + h];
    double gain = -1;
    int64_t len = 0;
    for (int64_t s = 1; s <= std::min(room, top - c); ++s) {
      const double g = (b[c] - b[c + s]) / (double)s;
      if (g > gain) {
        gain = g;
        len = s;
      }
    }
    return std::make_pair(gain, len);
  };
  using Item = std::tuple<double, int64_t, int64_t, int64_t>;  // gain per block, -layer, -head, step
  std::priority_queue<Item> pq;
  auto push = [&](int64_t l, int64_t h, int64_t room) {
    const auto [g, s] = step(l, h, room);
    if (s > 0) pq.emplace(g, -l, -h, s);
  };
  for (int64_t l = 0; l < (int64_t)k.size(); ++l)
    for (int64_t h = 0; h < (int64_t)k[l].size(); ++h) push(l, h, left);
  while (left > 0 && !pq.empty()) {
    const auto [g, nl, nh, s] = pq.top();
    pq.pop();
    const int64_t l = -nl, h = -nh;
    if (s > left) {  // the step no longer fits: the head's best within what is left
      push(l, h, left);
      continue;
    }
    given[l * H + h] += s;
    left -= s;
    push(l, h, left);
  }
}

// The blocks of each head (given[l * H + h]) as ranked and near counts by its split.
void write_splits(const std::vector<int64_t>& given, const std::vector<const int64_t*>& split_of, int64_t H,
                  std::vector<std::vector<int64_t>>& k, std::vector<std::vector<int64_t>>* near_out) {
  if (near_out) near_out->assign(k.size(), {});
  for (size_t l = 0; l < k.size(); ++l) {
    if (k[l].empty()) continue;
    if (near_out) (*near_out)[l].assign(H, 0);
    for (int64_t h = 0; h < H; ++h) {
      const int64_t c = given[l * H + h], n = split_of[l * H + h][c];
      k[l][h] = c - n;
      if (near_out) (*near_out)[l][h] = n;
    }
  }
}

// The curves miss(l, h, n, k) with the mass of the n near blocks weighted w times (what n near
// blocks alone read is miss(0, 0) - miss(n, 0); w = 1: miss itself).
template <class Miss>
auto near_weighted(Miss miss, double w) {
  return [miss, w](int64_t l, int64_t h, int64_t n, int64_t k) {
    const double m = miss(l, h, n, k);
    return w == 1.0 || n == 0 ? m : m - (w - 1.0) * (miss(l, h, 0, 0) - miss(l, h, n, 0));
  };
}

// allocate_block_budget with near blocks: each head's best split of c blocks between near and
// ranked ones, and the blocks given by steps of best mean gain per block.
std::vector<std::vector<int64_t>> allocate_with_near(const BlockMassCurves& cv, int64_t total, int64_t top,
                                                     std::vector<std::vector<int64_t>>& k,
                                                     std::vector<std::vector<int64_t>>* near_out, double near_weight) {
  const int64_t L = cv.layers, H = cv.heads;
  const BestSplits bs = best_splits(
      cv, top, k,
      near_weighted([&](int64_t l, int64_t h, int64_t n, int64_t kk) { return cv.missed_at(l, h, n, kk); }, near_weight));
  std::vector<const double*> best_of(L * H);
  std::vector<const int64_t*> split_of(L * H);
  for (int64_t i = 0; i < L * H; ++i) {
    best_of[i] = bs.best.data() + i * (top + 1);
    split_of[i] = bs.split.data() + i * (top + 1);
  }
  std::vector<int64_t> given(L * H, 0);
  fill_greedy(best_of, k, H, top, given, total);
  write_splits(given, split_of, H, k, near_out);
  return k;
}

// allocate_block_budget with the group switch: total counts blocks and the kept groups' keys (in
// blocks). Three candidates, the one that leaves least mass unread (the groups' mass weighted;
// ties to the first): each head
// choosing group or not by a Lagrangian price per block and the blocks topped up greedily; every
// group kept; none kept.
std::vector<std::vector<int64_t>> allocate_with_switch(const BlockMassCurves& cv, int64_t total, int64_t top,
                                                       std::vector<std::vector<int64_t>>& k,
                                                       std::vector<std::vector<int64_t>>* near_out,
                                                       std::vector<std::vector<int64_t>>& group_out,
                                                       const BudgetWeights& w) {
  const int64_t L = cv.layers, H = cv.heads, T1 = top + 1;
  // Per row, so that layers of different row counts weigh alike.
  auto per = [&](int64_t l) { return 1.0 / (double)std::max<int64_t>(1, cv.rows[l]); };
  const BestSplits on = best_splits(cv, top, k, near_weighted([&](int64_t l, int64_t h, int64_t n, int64_t kk) {
    const double plain = cv.missed_plain_at(l, h, n, kk);
    return (plain - w.group * (plain - cv.missed_at(l, h, n, kk))) * per(l);
  }, w.near));
  const BestSplits off = best_splits(cv, top, k, near_weighted([&](int64_t l, int64_t h, int64_t n, int64_t kk) {
    return cv.missed_plain_at(l, h, n, kk) * per(l);
  }, w.near));
  std::vector<double> g(L * H, 0.0);  // a kept group's keys per row, in blocks
  std::vector<int64_t> heads;         // l * H + h of the measured heads
  for (int64_t l = 0; l < L; ++l)
    if (!k[l].empty())
      for (int64_t h = 0; h < H; ++h) {
        g[l * H + h] = cv.group_keys[l * H + h] * per(l) / (double)cv.block;
        heads.push_back(l * H + h);
      }
  struct Choice {
    std::vector<int64_t> given, keep;
    double missed = std::numeric_limits<double>::infinity(), cost = 0;
  };
  // Tops the choice up with the whole blocks its cost leaves of total, and scores it.
  auto finish = [&](Choice& ch) {
    std::vector<const double*> best_of(L * H);
    double cost = 0;
    for (int64_t i : heads) {
      best_of[i] = (ch.keep[i] ? on.best : off.best).data() + i * T1;
      cost += (double)ch.given[i] + (ch.keep[i] ? g[i] : 0.0);
    }
    const int64_t left = (int64_t)std::floor((double)total - cost + 1e-9);
    if (left < 0) return;  // does not fit
    fill_greedy(best_of, k, H, top, ch.given, left);
    ch.missed = 0;
    ch.cost = 0;
    for (int64_t i : heads) {
      ch.missed += best_of[i][ch.given[i]];
      ch.cost += (double)ch.given[i] + (ch.keep[i] ? g[i] : 0.0);
    }
  };
  // At price lambda per block, each head's cheapest (missed + lambda * cost) of both curves; ties
  // to the lower cost.
  auto priced = [&](double lambda) {
    Choice ch{std::vector<int64_t>(L * H, 0), std::vector<int64_t>(L * H, 0)};
    for (int64_t i : heads) {
      double bv = std::numeric_limits<double>::infinity(), bc = 0;
      for (int keep = 0; keep <= 1; ++keep) {
        const double* b = (keep ? on.best : off.best).data() + i * T1;
        for (int64_t c = 0; c <= top; ++c) {
          const double cost = (double)c + (keep ? g[i] : 0.0), v = b[c] + lambda * cost;
          if (v < bv - 1e-15 || (v <= bv + 1e-15 && cost < bc)) {
            bv = v;
            bc = cost;
            ch.given[i] = c;
            ch.keep[i] = keep;
          }
        }
      }
      ch.cost += bc;
    }
    return ch;
  };
  // The least price whose choice fits (the cost falls as the price rises; a block saves at most a
  // row's far probability, 1, so at price 2 little but what is free is bought; when even that does
  // not fit, the candidate with no group wins).
  double lo = 0, hi = 2;
  if (priced(lo).cost > (double)total) {
    for (int it = 0; it < 100 && hi - lo > 1e-12; ++it) {
      const double mid = 0.5 * (lo + hi);
      (priced(mid).cost > (double)total ? lo : hi) = mid;
    }
  } else {
    hi = lo;
  }
  std::vector<Choice> cand;
  cand.push_back(priced(hi));
  cand.push_back({std::vector<int64_t>(L * H, 0), std::vector<int64_t>(L * H, 1)});
  cand.push_back({std::vector<int64_t>(L * H, 0), std::vector<int64_t>(L * H, 0)});
  const Choice* pick = nullptr;
  for (Choice& ch : cand) {
    finish(ch);
    if (!pick || ch.missed < pick->missed - 1e-12) pick = &ch;
  }
  std::vector<const int64_t*> split_of(L * H);
  for (int64_t i = 0; i < L * H; ++i) split_of[i] = (pick->keep[i] ? on.split : off.split).data() + i * T1;
  write_splits(pick->given, split_of, H, k, near_out);
  group_out.assign(L, {});
  for (int64_t l = 0; l < L; ++l)
    if (!k[l].empty()) {
      group_out[l].assign(H, 0);
      for (int64_t h = 0; h < H; ++h) group_out[l][h] = pick->keep[l * H + h];
    }
  return k;
}

}  // namespace

std::vector<std::vector<int64_t>> allocate_block_budget(const BlockMassCurves& cv, double mean_k, int64_t cap,
                                                        std::vector<std::vector<int64_t>>* near,
                                                        std::vector<std::vector<int64_t>>* group, const BudgetWeights& w) {
  FOCUS_CHECK(std::isfinite(mean_k) && mean_k >= 0 && mean_k <= (1 << 20),
              "block budget: the mean k must be in [0, 2^20], got ", mean_k);
  const int64_t most = cv.k_max + cv.near_max;
  const int64_t top = cap >= 0 ? std::min(cap, most) : most;
  if (near) near->clear();
  if (group) group->clear();
  FOCUS_CHECK(std::isfinite(w.group) && w.group > 0 && w.group <= 1e6,
              "block budget: the groups' weight must be in (0, 1e6], got ", w.group);
  FOCUS_CHECK(std::isfinite(w.near) && w.near > 0 && w.near <= 1e6,
              "block budget: the near blocks' weight must be in (0, 1e6], got ", w.near);
  FOCUS_CHECK(!group || (!cv.missed_plain.empty() && !cv.group_keys.empty()),
              "block budget: the group switch needs curves measured around a hybrid's groups (focus budget --focus)");
  std::vector<std::vector<int64_t>> k(cv.layers);
  int64_t measured = 0;
  for (int64_t l = 0; l < cv.layers; ++l)
    if (cv.rows[l] > 0) {
      k[l].assign(cv.heads, 0);
      measured += cv.heads;
    }
  FOCUS_CHECK(measured > 0, "block budget: no layer had a row with keys beyond the window (text too short?)");
  const int64_t total =
      (int64_t)std::min(std::floor(mean_k * (double)measured + 1e-9), (double)measured * (double)top);
  if (group) {
    std::vector<std::vector<int64_t>> n;
    allocate_with_switch(cv, total, top, k, &n, *group, w);
    if (near && cv.near_max > 0) *near = std::move(n);
    return k;
  }
  if (cv.near_max > 0) return allocate_with_near(cv, total, top, k, near, w.near);
  // Greedy: each block to the head whose missed mass falls most by it (ties to the lower layer, head).
  using Item = std::tuple<double, int64_t, int64_t>;  // gain, -layer, -head
  std::priority_queue<Item> pq;
  auto push = [&](int64_t l, int64_t h) {
    const int64_t kk = k[l][h];
    if (kk >= top) return;
    pq.emplace(cv.missed_at(l, h, kk) - cv.missed_at(l, h, kk + 1), -l, -h);
  };
  for (int64_t l = 0; l < cv.layers; ++l)
    for (int64_t h = 0; h < (int64_t)k[l].size(); ++h) push(l, h);
  for (int64_t i = 0; i < total && !pq.empty(); ++i) {
    const auto [gain, nl, nh] = pq.top();
    pq.pop();
    k[-nl][-nh]++;
    push(-nl, -nh);
  }
  return k;
}

BudgetCost budget_cost(const BlockMassCurves& cv, const std::vector<std::vector<int64_t>>& k,
                       const std::vector<std::vector<int64_t>>& near, const std::vector<std::vector<int64_t>>& group) {
  FOCUS_CHECK((int64_t)k.size() == cv.layers, "block budget: budgets for ", k.size(), " layers, the curves have ",
              cv.layers);
  BudgetCost out;
  for (int64_t l = 0; l < cv.layers; ++l) {
    if (k[l].empty() || cv.rows[l] == 0) continue;
    const double per = 1.0 / (double)cv.rows[l];
    for (int64_t h = 0; h < cv.heads; ++h) {
      const int64_t n = near.empty() ? 0 : near[l][h];
      const bool keep = group.empty() || group[l][h] != 0;
      FOCUS_CHECK(keep || !cv.missed_plain.empty(), "block budget: heads without their group need curves measured around groups");
      out.missed += cv.missed_for(l, h, n, k[l][h], keep) * per;
      out.blocks += (double)(n + k[l][h]);
      if (keep && !cv.group_keys.empty()) out.blocks += cv.group_keys[l * cv.heads + h] * per / (double)cv.block;
    }
  }
  return out;
}

void save_block_curves(const std::string& path, const BlockMassCurves& cv, int64_t ctx) {
  const int64_t L = cv.layers, H = cv.heads, K1 = cv.k_max + 1, N1 = cv.near_max + 1;
  // Stored per row (means), so that float32 keeps them exact enough at any number of rows.
  const bool grouped = !cv.group_keys.empty();
  const bool plain = !cv.missed_plain.empty();
  std::vector<float> missed(L * H * N1 * K1), far(L * H), rows(L), gkeys(grouped ? L * H : 0),
      mplain(plain ? missed.size() : 0);
  for (int64_t l = 0; l < L; ++l) {
    const double per = cv.rows[l] > 0 ? 1.0 / (double)cv.rows[l] : 0.0;
    rows[l] = (float)cv.rows[l];
    for (int64_t h = 0; h < H; ++h) {
      far[l * H + h] = (float)(cv.far[l * H + h] * per);
      if (grouped) gkeys[l * H + h] = (float)(cv.group_keys[l * H + h] * per);
      for (int64_t n = 0; n < N1; ++n)
        for (int64_t k = 0; k < K1; ++k) {
          missed[((l * H + h) * N1 + n) * K1 + k] = (float)(cv.missed_at(l, h, n, k) * per);
          if (plain) mplain[((l * H + h) * N1 + n) * K1 + k] = (float)(cv.missed_plain_at(l, h, n, k) * per);
        }
    }
  }
  // [layers, heads, k_max + 1] without near blocks (as before they existed), else
  // [layers, heads, near_max + 1, k_max + 1].
  const std::vector<int64_t> mshape = N1 == 1 ? std::vector<int64_t>{L, H, K1} : std::vector<int64_t>{L, H, N1, K1};
  std::map<std::string, io::F32Tensor> t = {
      {"missed", {mshape, missed}}, {"far", {{L, H}, far}}, {"rows", {{L}, rows}}};
  if (grouped) t["group_keys"] = {{L, H}, gkeys};
  if (plain) t["missed_plain"] = {mshape, mplain};
  io::save_safetensors(path, t,
                       {{"format", "focus-block-curves"},
                        {"block", std::to_string(cv.block)},
                        {"window", std::to_string(cv.window)},
                        {"sinks", std::to_string(cv.sinks)},
                        {"metric", block_metric_name(cv.metric)},
                        {"ctx", std::to_string(ctx)}});
}

BlockMassCurves load_block_curves(const std::string& path, int64_t* ctx) {
  io::SafetensorsFile f(path);
  const nlohmann::json& md = f.metadata();
  FOCUS_CHECK(md.value("format", std::string()) == "focus-block-curves", path,
              ": not a block curves file (made by `focus budget --curves`)");
  auto num = [&](const char* key, int64_t min) {
    const std::string v = md.value(key, std::string());
    int64_t x = -1;
    try {
      size_t used = 0;
      x = std::stoll(v, &used);
      FOCUS_CHECK(used == v.size(), path, ": metadata '", key, "' is not an integer: '", v, "'");
    } catch (const std::logic_error&) {
      fail(path, ": metadata '", key, "' is missing or not an integer: '", v, "'");
    }
    FOCUS_CHECK(x >= min && x < (int64_t{1} << 30), path, ": metadata '", key, "' out of range: ", x);
    return x;
  };
  BlockMassCurves cv;
  cv.block = num("block", 1);
  cv.window = num("window", 1);
  cv.sinks = num("sinks", 0);
  if (ctx) *ctx = num("ctx", 0);
  cv.metric = parse_block_metric(md.value("metric", std::string("mass")), path);  // files before it: mass
  const io::STTensor& m = f.tensor("missed");
  const size_t rank = m.shape.size();
  FOCUS_CHECK((rank == 3 || rank == 4) && m.shape[0] >= 1 && m.shape[1] >= 1 && m.shape.back() >= 2 &&
                  (rank == 3 || (m.shape[2] >= 2 && m.shape[2] <= 4097)),
              path, ": 'missed' must be [layers, heads, k_max + 1] or [layers, heads, near_max + 1, k_max + 1]");
  cv.layers = m.shape[0];
  cv.heads = m.shape[1];
  cv.near_max = rank == 4 ? m.shape[2] - 1 : 0;
  cv.k_max = m.shape.back() - 1;
  const io::STTensor& fr = f.tensor("far");
  const io::STTensor& rw = f.tensor("rows");
  FOCUS_CHECK(fr.shape == std::vector<int64_t>({cv.layers, cv.heads}), path, ": 'far' must be [layers, heads]");
  FOCUS_CHECK(rw.shape == std::vector<int64_t>({cv.layers}), path, ": 'rows' must be [layers]");
  const std::vector<float> mv = f.to_float(m), fv = f.to_float(fr), rv = f.to_float(rw);
  for (float x : mv) FOCUS_CHECK(std::isfinite(x) && x >= 0, path, ": 'missed' holds ", x);
  for (float x : fv) FOCUS_CHECK(std::isfinite(x) && x >= 0, path, ": 'far' holds ", x);
  cv.rows.resize(cv.layers);
  for (int64_t l = 0; l < cv.layers; ++l) {
    FOCUS_CHECK(std::isfinite(rv[l]) && rv[l] >= 0 && rv[l] < 1e15f, path, ": 'rows' holds ", rv[l]);
    cv.rows[l] = (int64_t)rv[l];
  }
  std::vector<float> gv;
  if (const io::STTensor* gt = f.find("group_keys")) {
    const io::STTensor& g = *gt;
    FOCUS_CHECK(g.shape == std::vector<int64_t>({cv.layers, cv.heads}), path, ": 'group_keys' must be [layers, heads]");
    gv = f.to_float(g);
    for (float x : gv) FOCUS_CHECK(std::isfinite(x) && x >= 0, path, ": 'group_keys' holds ", x);
    cv.group_keys.resize(gv.size());
  }
  std::vector<float> pv;
  if (const io::STTensor* pt = f.find("missed_plain")) {
    FOCUS_CHECK(pt->shape == m.shape, path, ": 'missed_plain' must have the shape of 'missed'");
    FOCUS_CHECK(!gv.empty(), path, ": 'missed_plain' without 'group_keys'");
    pv = f.to_float(*pt);
    for (float x : pv) FOCUS_CHECK(std::isfinite(x) && x >= 0, path, ": 'missed_plain' holds ", x);
    cv.missed_plain.resize(pv.size());
  }
  // Back to sums over rows, as measured.
  cv.missed.resize(mv.size());
  cv.far.resize(fv.size());
  const int64_t per_head = (cv.near_max + 1) * (cv.k_max + 1);
  for (int64_t l = 0; l < cv.layers; ++l)
    for (int64_t h = 0; h < cv.heads; ++h) {
      cv.far[l * cv.heads + h] = (double)fv[l * cv.heads + h] * (double)cv.rows[l];
      if (!gv.empty()) cv.group_keys[l * cv.heads + h] = (double)gv[l * cv.heads + h] * (double)cv.rows[l];
      for (int64_t x = 0; x < per_head; ++x) {
        const int64_t i = (l * cv.heads + h) * per_head + x;
        cv.missed[i] = (double)mv[i] * (double)cv.rows[l];
        if (!pv.empty()) cv.missed_plain[i] = (double)pv[i] * (double)cv.rows[l];
      }
    }
  return cv;
}

void save_block_budget(const std::string& path, const BlockBudget& b) {
  nlohmann::json k = nlohmann::json::array();
  for (const auto& kl : b.k) k.push_back(kl);
  nlohmann::json j = {{"format", "focus-block-budget"}, {"version", 1},     {"block", b.block},
                      {"window", b.window},             {"sinks", b.sinks}, {"ctx", b.ctx},
                      {"mean_k", b.mean_k},             {"k", k}};
  if (!b.near.empty()) j["near"] = b.near;
  if (!b.group.empty()) {
    j["group"] = b.group;
    j["group_weight"] = b.weights.group;
  }
  if (!b.near.empty() && b.weights.near != 1.0) j["near_weight"] = b.weights.near;
  if (b.metric != BlockMetric::Mass) j["metric"] = block_metric_name(b.metric);
  if (!b.layer_missed.empty()) {
    j["layer_missed"] = b.layer_missed;
    j["layer_far"] = b.layer_far;
  }
  io::write_file_atomic(path, j.dump() + "\n");
}

void check_block_budget(const BlockBudget& b, int64_t window, int64_t sinks, const ModelConfig& c,
                           const std::string& source) {
  FOCUS_CHECK(b.window == window && b.sinks == sinks, source, ": the block budgets were measured with window ",
              b.window, " and ", b.sinks, " sinks, the routers have window ", window, " and ", sinks,
              " (give the routers the same: --window ", b.window, " --sinks ", b.sinks, ")");
  FOCUS_CHECK((int64_t)b.k.size() == c.layers, source, ": budgets for ", b.k.size(), " layers, the model has ",
              c.layers);
  for (int64_t l = 0; l < c.layers; ++l)
    FOCUS_CHECK(c.layer_sliding_window[l] > 0 || (int64_t)b.k[l].size() == c.heads, source, ": layer ", l, " has ",
                b.k[l].size(), " head budgets, the model has ", c.heads, " heads");
}

BlockBudget load_block_budget(const std::string& path) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": invalid JSON: ", e.what());
  }
  FOCUS_CHECK(j.is_object() && j.value("format", nlohmann::json()) == "focus-block-budget", path,
              ": not a block budget file (made by `focus budget`)");
  BlockBudget b;
  auto int_of = [&](const nlohmann::json& v, const std::string& what, int64_t min) {
    FOCUS_CHECK(v.is_number_integer(), path, ": '", what, "' must be an integer (got ", v.dump(), ")");
    const int64_t x = v.get<int64_t>();
    FOCUS_CHECK(x >= min && x < (int64_t{1} << 30), path, ": '", what, "' out of range: ", x);
    return x;
  };
  for (const char* key : {"block", "window", "sinks", "k"})
    FOCUS_CHECK(j.contains(key), path, ": missing field '", key, "'");
  b.block = int_of(j["block"], "block", 1);
  b.window = int_of(j["window"], "window", 1);
  b.sinks = int_of(j["sinks"], "sinks", 0);
  if (j.contains("ctx")) b.ctx = int_of(j["ctx"], "ctx", 0);
  if (j.contains("mean_k") && j["mean_k"].is_number()) b.mean_k = j["mean_k"].get<double>();
  b.k = per_layer_counts(j["k"], path, "k");
  if (j.contains("near")) {
    b.near = per_layer_counts(j["near"], path, "near");
    FOCUS_CHECK(b.near.size() == b.k.size(), path, ": 'near' has ", b.near.size(), " layers, 'k' ", b.k.size());
    for (size_t l = 0; l < b.k.size(); ++l)
      FOCUS_CHECK(b.near[l].size() == b.k[l].size(), path, ": layer ", l, " has ", b.near[l].size(),
                  " near counts and ", b.k[l].size(), " budgets");
  }
  for (const auto& [key, w] : {std::pair<const char*, double*>{"group_weight", &b.weights.group},
                               std::pair<const char*, double*>{"near_weight", &b.weights.near}})
    if (j.contains(key)) {
      FOCUS_CHECK(j[key].is_number() && j[key].get<double>() > 0, path, ": '", key, "' must be a positive number");
      *w = j[key].get<double>();
    }
  if (j.contains("metric")) {
    FOCUS_CHECK(j["metric"].is_string(), path, ": 'metric' must be a string");
    b.metric = parse_block_metric(j["metric"].get<std::string>(), path);
  }
  if (j.contains("group")) {
    b.group = per_layer_counts(j["group"], path, "group");
    FOCUS_CHECK(b.group.size() == b.k.size(), path, ": 'group' has ", b.group.size(), " layers, 'k' ", b.k.size());
    for (size_t l = 0; l < b.k.size(); ++l) {
      FOCUS_CHECK(b.group[l].size() == b.k[l].size(), path, ": layer ", l, " has ", b.group[l].size(),
                  " group switches and ", b.k[l].size(), " budgets");
      for (int64_t x : b.group[l])
        FOCUS_CHECK(x == 0 || x == 1, path, ": 'group' holds ", x, " (1: the head reads its groups, 0: it does not)");
    }
  }
  return b;
}

std::vector<std::vector<int64_t>> per_layer_counts(const nlohmann::json& v, const std::string& path,
                                                   const std::string& key) {
  FOCUS_CHECK(v.is_array(), path, ": '", key, "' must be an array of per-layer lists");
  std::vector<std::vector<int64_t>> out;
  for (const auto& kl : v) {
    FOCUS_CHECK(kl.is_array(), path, ": '", key, "' must be an array of per-layer lists of integers");
    std::vector<int64_t> row;
    for (const auto& x : kl) {
      FOCUS_CHECK(x.is_number_integer(), path, ": '", key, "' holds ", x.dump(), ", not an integer");
      const int64_t n = x.get<int64_t>();
      FOCUS_CHECK(n >= 0 && n <= (1 << 20), path, ": '", key, "' holds ", n, ", out of range [0, 2^20]");
      row.push_back(n);
    }
    out.push_back(std::move(row));
  }
  return out;
}

}  // namespace focus
