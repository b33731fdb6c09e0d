// Grouped (asymmetric) hard Focus attention: the fast kernel against the masked reference over
// head layouts, routing granularities, slot counts, windows, sinks and lengths; chunks and
// decoding against one full call; the all-groups routing against dense causal attention; the
// key index kept incrementally; the pair count against brute force; the hybrid pattern (positional
// blocks besides the groups) against the reference and dense attention; bad ids.
//
// Tolerance: both paths accumulate in float32 (the tiled one with the tile engine's vector exp).
// A softmax-weighted sum of L values of magnitude O(1) has a relative error of a few ulp (6e-8)
// times log2 L, under 1e-6 for the lengths here, and the exact lse merges add a few ulp more;
// 1e-5 relative on o (absolute below magnitude 1) and on lse leaves a factor ~10 of margin.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/threads.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/grouped_attention.h"
#include "test_util.h"

using focus::cpu::AttnShape;
using focus::cpu::GroupedKeyIndex;
using focus::cpu::GroupedRouting;

namespace {

constexpr double kTol = 1e-5;

struct Case {
  int64_t n = 64, heads = 4, kv_heads = 4, hd = 64, window = 8, sinks = 0, G = 7, RH = 1;
  int kq = 2;
  double unused = 0.25;  // probability that a slot is -1
  uint32_t seed = 1;
  int kb = 0;             // positional block slots per (row, head) (the hybrid pattern); 0: none
  int64_t block = 16;     // keys per block
  bool shared_groups = false;  // the query heads of a routing head read the same groups (one router
                               // per layer or per kv head), so decoding computes them as one unit
  float far = 0.f;  // > 0: far-pair terms per (routing head, row) and (routing head, key), normal of this spread
};

struct Problem {
  AttnShape s;
  std::vector<float> q, k, v;
  std::vector<int32_t> key_group, query_groups, query_blocks;
  std::vector<float> far_q, far_k;          // [RH, n] each
  std::vector<const float*> far_qp, far_kp;  // their rows
  GroupedRouting r;
  GroupedKeyIndex idx;
};

void make(Problem& P, const Case& c) {
  AttnShape& s = P.s;
  s.n_q = s.n_kv = c.n;
  s.heads = c.heads;
  s.kv_heads = c.kv_heads;
  s.head_dim = c.hd;
  s.q_stride = s.o_stride = c.heads * c.hd;
  s.kv_stride = c.kv_heads * c.hd;
  s.scale = 1.f / std::sqrt((float)c.hd);
  s.local_window = c.window;
  s.sinks = c.sinks;
  std::mt19937 rng(c.seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  P.q.resize(std::max<int64_t>(1, c.n * s.q_stride));
  P.k.resize(std::max<int64_t>(1, c.n * s.kv_stride));
  P.v.resize(std::max<int64_t>(1, c.n * s.kv_stride));
  for (auto& x : P.q) x = nd(rng);
  for (auto& x : P.k) x = nd(rng);
  for (auto& x : P.v) x = nd(rng);
  P.key_group.resize(std::max<int64_t>(1, c.RH * c.n));
  for (auto& g : P.key_group) g = (int32_t)(rng() % c.G);
  P.query_groups.assign(std::max<int64_t>(1, c.n * c.heads * c.kq), -1);
  std::vector<int32_t> perm(c.G);
  std::uniform_real_distribution<double> u(0, 1);
  for (int64_t x = 0; x < c.n * c.heads; ++x) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int slot = 0; slot < c.kq; ++slot)
      if (u(rng) >= c.unused) P.query_groups[x * c.kq + slot] = perm[slot];
  }
  if (c.shared_groups)
    for (int64_t t = 0; t < c.n; ++t)
      for (int64_t h = 0; h < c.heads; ++h) {
        const int64_t h0 = h / (c.heads / c.RH) * (c.heads / c.RH);
        std::copy_n(P.query_groups.data() + (t * c.heads + h0) * c.kq, c.kq,
                    P.query_groups.data() + (t * c.heads + h) * c.kq);
      }
  P.r = GroupedRouting{c.G, c.RH, P.key_group.data(), c.kq, P.query_groups.data()};
  if (c.kb > 0) {
    // Any blocks of the sequence, distinct per (row, head): those in the window, at the sinks or
    // after the row add nothing, which the kernel must get right too.
    const int64_t nb = (c.n + c.block - 1) / c.block;
    P.query_blocks.assign(std::max<int64_t>(1, c.n * c.heads * c.kb), -1);
    std::vector<int32_t> bperm(nb);
    for (int64_t x = 0; x < c.n * c.heads; ++x) {
      std::iota(bperm.begin(), bperm.end(), 0);
      std::shuffle(bperm.begin(), bperm.end(), rng);
      for (int slot = 0; slot < std::min<int64_t>(c.kb, nb); ++slot)
        if (u(rng) >= c.unused) P.query_blocks[x * c.kb + slot] = bperm[slot];
    }
    P.r.block_size = c.block;
    P.r.kb = c.kb;
    P.r.query_blocks = P.query_blocks.data();
  }
  if (c.far > 0.f) {
    std::normal_distribution<float> fd(0.f, c.far);
    P.far_q.resize(std::max<int64_t>(1, c.RH * c.n));
    P.far_k.resize(std::max<int64_t>(1, c.RH * c.n));
    for (auto& x : P.far_q) x = fd(rng);
    for (auto& x : P.far_k) x = fd(rng);
    for (int64_t rh = 0; rh < c.RH; ++rh) {
      P.far_qp.push_back(P.far_q.data() + rh * c.n);
      P.far_kp.push_back(P.far_k.data() + rh * c.n);
    }
    P.r.far_q = P.far_qp.data();
    P.r.far_k = P.far_kp.data();
  }
  P.idx.build(P.r, c.n);
}

struct Out {
  std::vector<float> o, lse;
};

Out run_ref(const Problem& P) {
  Out r{std::vector<float>(std::max<int64_t>(1, P.s.n_q * P.s.o_stride)),
        std::vector<float>(std::max<int64_t>(1, P.s.heads * P.s.n_q))};
  focus::cpu::grouped_attention_reference(P.q.data(), P.k.data(), P.v.data(), r.o.data(), r.lse.data(), P.s, P.r);
  return r;
}

Out run_fast(const Problem& P) {
  Out r{std::vector<float>(std::max<int64_t>(1, P.s.n_q * P.s.o_stride), NAN),
        std::vector<float>(std::max<int64_t>(1, P.s.heads * P.s.n_q), NAN)};
  focus::cpu::grouped_attention(P.q.data(), P.k.data(), P.v.data(), r.o.data(), r.lse.data(), P.s, P.r, P.idx);
  return r;
}

// The fast kernel on the last `rows` rows of P against its whole cache (chunks, decoding): the cache
// P's keys and values, or the views k, v (of P's shape); the groups' keys from their runs when given.
Out run_tail(const Problem& P, int64_t rows, focus::cpu::KvView k, focus::cpu::KvView v,
             const focus::cpu::GroupedKvRuns* runs = nullptr) {
  const int64_t t0 = P.s.n_q - rows, H = P.s.heads;
  AttnShape s = P.s;
  s.q_pos0 = t0;
  s.n_q = rows;
  GroupedRouting r = P.r;
  r.query_groups = P.query_groups.data() + t0 * H * r.kq;
  if (r.kb > 0) r.query_blocks = P.query_blocks.data() + t0 * H * r.kb;
  std::vector<const float*> far_q;  // the rows' own terms
  if (r.far_q) {
    for (int64_t rh = 0; rh < r.route_heads; ++rh) far_q.push_back(P.far_qp[rh] + t0);
    r.far_q = far_q.data();
  }
  r.runs = runs;
  Out part{std::vector<float>(rows * s.o_stride), std::vector<float>(H * rows)};
  int64_t pairs = -1;
  focus::cpu::grouped_attention(P.q.data() + t0 * s.q_stride, k, v, part.o.data(), part.lse.data(), s, r, P.idx,
                                &pairs);
  // The pairs the kernel says it read (counted from its slices when decoding) are those counted apart.
  EXPECT_EQ(pairs, focus::cpu::grouped_pair_count(s, r, P.idx)) << "rows " << rows << ", runs " << (runs != nullptr);
  return part;
}
Out run_tail(const Problem& P, int64_t rows) { return run_tail(P, rows, P.k.data(), P.v.data()); }

// Largest |a - b| / max(1, |b|) over rows [t0, t0 + rows) of a and rows [u0, ..) of b (outputs
// [n, heads * hd], lse [heads, n] with the given row counts).
double rel_err(const Out& a, int64_t na, int64_t t0, const Out& b, int64_t nb, int64_t u0, int64_t rows,
               int64_t heads, int64_t hd) {
  double e = 0;
  auto upd = [&](double x, double y) {
    e = std::max(e, std::isfinite(x) ? std::fabs(x - y) / std::max(1.0, std::fabs(y)) : INFINITY);
  };
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t x = 0; x < heads * hd; ++x) upd(a.o[(t0 + t) * heads * hd + x], b.o[(u0 + t) * heads * hd + x]);
    for (int64_t h = 0; h < heads; ++h) upd(a.lse[h * na + t0 + t], b.lse[h * nb + u0 + t]);
  }
  return e;
}
double rel_err(const Out& a, const Out& b, const AttnShape& s) {
  return rel_err(a, s.n_q, 0, b, s.n_q, 0, s.n_q, s.heads, s.head_dim);
}

std::string describe(const Case& c) {
  return "n " + std::to_string(c.n) + " heads " + std::to_string(c.heads) + "/" + std::to_string(c.kv_heads) +
         " hd " + std::to_string(c.hd) + " w " + std::to_string(c.window) + " S " + std::to_string(c.sinks) + " RH " +
         std::to_string(c.RH) + " kq " + std::to_string(c.kq) + " kb " + std::to_string(c.kb) + " B " +
         std::to_string(c.block);
}

void check_case(const Case& c) {
  Problem P;
  make(P, c);
  EXPECT_LE(rel_err(run_fast(P), run_ref(P), P.s), kTol) << describe(c);
}

// Restores the thread count a test changes.
struct ThreadGuard {
  int saved = focus::num_threads();
  ~ThreadGuard() { focus::set_threads(saved); }
};

}  // namespace

TEST(GroupedAttention, MatchesReferenceAcrossHeadLayouts) {
  const int64_t layouts[3][2] = {{4, 4}, {6, 2}, {4, 1}};  // MHA, GQA, MQA
  const int64_t lengths[4] = {1, 63, 200, 333};
  const int64_t windows[3] = {1, 8, 70};
  const int kqs[3] = {1, 2, 4};
  int i = 0;
  for (const auto& hl : layouts)
    for (int64_t RH : {int64_t{1}, hl[1], hl[0]})
      for (int64_t n : lengths) {
        Case c;
        c.n = n;
        c.heads = hl[0];
        c.kv_heads = hl[1];
        c.RH = RH;
        c.window = windows[i % 3];
        c.sinks = (i / 3) % 2 ? 2 : 0;
        c.kq = kqs[(i / 2) % 3];
        c.hd = i % 4 == 3 ? 36 : 64;  // a head_dim that is not a whole number of vectors
        c.seed = 100 + i++;
        check_case(c);
      }
}

TEST(GroupedAttention, MatchesReferenceAcrossWindowsSinksSlots) {
  int i = 0;
  for (int64_t window : {1, 8, 70})
    for (int64_t sinks : {0, 2})
      for (int kq : {1, 2, 4}) {
        Case c;
        c.n = 200;
        c.heads = 6;
        c.kv_heads = 2;
        c.RH = 2;
        c.window = window;
        c.sinks = sinks;
        c.kq = kq;
        c.seed = 300 + i++;
        check_case(c);
      }
}

TEST(GroupedAttention, NoSlotsIsWindowAndSinks) {
  Case c;
  c.n = 150;
  c.window = 16;
  c.sinks = 3;
  c.unused = 1.0;  // every slot -1
  check_case(c);
}

TEST(GroupedAttention, EveryGroupIsDenseCausal) {
  for (int64_t n : {64, 257}) {
    Case c;
    c.n = n;
    c.heads = 6;
    c.kv_heads = 2;
    c.G = 5;
    c.kq = 5;
    c.unused = 0.0;
    c.RH = 3;
    c.window = 4;
    c.seed = (uint32_t)n;
    Problem P;
    make(P, c);
    Out dense{std::vector<float>(n * P.s.o_stride), std::vector<float>(P.s.heads * n)};
    focus::cpu::flash_attention(P.q.data(), P.k.data(), P.v.data(), dense.o.data(), dense.lse.data(), P.s);
    Out ref = dense;
    focus::cpu::attention_reference(P.q.data(), P.k.data(), P.v.data(), ref.o.data(), ref.lse.data(), P.s);
    const Out got = run_fast(P);
    EXPECT_LE(rel_err(got, dense, P.s), kTol) << n;
    EXPECT_LE(rel_err(got, ref, P.s), kTol) << n;
    // The last row alone (decoding path) as well.
    Problem D = P;
    D.s.q_pos0 = n - 1;
    D.s.n_q = 1;
    D.r.query_groups = P.query_groups.data() + (n - 1) * c.heads * c.kq;
    Out one{std::vector<float>(P.s.o_stride), std::vector<float>(P.s.heads)};
    focus::cpu::grouped_attention(P.q.data() + (n - 1) * P.s.q_stride, P.k.data(), P.v.data(), one.o.data(),
                                  one.lse.data(), D.s, D.r, P.idx);
    EXPECT_LE(rel_err(one, 1, 0, ref, n, n - 1, 1, c.heads, c.hd), kTol) << n;
  }
}

// Rows [t0, n) of a sequence against its full cache equal the same rows of one full call.
TEST(GroupedAttention, ChunksMatchOneCall) {
  Case c;
  c.n = 300;
  c.heads = 6;
  c.kv_heads = 2;
  c.RH = 6;
  c.kq = 2;
  c.window = 20;
  c.sinks = 2;
  Problem P;
  make(P, c);
  const Out full = run_fast(P);
  EXPECT_LE(rel_err(full, run_ref(P), P.s), kTol);
  for (int64_t rows : {5, 100}) {  // 5 rows: one task per (row, head, slice); 100: one per (row, head)
    const int64_t t0 = c.n - rows;
    const Out part = run_tail(P, rows);
    EXPECT_LE(rel_err(part, rows, 0, full, c.n, t0, rows, c.heads, c.hd), kTol) << rows;
  }
}

// One row over a long cache: the same bits with 1 and 2 threads, and the reference's values.
TEST(GroupedAttention, DecodingIndependentOfThreads) {
  ThreadGuard guard;
  Case c;
  c.n = 3000;
  c.heads = 6;
  c.kv_heads = 2;
  c.RH = 2;
  c.kq = 4;
  c.G = 16;
  c.unused = 0.0;
  c.window = 70;
  c.sinks = 2;
  Problem P;
  make(P, c);
  for (int64_t pos : {int64_t{2999}, int64_t{1500}}) {
    AttnShape s = P.s;
    s.q_pos0 = pos;
    s.n_q = 1;
    s.n_kv = pos + 1;
    GroupedRouting r = P.r;
    r.query_groups = P.query_groups.data() + pos * c.heads * c.kq;
    Out a[2];
    for (int th : {1, 2}) {
      focus::set_threads(th);
      Out& x = a[th - 1];
      x = {std::vector<float>(s.o_stride), std::vector<float>(s.heads)};
      focus::cpu::grouped_attention(P.q.data() + pos * s.q_stride, P.k.data(), P.v.data(), x.o.data(),
                                    x.lse.data(), s, r, P.idx);
    }
    EXPECT_EQ(a[0].o, a[1].o) << pos;
    EXPECT_EQ(a[0].lse, a[1].lse) << pos;
    // The reference reads key_group rows n_kv apart: the full cache's routing, cut to pos + 1 keys.
    std::vector<int32_t> kg;
    for (int64_t rh = 0; rh < c.RH; ++rh)
      kg.insert(kg.end(), P.key_group.begin() + rh * c.n, P.key_group.begin() + rh * c.n + pos + 1);
    r.key_group = kg.data();
    Out ref{std::vector<float>(s.o_stride), std::vector<float>(s.heads)};
    focus::cpu::grouped_attention_reference(P.q.data() + pos * s.q_stride, P.k.data(), P.v.data(), ref.o.data(),
                                            ref.lse.data(), s, r);
    EXPECT_LE(rel_err(a[0], ref, s), kTol) << pos;
  }
}

TEST(GroupedAttention, SelfAttentionIndependentOfThreads) {
  ThreadGuard guard;
  Case c;
  c.n = 333;
  c.heads = 6;
  c.kv_heads = 2;
  c.RH = 6;
  c.kq = 4;
  c.window = 8;
  c.sinks = 2;
  Problem P;
  make(P, c);
  focus::set_threads(1);
  const Out a = run_fast(P);
  focus::set_threads(2);
  const Out b = run_fast(P);
  EXPECT_EQ(a.o, b.o);
  EXPECT_EQ(a.lse, b.lse);
}

TEST(GroupedKeyIndex, AppendAndTruncateMatchBuild) {
  Case c;
  c.n = 500;
  c.RH = 3;
  c.heads = 6;
  c.kv_heads = 3;
  Problem P;
  make(P, c);
  GroupedKeyIndex inc;
  inc.reset(c.G, c.RH);
  std::vector<int32_t> rows;
  for (int64_t j0 = 0; j0 < c.n;) {
    const int64_t m = std::min<int64_t>(c.n - j0, j0 < 300 ? 37 : 1);  // chunks, then one key at a time
    rows.clear();
    for (int64_t rh = 0; rh < c.RH; ++rh)
      rows.insert(rows.end(), P.key_group.begin() + rh * c.n + j0, P.key_group.begin() + rh * c.n + j0 + m);
    inc.append(rows.data(), m);
    j0 += m;
  }
  EXPECT_EQ(inc.n_keys, c.n);
  EXPECT_EQ(inc.members, P.idx.members);
  EXPECT_EQ(inc.key_group, P.idx.key_group);
  // Rolled back to 250 keys and refilled: the same index again.
  inc.truncate(250);
  EXPECT_EQ(inc.n_keys, 250);
  for (const auto& m : inc.members) EXPECT_TRUE(m.empty() || m.back() < 250);
  for (const auto& g : inc.key_group) EXPECT_EQ(g.size(), 250u);
  rows.clear();
  for (int64_t rh = 0; rh < c.RH; ++rh)
    rows.insert(rows.end(), P.key_group.begin() + rh * c.n + 250, P.key_group.begin() + rh * c.n + c.n);
  inc.append(rows.data(), c.n - 250);
  EXPECT_EQ(inc.members, P.idx.members);
  EXPECT_EQ(inc.key_group, P.idx.key_group);
}

TEST(GroupedPairCount, MatchesBruteForce) {
  int i = 0;
  // Whole prefills, chunks, and a few rows over a long cache (there, with six routing heads, the
  // blocks are counted key by key; with two, from the blocks' group counts, as in a prefill);
  // grouped_pair_count and the count grouped_attention gives with its result.
  for (int64_t q_pos0 : {0, 37, 205})
    for (int64_t window : {1, 8, 70})
      for (int kq : {1, 3}) {
        Case c;
        c.kb = i % 3 == 2 ? 3 : 0;  // some with positional blocks (the hybrid pattern)
        c.n = 211;
        c.heads = 6;
        c.kv_heads = 2;
        c.RH = i % 2 ? 6 : 2;
        c.window = window;
        c.sinks = 2;
        c.kq = kq;
        c.seed = 700 + i++;
        Problem P;
        make(P, c);
        AttnShape s = P.s;
        s.q_pos0 = q_pos0;
        s.n_q = c.n - q_pos0;
        int64_t brute = 0;
        for (int64_t t = 0; t < s.n_q; ++t)
          for (int64_t h = 0; h < c.heads; ++h) {
            const int64_t p = q_pos0 + t, rh = h / (c.heads / c.RH);
            const int32_t* gs = P.query_groups.data() + (t * c.heads + h) * c.kq;
            const int32_t* bs = c.kb > 0 ? P.query_blocks.data() + (t * c.heads + h) * c.kb : nullptr;
            for (int64_t j = 0; j <= p; ++j) {
              const int32_t g = P.key_group[rh * c.n + j];
              const bool in_block =
                  c.kb > 0 && std::find(bs, bs + c.kb, (int32_t)(j / c.block)) != bs + c.kb;
              brute += p - j < window || j < s.sinks || std::find(gs, gs + c.kq, g) != gs + c.kq || in_block;
            }
          }
        EXPECT_EQ(focus::cpu::grouped_pair_count(s, P.r, P.idx), brute) << describe(c) << " q_pos0 " << q_pos0;
        // The kernel's own count, over float keys and over an f16 cache (whose few-row calls
        // decode from the cache as it is).
        std::vector<float> o(s.n_q * s.o_stride);
        int64_t pairs = -1;
        focus::cpu::grouped_attention(P.q.data(), P.k.data(), P.v.data(), o.data(), nullptr, s, P.r, P.idx, &pairs);
        EXPECT_EQ(pairs, brute) << describe(c) << " q_pos0 " << q_pos0;
        using focus::cpu::KvType;
        std::vector<uint8_t> kc(P.k.size() * focus::cpu::kv_type_bytes(KvType::F16)), vc(kc.size());
        focus::cpu::kv_store(P.k.data(), (int64_t)P.k.size(), KvType::F16, kc.data());
        focus::cpu::kv_store(P.v.data(), (int64_t)P.v.size(), KvType::F16, vc.data());
        pairs = -1;
        focus::cpu::grouped_attention(P.q.data(), focus::cpu::KvView(kc.data(), KvType::F16),
                                      focus::cpu::KvView(vc.data(), KvType::F16), o.data(), nullptr, s, P.r, P.idx,
                                      &pairs);
        EXPECT_EQ(pairs, brute) << "f16 cache, " << describe(c) << " q_pos0 " << q_pos0;
      }
}

// The hybrid pattern: positional blocks read besides the groups, over layouts, block sizes, windows
// and sinks; in prefill (every row gathered), in chunks and in decoding, against the reference.
TEST(GroupedAttention, HybridBlocksMatchReference) {
  const int64_t layouts[3][2] = {{4, 4}, {6, 2}, {4, 1}};
  int i = 0;
  for (const auto& hl : layouts)
    for (int64_t block : {1, 7, 32})
      for (int kb : {1, 3})
      for (float far : {0.f, 4.f}) {  // far-pair terms on every far pair read, the blocks' and the groups'
        Case c;
        c.n = 180 + 13 * i;
        c.heads = hl[0];
        c.kv_heads = hl[1];
        c.RH = i % 2 ? hl[1] : hl[0];
        c.window = i % 3 == 0 ? 1 : 20;
        c.sinks = i % 2 ? 2 : 0;
        c.kq = 1 + i % 3;
        c.kb = kb;
        c.block = block;
        c.hd = i % 4 == 3 ? 36 : 64;
        c.shared_groups = i % 4 < 2;  // decoding: a unit per kv head, the heads' own blocks hidden from the others
        c.far = far;
        c.seed = 900 + i++;
        Problem P;
        make(P, c);
        const Out ref = run_ref(P);
        EXPECT_LE(rel_err(run_fast(P), ref, P.s), kTol) << describe(c);
        for (int64_t rows : {1, 5, 60}) {  // decoding, a few rows, a chunk
          const int64_t t0 = c.n - rows;
          const Out part = run_tail(P, rows);
          EXPECT_LE(rel_err(part, rows, 0, ref, c.n, t0, rows, c.heads, c.hd), kTol)
              << describe(c) << " far " << far << " rows " << rows;
        }
      }
}

// Far-pair terms (a learned weighting of the far keys a row reads through its groups) against the
// reference: self-attention in tiles, decoding, a few rows and a chunk, over head layouts and
// routing granularities; terms of spread 8 make some rows' far keys dominate or vanish.
TEST(GroupedAttention, FarTermsMatchReference) {
  const int64_t layouts[3][2] = {{4, 4}, {6, 2}, {4, 1}};
  int i = 0;
  for (const auto& hl : layouts)
    for (float far : {0.5f, 8.f}) {
      Case c;
      c.n = 200 + 17 * i;
      c.heads = hl[0];
      c.kv_heads = hl[1];
      c.RH = i % 2 ? hl[1] : 1;
      c.window = i % 3 == 0 ? 1 : 24;
      c.sinks = i % 2 ? 0 : 2;
      c.kq = 1 + i % 3;
      c.hd = i % 4 == 3 ? 36 : 64;
      c.shared_groups = i % 4 < 2;
      c.far = far;
      c.seed = 1300 + i++;
      Problem P;
      make(P, c);
      const Out ref = run_ref(P);
      EXPECT_LE(rel_err(run_fast(P), ref, P.s), kTol) << describe(c) << " far " << far;
      for (int64_t rows : {1, 5, 60}) {  // decoding, a few rows, a chunk
        const Out part = run_tail(P, rows);
        EXPECT_LE(rel_err(part, rows, 0, ref, c.n, c.n - rows, rows, c.heads, c.hd), kTol)
            << describe(c) << " far " << far << " rows " << rows;
      }
      // The terms change the result (a kernel that dropped them would fail above), and zero terms are
      // the pattern without them.
      Problem Z = P;
      std::fill(Z.far_q.begin(), Z.far_q.end(), 0.f);
      std::fill(Z.far_k.begin(), Z.far_k.end(), 0.f);
      for (int64_t rh = 0; rh < c.RH; ++rh) {
        Z.far_qp[rh] = Z.far_q.data() + rh * c.n;
        Z.far_kp[rh] = Z.far_k.data() + rh * c.n;
      }
      Z.r.far_q = Z.far_qp.data();
      Z.r.far_k = Z.far_kp.data();
      Problem N = P;
      N.r.far_q = N.r.far_k = nullptr;
      EXPECT_LE(rel_err(run_fast(Z), run_fast(N), P.s), kTol) << describe(c);
      EXPECT_GT(rel_err(run_fast(N), ref, P.s), 100 * kTol) << describe(c);
    }
}

// A decoding step checks the far-pair terms of the keys it reads (a decoding step does not pass over
// the whole cache): a NaN term of a group key the row reads is an error naming that key; one of a
// key it does not read, or of a key inside the window (which carries no term), changes nothing.
TEST(GroupedAttention, DecodingRefusesANonFiniteFarTermItReads) {
  const Case c{.n = 300, .heads = 6, .kv_heads = 2, .window = 24, .sinks = 1, .RH = 2, .kq = 1, .unused = 0.0,
               .seed = 1400, .shared_groups = true, .far = 0.5f};
  Problem P;
  make(P, c);
  const int64_t t = c.n - 1, rh = 1, h = rh * (c.heads / c.RH);
  const int32_t g = P.query_groups[(t * c.heads + h) * c.kq];
  int64_t read = -1, unread = -1;
  for (int64_t j = c.sinks; j <= t - c.window; ++j) {
    const bool in = P.key_group[rh * c.n + j] == g;
    if (in && read < 0) read = j;
    if (!in && unread < 0) unread = j;
  }
  ASSERT_GE(read, 0);
  ASSERT_GE(unread, 0);
  auto with_nan = [&](int64_t j) {  // P with the term of key j under routing head rh set to NaN
    Problem Q = P;
    Q.far_k[rh * c.n + j] = NAN;
    for (int64_t x = 0; x < c.RH; ++x) Q.far_kp[x] = Q.far_k.data() + x * c.n;
    Q.r.far_k = Q.far_kp.data();
    return Q;
  };
  const Out ok = run_tail(P, 1);
  for (int64_t j : {unread, t}) EXPECT_EQ(run_tail(with_nan(j), 1).o, ok.o) << j;  // not read / near the row
  auto refused = [&](const std::function<void()>& step, const char* where) {
    try {
      step();
      ADD_FAILURE() << "a NaN far-pair term of key " << read << " (" << where << ") was read without an error";
    } catch (const focus::Error& e) {
      EXPECT_NE(std::string(e.what()).find("far-pair term of key " + std::to_string(read) + " (routing head 1)"),
                std::string::npos)
          << e.what();
    }
  };
  refused([&] { run_tail(with_nan(read), 1); }, "gathered");
  // The same from runs that hold the terms beside the keys: read from there, and refused there.
  {
    const Problem Q = with_nan(read);
    focus::cpu::GroupedKvRuns runs;
    runs.sync(Q.idx, Q.k.data(), Q.v.data(), c.kv_heads, c.hd, Q.s.kv_stride, Q.r.far_k);
    refused([&] { run_tail(Q, 1, Q.k.data(), Q.v.data(), &runs); }, "held in a run");
    const Problem U = with_nan(unread);
    focus::cpu::GroupedKvRuns fine;
    fine.sync(U.idx, U.k.data(), U.v.data(), c.kv_heads, c.hd, U.s.kv_stride, U.r.far_k);
    EXPECT_LE(rel_err(run_tail(U, 1, U.k.data(), U.v.data(), &fine), 1, 0, ok, 1, 0, 1, c.heads, c.hd), kTol);
  }
}

// Decoding that reads the groups' keys from their runs (GroupedKvRuns): the reference's values and,
// up to rounding, those of the gathered path; for float and half caches, over head layouts where
// the routing heads divide the kv heads, with far-pair terms, with blocks and with both.
TEST(GroupedAttention, DecodingFromGroupRunsMatchesReference) {
  using focus::cpu::GroupedKvRuns;
  using focus::cpu::KvType;
  using focus::cpu::KvView;
  const int64_t layouts[3][3] = {{4, 4, 4}, {6, 2, 2}, {6, 2, 1}};  // heads, kv heads, routing heads
  int i = 0;
  for (const auto& hl : layouts)
    for (KvType type : {KvType::F32, KvType::F16})
      for (int variant = 0; variant < 4; ++variant) {  // plain, far-pair terms, blocks, both
        Case c;
        c.n = 700 + 31 * i;  // long enough for groups of more than one slice (kSlice keys)
        c.heads = hl[0];
        c.kv_heads = hl[1];
        c.RH = hl[2];
        c.G = 3;
        c.window = i % 2 ? 1 : 40;
        c.sinks = i % 3 == 0 ? 0 : 2;
        c.kq = 1 + i % 2;
        c.hd = i % 4 == 3 ? 36 : 64;
        c.shared_groups = i % 4 != 1;
        c.far = variant == 1 || variant == 3 ? 4.f : 0.f;
        c.kb = variant >= 2 ? 2 : 0;
        c.seed = 1500 + i++;
        Problem P;
        make(P, c);
        focus::cpu::kv_round(P.k.data(), (int64_t)P.k.size(), type);  // the values the cache holds
        focus::cpu::kv_round(P.v.data(), (int64_t)P.v.size(), type);
        std::vector<uint8_t> kc(P.k.size() * focus::cpu::kv_type_bytes(type)), vc(kc.size());
        focus::cpu::kv_store(P.k.data(), (int64_t)P.k.size(), type, kc.data());
        focus::cpu::kv_store(P.v.data(), (int64_t)P.v.size(), type, vc.data());
        const KvView kv(kc.data(), type), vv(vc.data(), type);
        // With far-pair terms, runs that hold the terms beside the rows and runs that do not (the
        // kernel then gathers the terms from the routing's).
        GroupedKvRuns runs, with_terms;
        runs.sync(P.idx, kv, vv, c.kv_heads, c.hd, P.s.kv_stride);
        if (P.r.far_k) {
          with_terms.sync(P.idx, kv, vv, c.kv_heads, c.hd, P.s.kv_stride, P.r.far_k);
          for (size_t x = 0; x < with_terms.far.size(); ++x) {
            const int64_t rh = (int64_t)x / c.G;
            ASSERT_EQ((int64_t)with_terms.far[x].size(), with_terms.rows[x]);
            for (int64_t m = 0; m < with_terms.rows[x]; ++m)
              ASSERT_EQ(with_terms.far[x][m], P.r.far_k[rh][P.idx.members[x][m]]) << x << " " << m;
          }
        }
        const Out ref = run_ref(P);
        for (int64_t rows : {1, 3}) {
          const Out gathered = run_tail(P, rows, kv, vv);
          const int64_t t0 = c.n - rows;
          for (const GroupedKvRuns* rs : {&runs, &with_terms}) {
            if (rs->rows.empty()) continue;
            const Out fromruns = run_tail(P, rows, kv, vv, rs);
            EXPECT_LE(rel_err(fromruns, rows, 0, ref, c.n, t0, rows, c.heads, c.hd), kTol)
                << describe(c) << " variant " << variant << " rows " << rows << " terms " << !rs->far.empty();
            EXPECT_LE(rel_err(fromruns, rows, 0, gathered, rows, 0, rows, c.heads, c.hd), kTol)
                << describe(c) << " variant " << variant << " terms " << !rs->far.empty();
          }
        }
      }
}

// Runs kept across a rollback: truncated with the index, then brought up to date with keys of other
// groups and other values at the same positions; a decoding step reads the new rows, not the old.
TEST(GroupedAttention, GroupRunsFollowTruncateAndAppend) {
  using focus::cpu::GroupedKvRuns;
  const Case c{.n = 600, .heads = 6, .kv_heads = 2, .window = 16, .sinks = 1, .G = 4, .RH = 2, .kq = 2,
               .unused = 0.0, .seed = 1600, .shared_groups = true};
  Problem P;
  make(P, c);
  GroupedKvRuns runs;
  runs.sync(P.idx, P.k.data(), P.v.data(), c.kv_heads, c.hd, P.s.kv_stride);
  // The last 200 keys again, with new groups, keys and values (P2's), after a truncation to 400.
  Case c2 = c;
  c2.seed = 1601;
  Problem P2;
  make(P2, c2);
  const int64_t keep = 400;
  std::copy(P.key_group.begin(), P.key_group.begin() + keep, P2.key_group.begin());           // routing head 0
  std::copy(P.key_group.begin() + c.n, P.key_group.begin() + c.n + keep, P2.key_group.begin() + c.n);  // head 1
  std::copy(P.k.begin(), P.k.begin() + keep * P.s.kv_stride, P2.k.begin());
  std::copy(P.v.begin(), P.v.begin() + keep * P.s.kv_stride, P2.v.begin());
  P2.idx.build(P2.r, c.n);
  P.idx.truncate(keep);
  runs.truncate(P.idx, keep);
  std::vector<int32_t> tail;
  for (int64_t rh = 0; rh < c.RH; ++rh)
    tail.insert(tail.end(), P2.key_group.begin() + rh * c.n + keep, P2.key_group.begin() + (rh + 1) * c.n);
  P.idx.append(tail.data(), c.n - keep);
  runs.sync(P.idx, P2.k.data(), P2.v.data(), c.kv_heads, c.hd, P.s.kv_stride);
  EXPECT_EQ(runs.n_keys, c.n);
  EXPECT_TRUE(runs.far.empty());  // synced without far-pair terms: it holds none
  // The same rollback brought up to date one key at a time (as decoding does: a call then touches
  // only the groups of its new keys): the same runs as the one call above.
  {
    focus::cpu::GroupedKeyIndex one = P.idx;
    one.truncate(keep);
    GroupedKvRuns step = runs;
    step.truncate(one, keep);
    for (int64_t j = keep; j < c.n; ++j) {
      std::vector<int32_t> g;
      for (int64_t rh = 0; rh < c.RH; ++rh) g.push_back(P2.key_group[rh * c.n + j]);
      one.append(g.data(), 1);
      step.sync(one, P2.k.data(), P2.v.data(), c.kv_heads, c.hd, P.s.kv_stride);
    }
    EXPECT_EQ(step.n_keys, runs.n_keys);
    EXPECT_EQ(step.rows, runs.rows);
    for (size_t x = 0; x < runs.rows.size(); ++x) {
      EXPECT_TRUE(step.k[x] == runs.k[x]) << x;
      EXPECT_TRUE(step.v[x] == runs.v[x]) << x;
    }
  }
  // Runs holding far-pair terms (key j of routing head r: r * n + j; in the new sequence the keys
  // after the rollback point get the negated value): after the rollback each run's terms are those
  // of its members in the new sequence.
  {
    std::vector<float> f1(c.RH * c.n), f2(c.RH * c.n);
    for (int64_t x = 0; x < c.RH * c.n; ++x) f1[x] = (float)x, f2[x] = (float)(x < keep || (x >= c.n && x < c.n + keep) ? x : -x);
    const float* p1[2] = {f1.data(), f1.data() + c.n};
    const float* p2[2] = {f2.data(), f2.data() + c.n};
    GroupedKvRuns tr;
    Problem P1;
    make(P1, c);
    tr.sync(P1.idx, P1.k.data(), P1.v.data(), c.kv_heads, c.hd, P1.s.kv_stride, p1);
    P1.idx.truncate(keep);
    tr.truncate(P1.idx, keep);
    P1.idx.append(tail.data(), c.n - keep);
    tr.sync(P1.idx, P2.k.data(), P2.v.data(), c.kv_heads, c.hd, P1.s.kv_stride, p2);
    for (int64_t x = 0; x < (int64_t)tr.rows.size(); ++x) {
      ASSERT_EQ((int64_t)tr.far[x].size(), tr.rows[x]);
      for (int64_t m = 0; m < tr.rows[x]; ++m) EXPECT_EQ(tr.far[x][m], p2[x / c.G][P1.idx.members[x][m]]) << x << " " << m;
    }
    EXPECT_THROW(tr.sync(P1.idx, P2.k.data(), P2.v.data(), c.kv_heads, c.hd, P1.s.kv_stride), focus::Error);
  }
  for (int64_t x = 0; x < (int64_t)runs.rows.size(); ++x) EXPECT_EQ(runs.rows[x], (int64_t)P2.idx.members[x].size());
  const int64_t t = c.n - 1;
  AttnShape s = P2.s;
  s.q_pos0 = t;
  s.n_q = 1;
  GroupedRouting r = P2.r;
  r.query_groups = P2.query_groups.data() + t * c.heads * c.kq;
  r.runs = &runs;
  Out o{std::vector<float>(s.o_stride), std::vector<float>(s.heads)};
  focus::cpu::grouped_attention(P2.q.data() + t * s.q_stride, P2.k.data(), P2.v.data(), o.o.data(), o.lse.data(), s,
                                r, P.idx);
  EXPECT_LE(rel_err(o, 1, 0, run_ref(P2), c.n, t, 1, c.heads, c.hd), kTol);
  // Runs behind the cache (not brought up to date) are refused, not read.
  GroupedKvRuns stale;
  P.idx.truncate(keep);
  stale.sync(P.idx, P2.k.data(), P2.v.data(), c.kv_heads, c.hd, P.s.kv_stride);
  P.idx.append(tail.data(), c.n - keep);
  r.runs = &stale;
  EXPECT_THROW(focus::cpu::grouped_attention(P2.q.data() + t * s.q_stride, P2.k.data(), P2.v.data(), o.o.data(),
                                             o.lse.data(), s, r, P.idx),
               focus::Error);
  // Routing heads that do not divide the kv heads have no runs.
  Case c3 = c;
  c3.RH = 6;
  Problem P3;
  make(P3, c3);
  EXPECT_THROW(stale.sync(P3.idx, P3.k.data(), P3.v.data(), c.kv_heads, c.hd, P3.s.kv_stride), focus::Error);
}

// A key read only through a block whose far-pair term is not finite is refused by name, in decoding
// and over many rows; one that nothing reads is not looked at.
TEST(GroupedAttention, HybridRefusesANonFiniteFarTermItReadsThroughABlock) {
  const Case c{.n = 300, .heads = 6, .kv_heads = 2, .window = 24, .sinks = 1, .RH = 2, .kq = 1, .unused = 0.0,
               .seed = 1450, .kb = 2, .block = 8, .shared_groups = true, .far = 0.5f};
  Problem P;
  make(P, c);
  const int64_t t = c.n - 1, rh = 1, h = rh * (c.heads / c.RH);
  const int32_t g = P.query_groups[(t * c.heads + h) * c.kq];
  auto read_by_row = [&](int64_t j) {  // by any head of routing head rh in row t, through group or block
    for (int64_t x = rh * (c.heads / c.RH); x < (rh + 1) * (c.heads / c.RH); ++x) {
      if (P.key_group[rh * c.n + j] == P.query_groups[(t * c.heads + x) * c.kq]) return true;
      for (int s = 0; s < c.kb; ++s)
        if (P.query_blocks[(t * c.heads + x) * c.kb + s] == j / c.block) return true;
    }
    return false;
  };
  int64_t in_block = -1, unread = -1;
  for (int64_t j = c.sinks; j <= t - c.window; ++j) {
    const bool grouped = P.key_group[rh * c.n + j] == g;
    const bool blocked = P.query_blocks[(t * c.heads + h) * c.kb] == j / c.block;
    if (blocked && !grouped && in_block < 0) in_block = j;
    if (!read_by_row(j) && unread < 0) unread = j;
  }
  ASSERT_GE(in_block, 0);
  ASSERT_GE(unread, 0);
  auto with_nan = [&](int64_t j) {
    Problem Q = P;
    Q.far_k[rh * c.n + j] = NAN;
    for (int64_t x = 0; x < c.RH; ++x) Q.far_kp[x] = Q.far_k.data() + x * c.n;
    Q.r.far_k = Q.far_kp.data();
    return Q;
  };
  EXPECT_EQ(run_tail(with_nan(unread), 1).o, run_tail(P, 1).o);
  const std::string named = "far-pair term of key " + std::to_string(in_block) + " (routing head 1)";
  for (int64_t rows : {int64_t{1}, c.n}) {  // decoding; the whole sequence (the tiled pass checks every far key)
    try {
      run_tail(with_nan(in_block), rows);
      ADD_FAILURE() << "a NaN far-pair term of key " << in_block << " was read without an error, rows " << rows;
    } catch (const focus::Error& e) {
      EXPECT_NE(std::string(e.what()).find(named), std::string::npos) << e.what();
    }
  }
}

// Blocks that hold every key make the hybrid pattern dense causal attention, whatever the groups.
TEST(GroupedAttention, HybridAllBlocksIsDenseCausal) {
  const Case c{.n = 130, .heads = 6, .kv_heads = 2, .window = 3, .RH = 2, .unused = 0.0, .kb = 13, .block = 10};
  Problem P;
  make(P, c);
  Out ref{std::vector<float>(c.n * P.s.o_stride), std::vector<float>(P.s.heads * c.n)};
  focus::cpu::attention_reference(P.q.data(), P.k.data(), P.v.data(), ref.o.data(), ref.lse.data(), P.s);
  EXPECT_LE(rel_err(run_fast(P), ref, P.s), kTol);
}

// The lists' check reads a prefill's lists in parallel; whatever the threads, the error names the
// first list in order that breaks a rule (an id out of range, or one listed twice), and its slot.
TEST(GroupedAttention, ListCheckNamesTheFirstBadList) {
  const Case c{.n = 1100, .heads = 4, .kv_heads = 2, .window = 8, .RH = 2, .unused = 0.0, .kb = 20, .block = 1};
  Problem P;
  make(P, c);
  Out o{std::vector<float>(c.n * P.s.o_stride), std::vector<float>(P.s.heads * c.n)};
  const int saved = focus::num_threads();
  auto message = [&](const std::vector<int32_t>& qb) {
    GroupedRouting r = P.r;
    r.query_blocks = qb.data();
    try {
      focus::cpu::grouped_attention(P.q.data(), P.k.data(), P.v.data(), o.o.data(), o.lse.data(), P.s, r, P.idx);
    } catch (const focus::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  for (int threads : {1, 2, 3}) {
    focus::set_threads(threads);
    std::vector<int32_t> qb = P.query_blocks;
    qb[(1000 * c.heads + 3) * c.kb + 5] = (int32_t)c.n;  // row 1000: past the last block
    qb[(700 * c.heads + 1) * c.kb + 2] = 7;  // row 700, head 1: block 7 twice
    qb[(700 * c.heads + 1) * c.kb + 3] = 7;
    EXPECT_NE(message(qb).find("row 700, head 1 lists block 7 twice"), std::string::npos) << message(qb);
    qb[(900 * c.heads + 2) * c.kb + 6] = -2;  // a later bad list changes nothing
    EXPECT_NE(message(qb).find("row 700, head 1 lists block 7 twice"), std::string::npos) << message(qb);
    qb[(400 * c.heads) * c.kb + 9] = -3;  // an earlier one is named instead, with its slot
    EXPECT_NE(message(qb).find("block id -3 (row 400, head 0, slot 9) outside [-1, 1100)"), std::string::npos)
        << message(qb);
    EXPECT_EQ(message(P.query_blocks), "no error") << threads << " threads";
  }
  focus::set_threads(saved);
}

TEST(GroupedAttention, BadIdsThrow) {
  Case c;
  c.n = 50;
  Problem P;
  make(P, c);
  Out o = run_ref(P);
  auto fast = [&](const GroupedRouting& r, const GroupedKeyIndex& idx) {
    focus::cpu::grouped_attention(P.q.data(), P.k.data(), P.v.data(), o.o.data(), o.lse.data(), P.s, r, idx);
  };
  // Key side: an id of G or -1 is refused by the index, which stays as it was.
  GroupedKeyIndex idx = P.idx;
  const int32_t bad_hi = (int32_t)c.G, bad_lo = -1;
  EXPECT_THROW(idx.append(&bad_hi, 1), focus::Error);
  EXPECT_THROW(idx.append(&bad_lo, 1), focus::Error);
  EXPECT_EQ(idx.members, P.idx.members);
  EXPECT_EQ(idx.key_group, P.idx.key_group);
  EXPECT_EQ(idx.n_keys, c.n);
  std::vector<int32_t> kg = P.key_group;
  kg[17] = (int32_t)c.G;
  GroupedRouting r = P.r;
  r.key_group = kg.data();
  EXPECT_THROW(idx.build(r, c.n), focus::Error);

  // Query side: an id of G, below -1, or listed twice.
  for (int32_t bad : {(int32_t)c.G, int32_t{-2}}) {
    std::vector<int32_t> qg = P.query_groups;
    qg[5] = bad;
    r = P.r;
    r.query_groups = qg.data();
    EXPECT_THROW(fast(r, P.idx), focus::Error) << bad;
  }
  std::vector<int32_t> qg = P.query_groups;
  qg[2 * c.kq] = 3;
  qg[2 * c.kq + 1] = 3;
  r = P.r;
  r.query_groups = qg.data();
  EXPECT_THROW(fast(r, P.idx), focus::Error);
  // Blocks: an id past the last block, below -1, listed twice, or slots with no list.
  std::vector<int32_t> qb(c.n * c.heads * 2, -1);
  r = P.r;
  r.block_size = 16;
  r.kb = 2;
  r.query_blocks = qb.data();
  EXPECT_NO_THROW(fast(r, P.idx));
  for (int32_t bad : {int32_t{4}, int32_t{-2}}) {  // 50 keys: blocks 0 .. 3
    qb[7] = bad;
    EXPECT_THROW(fast(r, P.idx), focus::Error) << bad;
  }
  qb[6] = qb[7] = 1;
  EXPECT_THROW(fast(r, P.idx), focus::Error);
  r.query_blocks = nullptr;
  EXPECT_THROW(fast(r, P.idx), focus::Error);
  // Far-pair terms: one side only, a non-finite term (with blocks: HybridRefusesANonFiniteFarTermItReadsThroughABlock).
  std::vector<float> fq(c.n, 0.f), fk(c.n, 0.f);
  const float* fqp = fq.data();
  const float* fkp = fk.data();
  r = P.r;
  r.far_q = &fqp;
  EXPECT_THROW(fast(r, P.idx), focus::Error);
  r.far_k = &fkp;
  EXPECT_NO_THROW(fast(r, P.idx));
  std::fill(fk.begin(), fk.end(), NAN);  // (a key's term is checked where a row reads it)
  EXPECT_THROW(fast(r, P.idx), focus::Error);
  AttnShape one = P.s;  // decoding: the last row alone
  one.q_pos0 = c.n - 1;
  one.n_q = 1;
  GroupedRouting rl = r;
  rl.query_groups = P.query_groups.data() + (c.n - 1) * c.heads * c.kq;
  const float* fq_last = fq.data() + c.n - 1;
  rl.far_q = &fq_last;
  EXPECT_THROW(focus::cpu::grouped_attention(P.q.data() + (c.n - 1) * P.s.q_stride, P.k.data(), P.v.data(), o.o.data(),
                                             o.lse.data(), one, rl, P.idx),
               focus::Error);
  std::fill(fk.begin(), fk.end(), 0.f);
  fq[3] = INFINITY;
  EXPECT_THROW(fast(r, P.idx), focus::Error);
  fq[3] = 0.f;
  // An index of another routing, or too short.
  GroupedKeyIndex other;
  other.reset(c.G + 1, c.RH);
  EXPECT_THROW(fast(P.r, other), focus::Error);
  EXPECT_THROW(focus::cpu::grouped_pair_count(P.s, P.r, other), focus::Error);
  idx = P.idx;
  idx.truncate(c.n - 1);
  EXPECT_THROW(fast(P.r, idx), focus::Error);
  EXPECT_THROW(focus::cpu::grouped_pair_count(P.s, P.r, idx), focus::Error);
  EXPECT_THROW(idx.truncate(c.n), focus::Error);

  // Block lists over a prefill (block top-k's pass): an id past the last block or below -1 in a
  // row with far keys is refused before anything is read; -1 is no block.
  std::vector<int32_t> lists(c.n * c.heads * 2, -1);
  auto listed = [&] {
    focus::cpu::block_list_attention(P.q.data(), P.k.data(), P.v.data(), o.o.data(), o.lse.data(), P.s, 16,
                                     lists.data(), 2);
  };
  EXPECT_NO_THROW(listed());
  for (int32_t bad : {int32_t{4}, int32_t{-2}}) {  // 50 keys: blocks 0 .. 3
    lists[(20 * c.heads + 1) * 2 + 1] = bad;
    const std::string e = focus::test::error_of(listed);
    EXPECT_NE(e.find("block " + std::to_string(bad) + " outside the 4 blocks of 50 keys"), std::string::npos) << e;
  }
  lists[(20 * c.heads + 1) * 2 + 1] = 3;
  EXPECT_NO_THROW(listed());
}
