#include "focus/block_topk.h"

#include <algorithm>
#include <cmath>
#include <functional>
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
    cpu::GroupedRouting routing{st->index.n_groups, 1, st->index.groups_of_keys(0), kq, qg.data()};
    // The far bias as far-pair terms of one routing head: C for every row, 0 for every key.
    std::vector<float> far_q, far_k;
    const float* fq = nullptr;
    const float* fk = nullptr;
    if (s_.far_bias != 0.f) {
      far_q.assign(a.T, s_.far_bias);
      far_k.assign(n, 0.f);
      fq = far_q.data();
      fk = far_k.data();
      routing.far_q = &fq;
      routing.far_k = &fk;
    }
    if (a.pos0 == 0 && a.T * c.heads > cpu::kFewPairs && !routing.far_q) {
      // A prefill from the start: the rows' blocks in tiles of neighbouring rows.
      cpu::block_list_attention(a.q, a.k, a.v, a.out, nullptr, sh, s_.block, qg.data(), kq);
    } else {
      cpu::grouped_attention(a.q, a.k, a.v, a.out, nullptr, sh, routing, st->index);
    }
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

// thr is found among the bounds at or above a pivot: a sample's value a few ranks below where the
// Kh-th largest is expected, or -inf (every bound) when fewer than Kh reach it. Three passes over
// the bounds, a vector at a time (NaN, candidates, listing), and a selection among the candidates
// only (a selection's compares mispredict: over every bound of a row it costs more than the rest).
void block_topk_pick(float* bd, int64_t nb, int64_t Kh, int64_t lo, int32_t* slots, std::vector<float>& cand) {
  using namespace cpu::simd;
  const float ninf = -std::numeric_limits<float>::infinity();
  int64_t x = 0;
  for (; x + kV <= nb; x += kV) {
    const vf v = load(bd + x);
    store(bd + x, select(v != v, bcast(ninf), v));
  }
  for (; x < nb; ++x)
    if (std::isnan(bd[x])) bd[x] = ninf;
  constexpr int64_t kSample = 64;
  float pivot = ninf;
  if (nb > 2 * kSample) {
    float smp[kSample];
    for (int64_t i = 0; i < kSample; ++i) smp[i] = bd[i * nb / kSample];
    const int64_t e = (Kh * kSample + nb - 1) / nb;  // the sample rank where the Kh-th largest is expected
    const int64_t r = std::min<int64_t>(kSample - 1, e + 3 + e / 4);
    std::nth_element(smp, smp + r, smp + kSample, std::greater<float>());
    pivot = smp[r];
  }
  cand.resize(nb);
  int64_t m = 0;
  if (pivot != ninf) {
    // The few bounds at or above the pivot, found a vector at a time.
    const vf pv = bcast(pivot);
    for (x = 0; x + kV <= nb; x += kV)
      for (uint32_t bits = lane_bits(load(bd + x) >= pv); bits; bits &= bits - 1) cand[m++] = bd[x + __builtin_ctz(bits)];
    for (; x < nb; ++x) {
      cand[m] = bd[x];
      m += bd[x] >= pivot;
    }
    if (m < Kh) pivot = ninf;  // an unlucky sample
  }
  if (pivot == ninf) {  // every bound
    std::copy_n(bd, nb, cand.data());
    m = nb;
  }
  std::nth_element(cand.begin(), cand.begin() + (Kh - 1), cand.begin() + m, std::greater<float>());
  const float thr = cand[Kh - 1];
  int64_t above = 0;  // bounds > thr: all are candidates
  for (int64_t i = 0; i < m; ++i) above += cand[i] > thr;
  int64_t ties = Kh - above, listed = 0;
  // The blocks at or above thr in ascending order: those above, and the first `ties` equal to it.
  const vf tv = bcast(thr);
  for (x = 0; x + kV <= nb && listed < Kh; x += kV)
    for (uint32_t bits = lane_bits(load(bd + x) >= tv); bits && listed < Kh; bits &= bits - 1) {
      const int64_t y = x + __builtin_ctz(bits);
      if (bd[y] > thr || ties-- > 0) slots[1 + listed++] = (int32_t)(lo + y);
    }
  for (; x < nb && listed < Kh; ++x)
    if (bd[x] > thr || (bd[x] == thr && ties-- > 0)) slots[1 + listed++] = (int32_t)(lo + x);
}

namespace {

// Up to this many rows a call is decoding-sized: its rows cannot share the threads, so the
// threads share each row's blocks, kSplitBlocks at a time.
constexpr int64_t kSplitRows = 4;
constexpr int64_t kSplitBlocks = 256;
// More rows: the threads share tiles of kSelectRows neighbouring rows, and a tile's candidates are
// scored kScoreBlocks at a time for all its rows (a piece of the ranges, 32 KiB at head dim 64, is
// read from memory once per tile of rows instead of once per row).
constexpr int64_t kSelectRows = 8;
constexpr int64_t kScoreBlocks = 64;

// Row t of call a: its last far key p - w (negative while it has none), and whether that key
// starts a tile of R rows (the row that chooses the tile's blocks; every row when R = 1).
inline int64_t far_key(const AttentionCall& a, int64_t t, int64_t w) { return a.pos0 + t - w; }
inline bool leads_tile(int64_t f, int64_t R) { return R == 1 || (f >= 0 && f % R == 0); }

}  // namespace

namespace {

// With s.select_every R > 1, after the tiles' first rows of call a have chosen (their lists in
// qg, kq slots each): keeps their choices in st, in tile order, and gives every later row its
// tile's, followed by the blocks from the tile's first far block up to the row's current one.
// Returns kq.
int share_tiles(const AttentionCall& a, BlockTopKState& st, const BlockTopKSettings& s, std::vector<int32_t>& qg,
                int64_t kq) {
  const int64_t R = s.select_every;
  if (R == 1) return (int)kq;
  const int64_t H = a.cfg->heads, B = s.block, w = s.window, lo = s.sinks / B;
  if (st.chosen_every == 0) {
    st.chosen_every = R;
    st.chosen_window = w;
  }
  FOCUS_CHECK(st.chosen_every == R && st.chosen_window == w, "block top-k (layer ", a.layer,
              "): the cache's blocks were chosen every ", st.chosen_every, " rows with window ", st.chosen_window,
              ", this call chooses every ", R, " with window ", w);
  for (int64_t t = 0; t < a.T; ++t) {
    const int64_t f = far_key(a, t, w);
    if (!leads_tile(f, R)) continue;
    const int64_t i = f / R;
    FOCUS_CHECK(i <= st.chosen_tiles(), "block top-k (layer ", a.layer, "): tile ", i, " (position ", a.pos0 + t,
                ") would follow ", st.chosen_tiles(), " kept tiles");
    if (i < st.chosen_tiles()) continue;  // chosen before, from the same keys
    // The tile's first row lists its candidates, or its top K of them, in slots 1 .. Ki.
    const int64_t Ki = f >= s.sinks ? std::min(s.k, std::max<int64_t>(0, f / B - lo)) : 0;
    for (int64_t h = 0; h < H; ++h) {
      const int32_t* slots = qg.data() + (t * H + h) * kq;
      st.chosen.insert(st.chosen.end(), slots + 1, slots + 1 + Ki);
    }
    st.chosen_at.push_back((int64_t)st.chosen.size());
  }
  for (int64_t t = 0; t < a.T; ++t) {
    const int64_t f = far_key(a, t, w);
    if (f < s.sinks || leads_tile(f, R)) continue;
    const int64_t i = f / R, f0 = f - f % R, cur = f / B, first = std::max(lo, f0 / B);
    FOCUS_CHECK(i < st.chosen_tiles(), "block top-k (layer ", a.layer, "): the blocks of the tile from position ",
                f0 + w, " were not kept; fill the cache from position 0 with this policy");
    const int64_t Ki = (st.chosen_at[i + 1] - st.chosen_at[i]) / H;
    FOCUS_CHECK(1 + Ki + (cur - first) <= kq, "block top-k: ", 1 + Ki + (cur - first), " blocks for ", kq, " slots");
    for (int64_t h = 0; h < H; ++h) {
      int32_t* slots = qg.data() + (t * H + h) * kq;
      slots[0] = (int32_t)cur;
      std::copy_n(st.chosen.data() + st.chosen_at[i] + h * Ki, Ki, slots + 1);
      int64_t x = 1 + Ki;
      for (int64_t b = first; b < cur; ++b) slots[x++] = (int32_t)b;
    }
  }
  return (int)kq;
}

}  // namespace

int block_topk_select(const AttentionCall& a, BlockTopKState& st, const BlockTopKSettings& s,
                      std::vector<int32_t>& qg) {
  const ModelConfig& c = *a.cfg;
  const int64_t H = c.heads, hpk = c.heads / c.kv_heads, hd = c.head_dim, B = s.block, w = s.window;
  const int64_t R = s.select_every;
  FOCUS_CHECK(R >= 1, "block top-k: blocks chosen every ", R, " rows; must be at least 1");
  // Blocks before lo hold sink keys only, which every row sees without reading them.
  const int64_t lo = s.sinks / B;
  const int64_t last_far = a.pos0 + a.T - 1 - w;
  const int64_t max_cand = last_far >= s.sinks ? std::max<int64_t>(0, last_far / B - lo) : 0;
  // No more slots than the call's rows can fill: a huge K costs nothing.
  const int64_t K = std::min(s.k, max_cand);
  // Whether row t chooses its blocks (R > 1: the first row of a tile), and with R > 1 the most
  // blocks a later row of a tile reads between its tile's first far block and its own current one.
  auto picks = [&](int64_t t) { return leads_tile(far_key(a, t, w), R); };
  int64_t extra = 0, picking = a.T;
  if (R > 1) {
    picking = 0;
    for (int64_t t = 0; t < a.T; ++t) {
      const int64_t f = far_key(a, t, w);
      picking += picks(t);
      if (f >= s.sinks) extra = std::max(extra, f / B - std::max(lo, (f - f % R) / B));
    }
  }
  const int64_t kq = K + 1 + extra;
  qg.assign(a.T * H * kq, -1);
  FOCUS_CHECK(s.head_k.empty() || (int64_t)s.head_k.size() == H, "block top-k: ", s.head_k.size(),
              " head budgets for ", H, " heads (layer ", a.layer, ")");
  FOCUS_CHECK(s.head_near.empty() || (int64_t)s.head_near.size() == H, "block top-k: ", s.head_near.size(),
              " near counts for ", H, " heads (layer ", a.layer, ")");
  FOCUS_CHECK(s.head_near.empty() || R == 1, "block top-k: near blocks need blocks chosen on every row (every=1)");
  static thread_local std::vector<int64_t> kh_buf;  // the calling thread's, kept across calls
  std::vector<int64_t>& kh = kh_buf;
  kh.resize(H);
  for (int64_t h = 0; h < H; ++h) kh[h] = std::min(s.k_of(h) + s.near_of(h), K);
  // A head's near blocks (the last of its nb candidates) rank first: their bounds become +inf.
  auto force_near = [&](int64_t h, float* bd, int64_t nb) {
    const int64_t n = std::min(s.near_of(h), nb);
    std::fill(bd + nb - n, bd + nb, std::numeric_limits<float>::infinity());
  };
  // Row t's current block (that of its last far key p - w), or -1 when it has no far key; a head
  // chooses when it has more candidates than its budget.
  auto current = [&](int64_t t) {
    const int64_t f = far_key(a, t, w);
    return f < s.sinks ? int64_t{-1} : f / B;
  };
  auto chooses = [&](int64_t h, int64_t nb) { return kh[h] > 0 && nb > kh[h]; };
  // Slot 0 of row t's lists, and every candidate for the heads whose budget holds them all.
  auto start_row = [&](int64_t t, int64_t cur) {
    for (int64_t h = 0; h < H; ++h) {
      int32_t* slots = qg.data() + (t * H + h) * kq;
      slots[0] = (int32_t)cur;
      if (cur - lo <= kh[h])
        for (int64_t b = lo; b < cur; ++b) slots[1 + b - lo] = (int32_t)b;
    }
  };
  const int64_t work = picking * H * max_cand * hd;

  if (a.T <= kSplitRows) {
    // Few rows (decoding): the rows' candidates are cut into pieces of kSplitBlocks, each
    // (row, kv head, piece) a task that scores the piece for all the kv head's query heads (a
    // block's bound is its own chain, so the cut does not change its bits); then each
    // (row, head) that chooses picks from its row of bounds.
    // The calling thread's buffers, kept across calls (a decoding step allocates nothing): every
    // bound a pick reads is written first.
    struct Piece {
      int64_t t, kvh, b0, b1;
    };
    static thread_local std::vector<float> bound;
    static thread_local std::vector<Piece> pieces;
    bound.resize(a.T * H * max_cand);
    pieces.clear();
    for (int64_t t = 0; t < a.T; ++t) {
      const int64_t cur = current(t);
      if (cur < 0 || !picks(t)) continue;
      const int64_t nb = cur - lo;
      start_row(t, cur);
      for (int64_t kvh = 0; kvh < c.kv_heads; ++kvh) {
        bool any = false;
        for (int64_t h = kvh * hpk; h < (kvh + 1) * hpk; ++h) any = any || chooses(h, nb);
        if (!any) continue;
        for (int64_t b0 = lo; b0 < cur;) {
          const int64_t b1 = std::min(cur, (b0 / kSplitBlocks + 1) * kSplitBlocks);
          pieces.push_back({t, kvh, b0, b1});
          b0 = b1;
        }
      }
    }
    if (pieces.empty()) return share_tiles(a, st, s, qg, kq);
    float* bd = bound.data();
    const Piece* pc = pieces.data();
    const int64_t n_pieces = (int64_t)pieces.size();
#pragma omp parallel if (work > (int64_t{1} << 18))
    {
      static thread_local std::vector<float> cand;
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < n_pieces; ++i) {
        const Piece& u = pc[i];
        const int64_t h0 = u.kvh * hpk;
        block_bounds(a.q + u.t * c.q_dim() + h0 * hd, hpk, st, u.kvh, u.b0, u.b1,
                     bd + (u.t * H + h0) * max_cand + (u.b0 - lo), max_cand);
      }
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < a.T * H; ++i) {
        const int64_t t = i / H, h = i % H, cur = current(t);
        if (cur < 0 || !picks(t) || !chooses(h, cur - lo)) continue;
        force_near(h, bd + i * max_cand, cur - lo);
        block_topk_pick(bd + i * max_cand, cur - lo, kh[h], lo, qg.data() + i * kq, cand);
      }
    }
    return share_tiles(a, st, s, qg, kq);
  }

  const int64_t row_tiles = (a.T + kSelectRows - 1) / kSelectRows;
#pragma omp parallel if (work > (int64_t{1} << 18))
  {
    std::vector<float> bound, cand, qs(kSelectRows * hpk * hd);
    std::vector<int64_t> chosen(kSelectRows * hpk), nh(kSelectRows);
#pragma omp for schedule(dynamic, 1)
    for (int64_t rt = 0; rt < row_tiles; ++rt) {
      const int64_t t0 = rt * kSelectRows, t1 = std::min(a.T, t0 + kSelectRows);
      int64_t top = lo;  // the tile's last candidate block + 1
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t cur = current(t);
        if (cur < 0 || !picks(t)) continue;
        start_row(t, cur);
        top = std::max(top, cur);
      }
      const int64_t stride = top - lo;
      if (stride == 0) continue;
      bound.resize(kSelectRows * hpk * stride);
      // Per kv head: the query heads of each row that must choose (more candidates than their
      // budget) are scored together, piece by piece; each keeps its top Kh, ascending.
      for (int64_t kvh = 0; kvh < c.kv_heads; ++kvh) {
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t i = t - t0, cur = current(t);
          nh[i] = 0;
          for (int64_t h = kvh * hpk; h < (kvh + 1) * hpk && cur >= 0 && picks(t); ++h)
            if (chooses(h, cur - lo)) {
              std::copy_n(a.q + t * c.q_dim() + h * hd, hd, qs.data() + (i * hpk + nh[i]) * hd);
              chosen[i * hpk + nh[i]++] = h;
            }
        }
        for (int64_t b0 = lo; b0 < top;) {
          const int64_t b1 = std::min(top, (b0 / kScoreBlocks + 1) * kScoreBlocks);
          for (int64_t t = t0; t < t1; ++t) {
            const int64_t i = t - t0, cur = current(t);
            if (nh[i] > 0 && cur > b0)
              block_bounds(qs.data() + i * hpk * hd, nh[i], st, kvh, b0, std::min(b1, cur),
                           bound.data() + i * hpk * stride + (b0 - lo), stride);
          }
          b0 = b1;
        }
        for (int64_t t = t0; t < t1; ++t)
          for (int64_t i = t - t0, x = 0; x < nh[i]; ++x) {
            const int64_t h = chosen[i * hpk + x];
            force_near(h, bound.data() + (i * hpk + x) * stride, current(t) - lo);
            block_topk_pick(bound.data() + (i * hpk + x) * stride, current(t) - lo, kh[h], lo,
                            qg.data() + (t * H + h) * kq, cand);
          }
      }
    }
  }
  return share_tiles(a, st, s, qg, kq);
}

void BlockTopKState::append(cpu::KvView k, int64_t kv_stride, int64_t n) {
  const int64_t n0 = len(), B = block, kvd = kv_heads * head_dim;
  if (n <= n0) return;
  // The kernel's key groups and their index, grown (not rebuilt) when the keys reach a new block.
  static thread_local std::vector<int32_t> kg;  // the calling thread's, kept across calls
  kg.resize(n - n0);
  for (int64_t j = n0; j < n; ++j) kg[j - n0] = (int32_t)(j / B);
  const int64_t G = (n + B - 1) / B;
  if (G > index.n_groups) {
    index.grow(G);
    index_grows++;
  }
  index.append(kg.data(), n - n0);
  // Bounds of the blocks completed by these keys (earlier complete blocks never change).
  const int64_t b0 = n0 / B, b1 = n / B, hd = head_dim;
  const int64_t tiles = (b1 + kBlockTile - 1) / kBlockTile;
  range.resize(tiles * kv_heads * hd * 2 * kBlockTile, 0.f);
  if (b1 == b0) return;  // no block completed
  std::vector<float> mn(kvd), mx(kvd);
  for (int64_t b = b0; b < b1; ++b) {
    std::fill(mn.begin(), mn.end(), std::numeric_limits<float>::infinity());
    std::fill(mx.begin(), mx.end(), -std::numeric_limits<float>::infinity());
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
    for (int64_t kvh = 0; kvh < kv_heads; ++kvh)
      for (int64_t d = 0; d < hd; ++d) {
        range[at(b, kvh, d)] = mn[kvh * hd + d];
        range[at(b, kvh, d) + kBlockTile] = mx[kvh * hd + d];
      }
  }
}

void BlockTopKState::truncate(int64_t n) {
  if (n >= len()) return;
  index.truncate(n);
  if (chosen_every > 0) {  // the tiles whose first row is still in the cache
    const int64_t keep = n > chosen_window ? (n - chosen_window + chosen_every - 1) / chosen_every : 0;
    if (keep < chosen_tiles()) {
      chosen_at.resize(keep + 1);
      chosen.resize(chosen_at.back());
    }
  }
  // A block cut short is no longer complete: its bounds go, to be made again from its new keys
  // (append writes every lane of a block it completes).
  range.resize((complete_blocks() + kBlockTile - 1) / kBlockTile * kv_heads * head_dim * 2 * kBlockTile);
}

namespace {

// Bounds of N consecutive tiles from tile t0 for NH query heads of kv head kvh (their queries
// hd floats apart in q, their bounds N * L floats apart in out): each (min, max) pair of the
// range is loaded once for all the heads, each head taking the side the sign of its q_d picks.
// N * NH accumulator chains cover the FMA latency.
template <int N, int NH>
void tile_bounds(const float* q, const BlockTopKState& st, int64_t kvh, int64_t t0, float* out) {
  using namespace cpu::simd;
  constexpr int64_t L = BlockTopKState::kBlockTile;
  const int64_t hd = st.head_dim, tile_stride = st.kv_heads * hd * 2 * L;
  const float* r = st.range.data() + st.at(t0 * L, kvh, 0);
  vf acc[NH][N];
  for (int h = 0; h < NH; ++h)
    for (int i = 0; i < N; ++i) acc[h][i] = bcast(0.f);
  for (int64_t d = 0; d < hd; ++d) {
    vf qd[NH];
    vi up[NH];
    for (int h = 0; h < NH; ++h) {
      qd[h] = bcast(q[h * hd + d]);
      up[h] = qd[h] >= 0.f;
    }
    for (int i = 0; i < N; ++i) {
      const vf mn = load(r + i * tile_stride + d * 2 * L), mx = load(r + i * tile_stride + d * 2 * L + L);
      for (int h = 0; h < NH; ++h) acc[h][i] = vfma(qd[h], select(up[h], mx, mn), acc[h][i]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int i = 0; i < N; ++i) store(out + (h * N + i) * L, acc[h][i]);
}

// Blocks b0 .. b1-1 for NH heads (NH <= kMaxHeads), N tiles at a time.
template <int N, int NH>
void bounds_of_heads(const float* q, const BlockTopKState& st, int64_t kvh, int64_t b0, int64_t b1, float* out,
                     int64_t out_stride) {
  constexpr int64_t L = BlockTopKState::kBlockTile;
  alignas(64) float buf[NH * N * L];
  const int64_t t_end = (b1 + L - 1) / L;
  for (int64_t t = b0 / L; t < t_end;) {
    const int64_t n = t_end - t >= N ? N : 1;
    if (n == N) tile_bounds<N, NH>(q, st, kvh, t, buf);
    else tile_bounds<1, NH>(q, st, kvh, t, buf);
    const int64_t lo = std::max(b0, t * L), hi = std::min(b1, (t + n) * L);
    for (int h = 0; h < NH; ++h)
      for (int64_t b = lo; b < hi; ++b) out[h * out_stride + b - b0] = buf[h * n * L + b - t * L];
    t += n;
  }
}

}  // namespace

void block_bounds(const float* q, int64_t nh, const BlockTopKState& st, int64_t kvh, int64_t b0, int64_t b1,
                  float* out, int64_t out_stride) {
  const int64_t hd = st.head_dim;
  FOCUS_CHECK(b0 >= 0 && b1 <= st.complete_blocks(), "block top-k: bounds of blocks ", b0, " .. ", b1 - 1, " asked, ",
              st.complete_blocks(), " complete");
  if (b1 <= b0) return;
  // Each block's bound is its own chain of FMAs over d in order, whichever tiles and heads it is
  // computed with, so every grouping gives the same bits.
  for (int64_t h = 0; h < nh;) {
    const int64_t m = std::min<int64_t>(3, nh - h);
    const float* qh = q + h * hd;
    float* oh = out + h * out_stride;
    if (m == 3) bounds_of_heads<2, 3>(qh, st, kvh, b0, b1, oh, out_stride);
    else if (m == 2) bounds_of_heads<2, 2>(qh, st, kvh, b0, b1, oh, out_stride);
    else bounds_of_heads<4, 1>(qh, st, kvh, b0, b1, oh, out_stride);
    h += m;
  }
}

void block_bounds(const float* q, const BlockTopKState& st, int64_t kvh, int64_t b0, int64_t b1, float* out) {
  block_bounds(q, 1, st, kvh, b0, b1, out, 0);
}

int block_topk_select_window(const AttentionCall& a, const BlockTopKSettings& s, std::vector<int32_t>& qg) {
  FOCUS_CHECK(a.pos0 == 0 && a.k, "block top-k over a window: the call must hold the whole window from position 0");
  const ModelConfig& c = *a.cfg;
  BlockTopKState st(s.block, c.kv_heads, c.head_dim);
  st.append(cpu::KvView(a.k), c.kv_dim(), a.T);
  return block_topk_select(a, st, s, qg);
}

BlockTopKSettings block_topk_settings(const AttentionOptions& o, const ModelConfig& c, int64_t layer) {
  BlockTopKSettings s;
  if (o.has("budget")) {
    const std::string path = o.get("budget", "");
    FOCUS_CHECK(!o.has("k"), "blocktopk: give k or budget, not both (the budget file sets each head's k)");
    FOCUS_CHECK(!path.empty(), "blocktopk: budget= needs a file name");
    const BlockBudget b = load_block_budget(path);
    FOCUS_CHECK((int64_t)b.k.size() == c.layers, path, ": budgets for ", b.k.size(), " layers, the model has ", c.layers);
    FOCUS_CHECK(b.group.empty(), path, ": this budget switches the groups of a hybrid's heads (focus budget "
                "--group-switch); block top-k alone reads no groups: run it with the routers (--focus DIR --block-budget)");
    const std::vector<int64_t>& kl = b.k[layer];
    FOCUS_CHECK((int64_t)kl.size() == c.heads, path, ": layer ", layer, " has ", kl.size(),
                " head budgets, the model has ", c.heads, " heads",
                kl.empty() ? " (the layer was not measured: calibrate on this model)" : "");
    s.block = b.block;
    s.window = b.window;
    s.sinks = b.sinks;
    s.set_head_k(kl, b.near.empty() ? std::vector<int64_t>{} : b.near[layer]);
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
  s.select_every = o.get_int("every", s.select_every);
  const double far = o.get_double("far", 0.0);
  FOCUS_CHECK(std::isfinite(far) && std::fabs(far) <= 100, "blocktopk: far (the far pairs' bias) must be in [-100, 100], got ",
              far);
  s.far_bias = (float)far;
  FOCUS_CHECK(s.select_every >= 1 && s.select_every < (int64_t{1} << 30),
              "blocktopk: every (rows per choice of blocks) must be at least 1, got ", s.select_every);
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
