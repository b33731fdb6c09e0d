#include "focus/block_topk.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "core/error.h"
#include "focus/block_budget.h"

namespace focus {
namespace {

class BlockTopKAttention final : public AttentionPolicy {
 public:
  explicit BlockTopKAttention(const BlockTopKSettings& s) : s_(s) {}
  std::string name() const override { return "blocktopk"; }

  void attend(const AttentionCall& a, std::unique_ptr<AttentionState>& state, AttentionStats* stats) const override {
    const ModelConfig& c = *a.cfg;
    const int64_t n = a.pos0 + a.T;
    if (a.pos0 == 0 || !state) {
      FOCUS_CHECK(a.pos0 == 0, "forward: the KV cache holds ", a.pos0, " positions but no block top-k state (layer ",
                  a.layer, "); fill it from position 0 with the same policy");
      state = std::make_unique<BlockTopKState>(s_.block, c.kv_heads, c.head_dim);
    }
    auto* st = dynamic_cast<BlockTopKState*>(state.get());
    FOCUS_CHECK(st && st->len() == a.pos0 && st->block == s_.block && st->kv_heads == c.kv_heads &&
                    st->head_dim == c.head_dim,
                "forward: the KV cache of layer ", a.layer,
                " was filled by another attention policy or holds another length");
    st->append(a.k, c.kv_dim(), n);

    if (n <= s_.window) {
      // No key is beyond any row's window yet: the model's own kernel computes the same thing.
      dense_attention().attend(a, state, nullptr);
      if (stats) add_pairs(stats, a.pos0, a.T, causal_pairs(a.pos0, a.T));
      return;
    }
    std::vector<int32_t> qg;
    const int kq = block_topk_select(a, *st, s_, qg);
    cpu::AttnShape sh = layer_attn_shape(c, a.layer, a.pos0, a.T);
    sh.local_window = s_.window;
    sh.sinks = s_.sinks;
    const cpu::GroupedRouting routing{st->index.n_groups, 1, st->key_group.data(), kq, qg.data()};
    cpu::grouped_attention(a.q, a.k, a.v, a.out, nullptr, sh, routing, st->index);
    if (stats) add_pairs(stats, a.pos0, a.T, (double)cpu::grouped_pair_count(sh, routing, st->index) / (double)c.heads);
  }

 private:
  static double causal_pairs(int64_t pos0, int64_t T) {
    return (double)T * (double)pos0 + 0.5 * (double)T * (double)(T + 1);
  }
  static void add_pairs(AttentionStats* stats, int64_t pos0, int64_t T, double pairs) {
    stats->computed_pairs += pairs;
    stats->causal_pairs += causal_pairs(pos0, T);
    stats->layers++;
  }

  BlockTopKSettings s_;
};

}  // namespace

int block_topk_select(const AttentionCall& a, const BlockTopKState& st, const BlockTopKSettings& s,
                      std::vector<int32_t>& qg) {
  const ModelConfig& c = *a.cfg;
  const int64_t H = c.heads, hpk = c.heads / c.kv_heads, hd = c.head_dim, B = s.block, w = s.window;
  // Blocks before lo hold sink keys only, which every row sees without reading them.
  const int64_t lo = s.sinks / B;
  const int64_t last_far = a.pos0 + a.T - 1 - w;
  const int64_t max_cand = last_far >= s.sinks ? std::max<int64_t>(0, last_far / B - lo) : 0;
  // No more slots than the call's rows can fill: a huge K costs nothing.
  const int64_t K = std::min(s.k, max_cand);
  const int64_t kq = K + 1;
  qg.assign(a.T * H * kq, -1);
  FOCUS_CHECK(s.head_k.empty() || (int64_t)s.head_k.size() == H, "block top-k: ", s.head_k.size(),
              " head budgets for ", H, " heads (layer ", a.layer, ")");
  std::vector<int64_t> kh(H);
  for (int64_t h = 0; h < H; ++h) kh[h] = std::min(s.k_of(h), K);
  const int64_t work = a.T * H * max_cand * hd;
#pragma omp parallel if (work > (int64_t{1} << 18))
  {
    std::vector<std::vector<std::pair<float, int32_t>>> cand(hpk);
#pragma omp for schedule(dynamic, 4)
    for (int64_t t = 0; t < a.T; ++t) {
      const int64_t f = a.pos0 + t - w;
      if (f < s.sinks) continue;
      const int64_t cur = f / B, nb = cur - lo;
      for (int64_t h = 0; h < H; ++h) {
        int32_t* slots = qg.data() + (t * H + h) * kq;
        slots[0] = (int32_t)cur;
        if (nb <= kh[h])  // every candidate fits
          for (int64_t b = lo; b < cur; ++b) slots[1 + b - lo] = (int32_t)b;
      }
      // Per kv head, every candidate's bounds for its query heads that must choose (each block's
      // bounds read once).
      for (int64_t kvh = 0; kvh < c.kv_heads; ++kvh) {
        bool choose = false;
        for (int64_t hh = 0; hh < hpk; ++hh) choose |= kh[kvh * hpk + hh] > 0 && nb > kh[kvh * hpk + hh];
        if (!choose) continue;
        for (auto& ch : cand) ch.resize(nb);
        const float* q0 = a.q + t * c.q_dim() + kvh * hpk * hd;
        for (int64_t b = lo; b < cur; ++b) {
          const int64_t at = (b * c.kv_heads + kvh) * hd;
          for (int64_t hh = 0; hh < hpk; ++hh)
            cand[hh][b - lo] = {block_bound(q0 + hh * hd, st.kmin.data() + at, st.kmax.data() + at, hd), (int32_t)b};
        }
        for (int64_t hh = 0; hh < hpk; ++hh) {
          const int64_t Kh = kh[kvh * hpk + hh];
          if (Kh == 0 || nb <= Kh) continue;
          auto& ch = cand[hh];
          std::nth_element(ch.begin(), ch.begin() + (Kh - 1), ch.end(), block_ranks_before);
          std::sort(ch.begin(), ch.begin() + Kh, [](const auto& x, const auto& y) { return x.second < y.second; });
          int32_t* slots = qg.data() + (t * H + kvh * hpk + hh) * kq;
          for (int64_t i = 0; i < Kh; ++i) slots[1 + i] = ch[i].second;
        }
      }
    }
  }
  return (int)kq;
}

void BlockTopKState::append(cpu::KvView k, int64_t kv_stride, int64_t n) {
  const int64_t n0 = len(), B = block, kvd = kv_heads * head_dim;
  if (n <= n0) return;
  // The kernel's key groups and their index, grown (not rebuilt) when the keys reach a new block.
  std::vector<int32_t> kg(n - n0);
  for (int64_t j = n0; j < n; ++j) kg[j - n0] = (int32_t)(j / B);
  const int64_t G = (n + B - 1) / B;
  if (G > index.n_groups) {
    index.grow(G);
    index_grows++;
  }
  index.append(kg.data(), n - n0);
  key_group.insert(key_group.end(), kg.begin(), kg.end());
  // Bounds of the blocks completed by these keys (earlier complete blocks never change).
  const int64_t b0 = complete_blocks(), b1 = n / B;
  kmin.resize(b1 * kvd, std::numeric_limits<float>::infinity());
  kmax.resize(b1 * kvd, -std::numeric_limits<float>::infinity());
  for (int64_t b = b0; b < b1; ++b) {
    float* mn = kmin.data() + b * kvd;
    float* mx = kmax.data() + b * kvd;
    cpu::with_kv_type(k.type, [&](auto tag) {
      using E = decltype(tag);
      for (int64_t j = b * B; j < (b + 1) * B; ++j) {
        const E* kr = k.as<E>() + j * kv_stride;
        for (int64_t d = 0; d < kvd; ++d) {
          const float x = cpu::kv_load(kr + d);
          mn[d] = std::min(mn[d], x);
          mx[d] = std::max(mx[d], x);
        }
      }
    });
  }
}

void BlockTopKState::truncate(int64_t n) {
  if (n >= len()) return;
  key_group.resize(n);
  index.truncate(n);
  // A block cut short is no longer complete: its bounds go, to be made again from its new keys.
  const int64_t keep = (n / block) * kv_heads * head_dim;
  if ((int64_t)kmin.size() > keep) {
    kmin.resize(keep);
    kmax.resize(keep);
  }
}

BlockTopKSettings block_topk_settings(const AttentionOptions& o, const ModelConfig& c, int64_t layer) {
  BlockTopKSettings s;
  if (o.has("budget")) {
    const std::string path = o.get("budget", "");
    FOCUS_CHECK(!o.has("k"), "blocktopk: give k or budget, not both (the budget file sets each head's k)");
    FOCUS_CHECK(!path.empty(), "blocktopk: budget= needs a file name");
    const BlockBudget b = load_block_budget(path);
    FOCUS_CHECK((int64_t)b.k.size() == c.layers, path, ": budgets for ", b.k.size(), " layers, the model has ", c.layers);
    const std::vector<int64_t>& kl = b.k[layer];
    FOCUS_CHECK((int64_t)kl.size() == c.heads, path, ": layer ", layer, " has ", kl.size(),
                " head budgets, the model has ", c.heads, " heads",
                kl.empty() ? " (the layer was not measured: calibrate on this model)" : "");
    s.block = b.block;
    s.window = b.window;
    s.sinks = b.sinks;
    s.set_head_k(kl);
    // Settings the file fixes may be repeated, not changed.
    const std::pair<const char*, int64_t> fixed[] = {{"block", b.block}, {"window", b.window}, {"sinks", b.sinks}};
    for (const auto& [key, v] : fixed)
      FOCUS_CHECK(o.get_int(key, v) == v, "blocktopk: ", key, "=", o.get_int(key, v), " differs from the budget file's ",
                  v, " (", path, ")");
  } else {
    s.block = o.get_int("block", s.block);
    s.k = o.get_int("k", s.k);
    s.window = o.get_int("window", s.window);
    s.sinks = o.get_int("sinks", s.sinks);
  }
  FOCUS_CHECK(s.block >= 1 && s.block < (int64_t{1} << 30), "blocktopk: block must be at least 1, got ", s.block);
  FOCUS_CHECK(s.k >= 0, "blocktopk: k must be at least 0, got ", s.k);
  FOCUS_CHECK(s.window >= 1, "blocktopk: window must be at least 1, got ", s.window);
  FOCUS_CHECK(s.sinks >= 0, "blocktopk: sinks must be at least 0, got ", s.sinks);
  return s;
}

std::shared_ptr<const AttentionPolicy> block_topk_attention(const BlockTopKSettings& s) {
  return std::make_shared<BlockTopKAttention>(s);
}

namespace {
// Each global layer gets an instance of its own (it holds the settings only).
const bool registered = register_attention_policy(
    "blocktopk", [](const ModelConfig& c, int64_t layer, const AttentionOptions& o) {
      return block_topk_attention(block_topk_settings(o, c, layer));
    });
}  // namespace

}  // namespace focus
