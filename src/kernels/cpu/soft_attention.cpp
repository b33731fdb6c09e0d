#include "kernels/cpu/soft_attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/simd.h"
#include "kernels/cpu/tile_engine.h"

namespace focus::cpu {
namespace {

using namespace simd;

constexpr int kB = 64;  // query rows and keys per tile
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
static_assert(kB % kV == 0, "a tile row is whole vectors");

// ---- small GEMM: C[M, Nn] (=|+=) A(M x K) . B[K, Nn] with A(m, k) = TA ? a[k*lda + m] : a[m*lda + k].
// Nn is a multiple of kV; MR x NV register blocks (kGemmRows x kGemmVecs vectors in the bulk).
template <bool TA, int MR, int NV>
inline void gemm_block(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc, int K,
                       bool acc) {
  vf r[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) r[i][j] = acc ? load(c + i * ldc + j * kV) : vf{};
  for (int p = 0; p < K; ++p) {
    vf bv[NV];
    for (int j = 0; j < NV; ++j) bv[j] = load_reg(b + p * ldb + j * kV);
    for (int i = 0; i < MR; ++i) {
      const vf av = bcast(TA ? a[p * lda + i] : a[i * lda + p]);
      for (int j = 0; j < NV; ++j) r[i][j] = vfma(av, bv[j], r[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) store(c + i * ldc + j * kV, r[i][j]);
}

// Rows in blocks of kGemmRows, then what is left in blocks of 4, 2 and 1.
template <bool TA, int NV>
void gemm_rows(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc, int M, int K,
               bool acc) {
  auto ap = [&](int m) { return TA ? a + m : a + m * lda; };
  int m = 0;
  for (; m + kGemmRows <= M; m += kGemmRows)
    gemm_block<TA, kGemmRows, NV>(ap(m), lda, b, ldb, c + m * ldc, ldc, K, acc);
  if constexpr (kGemmRows > 4)
    if (m + 4 <= M) gemm_block<TA, 4, NV>(ap(m), lda, b, ldb, c + m * ldc, ldc, K, acc), m += 4;
  if (m + 2 <= M) gemm_block<TA, 2, NV>(ap(m), lda, b, ldb, c + m * ldc, ldc, K, acc), m += 2;
  if (m < M) gemm_block<TA, 1, NV>(ap(m), lda, b, ldb, c + m * ldc, ldc, K, acc);
}

template <bool TA>
void gemm(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc, int M, int K, int Nn,
          bool acc) {
  for_chunks<kGemmVecs>(Nn / kV, [&]<int NV>(int j0) {
    gemm_rows<TA, NV>(a, lda, b + j0 * kV, ldb, c + j0 * kV, ldc, M, K, acc);
  });
}

// ---- packing. Row tiles: the rows of tile b (tokens b*64 .. b*64+nr-1) of all `heads` heads lie at
// [b*64*heads, b*64*heads + heads*nr), ordered (head, token), each padded to hdp floats. The heads of
// one KV group are then one contiguous block of rows.
struct Dims {
  int64_t n, H, KVH, gs, hd, hdp, G, Gp, nb;
  int64_t RH = 1;  // routers; kv head kvh reads router kvh / (KVH / RH)
  int64_t router_of(int64_t kvh) const { return kvh / (KVH / RH); }
};

inline int tile_len(int64_t n, int64_t b) { return (int)std::min<int64_t>(kB, n - b * kB); }
inline int64_t row_index(int64_t n, int64_t heads, int64_t i, int64_t h) {
  const int64_t b = i / kB;
  return b * kB * heads + h * tile_len(n, b) + (i - b * kB);
}

// src [n, heads, hd] -> row tiles [n * heads, hdp], times scale.
void pack_rows(const float* src, int64_t n, int64_t heads, int64_t hd, int64_t hdp, float scale, float* dst) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < heads; ++h) {
      const float* s = src + (i * heads + h) * hd;
      float* d = dst + row_index(n, heads, i, h) * hdp;
      for (int64_t e = 0; e < hd; ++e) d[e] = s[e] * scale;
      for (int64_t e = hd; e < hdp; ++e) d[e] = 0.f;
    }
}

// src [n, heads, hd] -> transposed tiles [nb, heads, hdp, 64] (zero padding in both dims).
void pack_cols(const float* src, int64_t n, int64_t heads, int64_t hd, int64_t hdp, float* dst) {
  const int64_t nb = (n + kB - 1) / kB;
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < nb * heads; ++bh) {
    const int64_t b = bh / heads, h = bh % heads;
    const int cols = tile_len(n, b);
    float* d = dst + bh * hdp * kB;
    std::fill(d, d + hdp * kB, 0.f);
    for (int c = 0; c < cols; ++c) {
      const float* s = src + ((b * kB + c) * heads + h) * hd;
      for (int64_t e = 0; e < hd; ++e) d[e * kB + c] = s[e];
    }
  }
}

// p [n, G] -> pp [n, Gp] (zero-padded rows) and, if pt is not null, pt [nb, G, 64] (transposed tiles).
void pack_p(const float* p, const Dims& d, float* pp, float* pt) {
  std::fill(pp, pp + d.n * d.Gp, 0.f);
  if (pt) std::fill(pt, pt + d.nb * d.G * kB, 0.f);
  for (int64_t i = 0; i < d.n; ++i)
    for (int64_t g = 0; g < d.G; ++g) {
      FOCUS_CHECK(p[i * d.G + g] >= 0.f && p[i * d.G + g] <= 3.4e38f, "soft attention: router probability p[", i,
                  ", ", g, "] = ", p[i * d.G + g], " is negative or not finite");
      pp[i * d.Gp + g] = p[i * d.G + g];
      if (pt) pt[((i / kB) * d.G + g) * kB + i % kB] = p[i * d.G + g];
    }
}

// The packed memberships of every router: queries' rows pq, keys' rows pk and transposed tiles kt
// (pk aliases pq when the keys use the queries' memberships).
struct PackedP {
  std::vector<float> pq, pk, kt;
  int64_t rows = 0, tiles = 0;  // floats per router in pq/pk and in kt
  const float* q(int64_t r) const { return pq.data() + r * rows; }
  const float* k(int64_t r) const { return (pk.empty() ? pq.data() : pk.data()) + r * rows; }
  const float* t(int64_t r) const { return kt.data() + r * tiles; }
};

PackedP pack_memberships(const float* p, const SoftKeys& keys, const Dims& d) {
  PackedP pp;
  if (!p) return pp;
  pp.rows = d.n * d.Gp;
  pp.tiles = d.nb * d.G * kB;
  const int64_t in = d.n * d.G;
  pp.pq.resize(d.RH * pp.rows);
  pp.kt.resize(d.RH * pp.tiles);
  if (keys.pk) pp.pk.resize(d.RH * pp.rows);
  for (int64_t r = 0; r < d.RH; ++r) {
    if (keys.pk) {
      pack_p(p + r * in, d, pp.pq.data() + r * pp.rows, nullptr);
      pack_p(keys.pk + r * in, d, pp.pk.data() + r * pp.rows, pp.kt.data() + r * pp.tiles);
    } else {
      pack_p(p + r * in, d, pp.pq.data() + r * pp.rows, pp.kt.data() + r * pp.tiles);
    }
  }
  return pp;
}

// ---- the additive tile: masking and the Focus bias of one (query tile, key tile) pair.
struct TileInfo {
  bool mask;        // some pair is invisible (causal diagonal, sliding window, padding)
  bool biased;      // some pair carries the bias
  bool all_biased;  // every pair carries the bias
  bool add() const { return mask || biased; }  // the scores need the additive tile
  // Additive tiles a tile needs (one per router when biased, else one mask tile shared by all),
  // and which of them router r reads.
  int64_t add_tiles(int64_t routers) const { return biased ? routers : 1; }
  int64_t add_tile_of(int64_t router) const { return biased ? router : 0; }
};

TileInfo classify(const AttnShape& s, bool has_p, int64_t t0, int nr, int64_t j0, int cols) {
  const int64_t i_lo = t0, i_hi = t0 + nr - 1, j_lo = j0, j_hi = j0 + cols - 1;
  TileInfo info{j_hi > i_lo || cols < kB, false, false};
  if (s.sliding_window > 0 && i_hi - j_lo >= s.sliding_window) info.mask = true;
  if (has_p) {
    const int64_t jb = std::max(j_lo, s.sinks);  // first non-sink key
    info.biased = jb <= j_hi && i_hi - jb >= s.local_window;
    info.all_biased = j_lo >= s.sinks && i_lo - j_hi >= s.local_window;
  }
  return info;
}

// add [nr, 64] holds A = p_q . p_k^T where biased; makes it -inf where masked, log(A + eps) where
// biased, 0 elsewhere; inv [nr, 64] (if not null) = 1 / (A + eps) where biased and visible, 0 elsewhere.
void finish_tile(const AttnShape& s, int64_t t0, int nr, int64_t j0, int cols, const TileInfo& info, float* add,
                 float* inv) {
  for (int t = 0; t < nr; ++t) {
    float* ar = add + t * kB;
    float* ir = inv ? inv + t * kB : nullptr;
    if (info.biased)
      for (int c = 0; c < kB; c += kV) {
        const vf a = load(ar + c) + s.eps;
        store(ar + c, vlog(a));
        if (ir) store(ir + c, 1.f / a);
      }
    if (info.all_biased && !info.mask) continue;
    const int64_t i = t0 + t;
    const int64_t vis_hi = std::clamp<int64_t>(i - j0 + 1, 0, cols);
    const int64_t vis_lo = s.sliding_window > 0 ? std::clamp<int64_t>(i - s.sliding_window + 1 - j0, 0, cols) : 0;
    const int64_t b_lo = info.biased ? std::clamp<int64_t>(s.sinks - j0, 0, kB) : kB;
    const int64_t b_hi = info.biased ? std::clamp<int64_t>(i - s.local_window - j0 + 1, 0, kB) : 0;
    for (int c = 0; c < kB; ++c) {
      const bool vis = c >= vis_lo && c < vis_hi;
      if (vis && c >= b_lo && c < b_hi) continue;  // biased: keep log(A + eps)
      ar[c] = vis ? 0.f : kNegInf;
      if (ir) ir[c] = 0.f;
    }
  }
}

// The group product A = p_q . p_k^T of a biased tile into a [nr, 64].
void group_tile(const Dims& d, const float* pp, const float* pt, int64_t t0, int nr, int64_t j0, float* a) {
  gemm<false>(pp + t0 * d.Gp, d.Gp, pt + (j0 / kB) * d.G * kB, kB, a, kB, nr, (int)d.G, kB, false);
}

// The additive tile of one router (and inv, if not null): finish_tile of its group product.
void build_tile(const AttnShape& s, const Dims& d, const float* pp, const float* pt, int64_t t0, int nr,
                int64_t j0, int cols, const TileInfo& info, float* add, float* inv) {
  if (info.biased) group_tile(d, pp, pt, t0, nr, j0, add);
  finish_tile(s, t0, nr, j0, cols, info, add, inv);
}

// The hybrid's positional blocks (SoftKeys::block_bits) and the pair weights of what they read:
// fq, fk [RH, N] = exp of the far-pair terms (1 without them).
struct Blocks {
  const uint64_t* bits = nullptr;
  int64_t size = 0, words = 0;
  std::vector<float> fq, fk;
  const int64_t* head_groups = nullptr;  // SoftKeys::head_groups
  explicit operator bool() const { return bits != nullptr; }
  bool groups_of(int64_t h) const { return !head_groups || head_groups[h] != 0; }
  bool reads(int64_t h, int64_t n, int64_t i, int64_t j) const {
    const int64_t b = j / size;
    return (bits[(h * n + i) * words + (b >> 6)] >> (b & 63)) & 1u;
  }
};

Blocks make_blocks(const SoftKeys& keys, const Dims& d) {
  Blocks b;
  if (!keys.block_bits) return b;
  b.bits = keys.block_bits;
  b.size = keys.block_size;
  b.words = keys.block_words;
  b.head_groups = keys.head_groups;
  b.fq.assign(d.RH * d.n, 1.f);
  b.fk.assign(d.RH * d.n, 1.f);
  for (int64_t x = 0; x < d.RH * d.n; ++x) {
    if (keys.eq) b.fq[x] = std::exp(keys.eq[x]);
    if (keys.ek) b.fk[x] = std::exp(keys.ek[x]);
    FOCUS_CHECK(std::isfinite(b.fq[x]) && std::isfinite(b.fk[x]), "soft attention: far-pair term of row ", x % d.n,
                " (router ", x / d.n, ") is not finite or too large: ", keys.eq ? keys.eq[x] : 0.f, ", ",
                keys.ek ? keys.ek[x] : 0.f);
  }
  return b;
}

// The additive tile of query head h of a biased tile under blocks: its router's group product
// `group` (zero for a head that reads no group) with the cells of the blocks h reads set to their
// weight fq(i) fk(j); those weights also go to blk [nr, 64] (0 elsewhere) when it is not null.
// Then finish_tile.
void head_tile(const AttnShape& s, const Dims& d, const Blocks& b, const float* group, int64_t h, int64_t t0, int nr,
               int64_t j0, int cols, const TileInfo& info, float* add, float* inv, float* blk) {
  const int64_t r = d.router_of(h / d.gs);
  const float* fq = b.fq.data() + r * d.n;
  const float* fk = b.fk.data() + r * d.n;
  if (b.groups_of(h))
    std::copy(group, group + nr * kB, add);
  else
    std::fill(add, add + nr * kB, 0.f);
  if (blk) std::fill(blk, blk + nr * kB, 0.f);
  for (int t = 0; t < nr; ++t) {
    const int64_t i = t0 + t;
    const int last = (int)std::clamp<int64_t>(i - j0 + 1, 0, cols);  // causal: keys up to i
    for (int c = 0; c < last; ++c) {
      if (!b.reads(h, d.n, i, j0 + c)) continue;
      const float w = fq[i] * fk[j0 + c];
      add[t * kB + c] = w;
      if (blk) blk[t * kB + c] = w;
    }
  }
  finish_tile(s, t0, nr, j0, cols, info, add, inv);
}

void check_shape(const char* who, const AttnShape& s, bool has_p, const SoftKeys& keys) {
  FOCUS_CHECK(keys.route_heads >= 1 && s.kv_heads % keys.route_heads == 0, who, ": routers (", keys.route_heads,
              ") must divide kv_heads (", s.kv_heads, ")");
  FOCUS_CHECK(keys.route_heads == 1 || keys.pk, who, ": several routers need the keys' memberships (pk)");
  FOCUS_CHECK(has_p || !keys.pk, who, ": keys' memberships without the queries'");
  FOCUS_CHECK(s.n_q >= 0, who, ": negative token count ", s.n_q);
  FOCUS_CHECK(s.n_kv == s.n_q && s.q_pos0 == 0, who, ": self-attention needs n_kv == n_q (", s.n_kv, " vs ", s.n_q,
              ") and q_pos0 == 0 (got ", s.q_pos0, ")");
  FOCUS_CHECK(s.heads >= 1 && s.kv_heads >= 1 && s.heads % s.kv_heads == 0, who, ": heads (", s.heads,
              ") must be a positive multiple of kv_heads (", s.kv_heads, ")");
  FOCUS_CHECK(s.head_dim >= 1, who, ": head_dim must be >= 1, got ", s.head_dim);
  const int64_t qw = s.heads * s.head_dim, kw = s.kv_heads * s.head_dim;
  FOCUS_CHECK((s.q_stride == 0 || s.q_stride == qw) && (s.o_stride == 0 || s.o_stride == qw) &&
                  (s.kv_stride == 0 || s.kv_stride == kw),
              who, ": rows must be contiguous (strides 0 or the row width)");
  FOCUS_CHECK(s.local_window >= 0 && s.sinks >= 0 && s.sliding_window >= 0, who,
              ": local_window, sinks and sliding_window must be >= 0");
  FOCUS_CHECK(std::isfinite(s.scale), who, ": scale must be finite");
  FOCUS_CHECK(!keys.head_groups || keys.block_bits, who, ": heads without groups (head_groups) need blocks");
  if (keys.block_bits) {
    FOCUS_CHECK(has_p, who, ": blocks need the groups' memberships");
    FOCUS_CHECK(keys.block_size >= 1 && keys.block_words >= ((s.n_q + keys.block_size - 1) / keys.block_size + 63) / 64,
                who, ": blocks of ", keys.block_size, " keys need ", ((s.n_q + std::max<int64_t>(1, keys.block_size) - 1) /
                std::max<int64_t>(1, keys.block_size) + 63) / 64, " words per row, got ", keys.block_words);
  }
  if (has_p) {
    FOCUS_CHECK(s.groups >= 1, who, ": groups must be >= 1 when p is given, got ", s.groups);
    FOCUS_CHECK(s.eps >= std::numeric_limits<float>::min() && std::isfinite(s.eps), who,
                ": eps must be a positive normal float, got ", s.eps);
  }
}

Dims make_dims(const AttnShape& s, bool has_p, const SoftKeys& keys) {
  Dims d;
  d.RH = keys.route_heads;
  d.n = s.n_q;
  d.H = s.heads;
  d.KVH = s.kv_heads;
  d.gs = s.heads / s.kv_heads;
  d.hd = s.head_dim;
  d.hdp = round_up(s.head_dim);
  d.G = has_p ? s.groups : 0;
  d.Gp = has_p ? round_up(s.groups) : 0;
  d.nb = (s.n_q + kB - 1) / kB;
  return d;
}

// Key tiles a query tile needs: [lo, qb].
inline int64_t first_key_tile(const AttnShape& s, int64_t t0) {
  return s.sliding_window > 0 ? std::max<int64_t>(0, t0 - s.sliding_window + 1) / kB : 0;
}
// Query tiles a key tile feeds: [kb, hi].
inline int64_t last_query_tile(const AttnShape& s, const Dims& d, int64_t kb) {
  if (s.sliding_window <= 0) return d.nb - 1;
  const int64_t j_hi = std::min<int64_t>(d.n, (kb + 1) * kB) - 1;
  return std::min<int64_t>(d.nb - 1, (j_hi + s.sliding_window - 1) / kB);
}

}  // namespace

void soft_attention_forward(const float* q, const float* k, const float* v, const float* p, float* o, float* lse,
                            const AttnShape& s, const SoftKeys& keys) {
  const bool has_p = p != nullptr;
  check_shape("soft_attention_forward", s, has_p, keys);
  if (s.n_q == 0) return;
  FOCUS_CHECK(q && k && v && o, "soft_attention_forward: null q, k, v or o");
  const Dims d = make_dims(s, has_p, keys);
  const int64_t hdp = d.hdp;

  // Shared packed operands: K^T tiles, V row tiles, the memberships of every router.
  std::vector<float> ktp(d.nb * d.KVH * hdp * kB), vp(d.n * d.KVH * hdp);
  pack_cols(k, d.n, d.KVH, d.hd, hdp, ktp.data());
  pack_rows(v, d.n, d.KVH, d.hd, hdp, 1.f, vp.data());
  const PackedP pm = pack_memberships(p, keys, d);
  const Blocks blocks = make_blocks(keys, d);

  // The tile engine's online softmax, one query tile of every head at a time; the additive tile
  // (bias and mask) of a (query tile, key tile) pair is made once per router for its heads.
#pragma omp parallel
  {
    std::vector<tiles::QueryTile> qts(d.H, tiles::QueryTile(hdp));
    std::vector<tiles::AlignedFloats> add(d.RH, tiles::AlignedFloats(kB * kB));
    std::vector<tiles::AlignedFloats> head_add(blocks ? d.H : 0, tiles::AlignedFloats(kB * kB));
    tiles::RowSpan spans[kB];
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < d.nb; ++it) {
      const int64_t qb = d.nb - 1 - it;  // heavy (late) query tiles first
      const int64_t t0 = qb * kB;
      const int nr = tile_len(d.n, qb);
      for (int64_t h = 0; h < d.H; ++h) {
        qts[h].reset(nr);
        for (int r = 0; r < nr; ++r) qts[h].load_row(r, q + ((t0 + r) * d.H + h) * d.hd, d.hd, s.scale);
      }
      for (int64_t kb = first_key_tile(s, t0); kb <= qb; ++kb) {
        const int64_t j0 = kb * kB;
        const int cols = tile_len(d.n, kb);
        const TileInfo info = classify(s, has_p, t0, nr, j0, cols);
        // A tile without bias is the mask alone, the same for every router: made once.
        const int64_t tiles_made = info.add_tiles(d.RH);
        const bool per_head = blocks && info.biased;  // blocks: one additive tile per head
        if (per_head) {
          for (int64_t r = 0; r < d.RH; ++r) group_tile(d, pm.q(r), pm.t(r), t0, nr, j0, add[r].data());
          for (int64_t h = 0; h < d.H; ++h)
            head_tile(s, d, blocks, add[d.router_of(h / d.gs)].data(), h, t0, nr, j0, cols, info, head_add[h].data(),
                      nullptr, nullptr);
        } else if (info.add()) {
          for (int64_t r = 0; r < tiles_made; ++r)
            build_tile(s, d, has_p ? pm.q(r) : nullptr, has_p ? pm.t(r) : nullptr, t0, nr, j0, cols, info,
                       add[r].data(), nullptr);
        }
        for (int r = 0; r < nr; ++r) {  // causal, within the sliding window
          const int64_t i = t0 + r;
          spans[r] = {};
          spans[r].hi0 = (int)std::clamp<int64_t>(i - j0 + 1, 0, cols);
          spans[r].lo0 = s.sliding_window > 0 ? (int)std::clamp<int64_t>(i - s.sliding_window + 1 - j0, 0, cols) : 0;
        }
        for (int64_t kvh = 0; kvh < d.KVH; ++kvh) {
          const float* kt = ktp.data() + (kb * d.KVH + kvh) * hdp * kB;
          const float* vt = vp.data() + (kb * kB * d.KVH + kvh * cols) * hdp;
          for (int64_t h = kvh * d.gs; h < (kvh + 1) * d.gs; ++h) {
            const float* at = per_head ? head_add[h].data() : add[info.add_tile_of(d.router_of(kvh))].data();
            if (info.add())
              qts[h].visit<tiles::ExpMode::FastWhenFull, true>(kt, vt, hdp, 0, nr, spans, nullptr, at);
            else
              qts[h].visit<tiles::ExpMode::FastWhenFull>(kt, vt, hdp, 0, nr, spans, nullptr);
          }
        }
      }
      for (int64_t h = 0; h < d.H; ++h)
        for (int r = 0; r < nr; ++r)
          qts[h].store_row(r, o + ((t0 + r) * d.H + h) * d.hd, d.hd, lse ? lse + h * d.n + t0 + r : nullptr);
    }
  }
}

void soft_attention_backward(const float* q, const float* k, const float* v, const float* p, const float* o,
                             const float* lse, const float* dout, float* dq, float* dk, float* dv, float* dp,
                             const AttnShape& s, const SoftKeys& keys) {
  const bool has_p = p != nullptr;
  // Gradients of the queries' side (to dp) and of the keys' side (to dp, or keys.dpk with keys.pk).
  const bool want_dq = has_p && dp != nullptr;
  float* dk_out = keys.pk ? keys.dpk : dp;
  const bool want_dk = has_p && dk_out != nullptr;
  const bool want_de = keys.block_bits && (keys.deq || keys.dek);  // the terms through the blocks' pairs
  const bool want_dp = want_dq || want_dk || want_de;
  check_shape("soft_attention_backward", s, has_p, keys);
  if (s.n_q == 0) return;
  FOCUS_CHECK(q && k && v && o && lse && dout && dq && dk && dv,
              "soft_attention_backward: null q, k, v, o, lse, dout, dq, dk or dv");
  const Dims d = make_dims(s, has_p, keys);
  const int64_t hdp = d.hdp, nrows = d.n * d.H, RH = d.RH, pr_rows = d.n * d.Gp;

  // Packed operands: scaled Q and dO row tiles, K row tiles and K^T / V^T tiles, lse and
  // delta = rowsum(dO * O) in row-tile order, p.
  std::vector<float> qp(nrows * hdp), dop(nrows * hdp), kp(d.n * d.KVH * hdp);
  std::vector<float> ktp(d.nb * d.KVH * hdp * kB), vtp(d.nb * d.KVH * hdp * kB);
  std::vector<float> lsep(nrows), delta(nrows);
  pack_rows(q, d.n, d.H, d.hd, hdp, s.scale, qp.data());
  pack_rows(dout, d.n, d.H, d.hd, hdp, 1.f, dop.data());
  pack_rows(k, d.n, d.KVH, d.hd, hdp, 1.f, kp.data());
  pack_cols(k, d.n, d.KVH, d.hd, hdp, ktp.data());
  pack_cols(v, d.n, d.KVH, d.hd, hdp, vtp.data());
  const PackedP pm = pack_memberships(p, keys, d);
  const Blocks blocks = make_blocks(keys, d);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < d.n; ++i)
    for (int64_t h = 0; h < d.H; ++h) {
      const float* a = dout + (i * d.H + h) * d.hd;
      const float* b = o + (i * d.H + h) * d.hd;
      float acc = 0.f;
      for (int64_t e = 0; e < d.hd; ++e) acc += a[e] * b[e];
      const int64_t row = row_index(d.n, d.H, i, h);
      delta[row] = acc;
      lsep[row] = lse[h * d.n + i];
    }

  // Work = key tiles. Each key tile owns its dk, dv and the key side of dp; the query side (dq and
  // the query side of dp) goes to per-list partial buffers summed in a fixed order at the end.
  // Key tiles are dealt to lists by a deterministic longest-first rule, one list per thread.
  const int nlists = std::max(1, omp_get_max_threads());
  std::vector<std::vector<int64_t>> lists(nlists);
  {
    std::vector<int64_t> order(d.nb), load(nlists, 0);
    for (int64_t kb = 0; kb < d.nb; ++kb) order[kb] = kb;
    auto cost = [&](int64_t kb) { return last_query_tile(s, d, kb) - kb + 1; };
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost(a) > cost(b); });
    for (int64_t kb : order) {
      const int li = (int)(std::min_element(load.begin(), load.end()) - load.begin());
      lists[li].push_back(kb);
      load[li] += cost(kb);
    }
  }
  std::vector<float> dq_part((size_t)nlists * nrows * hdp, 0.f);
  std::vector<float> dp_part(want_dq ? (size_t)nlists * RH * pr_rows : 0, 0.f);
  std::vector<float> deq_part(want_de && keys.deq ? (size_t)nlists * RH * d.n : 0, 0.f);

#pragma omp parallel num_threads(nlists)
  {
    const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
    const int64_t T2 = kB * kB;
    std::vector<float> st(d.gs * T2), dpt(d.gs * T2), add(RH * T2), inv(RH * T2), db(RH * T2);
    std::vector<float> dk_acc(d.KVH * kB * hdp), dv_acc(d.KVH * kB * hdp), dpk(RH * kB * d.Gp);
    // Blocks: per head its additive tile, 1 / (A + eps) and the weights of the pairs its blocks
    // read; per router the gradient of those weights (x) and the keys' sums of it.
    const int64_t HB = blocks ? d.H : 0;
    std::vector<float> head_add(HB * T2), head_inv(HB * T2), head_blk(HB * T2), x(blocks ? RH * T2 : 0);
    std::vector<float> dek_acc(blocks ? RH * kB : 0);
    for (int li = tid; li < nlists; li += nth) {
      float* dqp = dq_part.data() + (size_t)li * nrows * hdp;
      float* dpp = want_dq ? dp_part.data() + (size_t)li * RH * pr_rows : nullptr;
      float* deqp = deq_part.empty() ? nullptr : deq_part.data() + (size_t)li * RH * d.n;
      for (const int64_t kb : lists[li]) {
        const int64_t j0 = kb * kB;
        const int cols = tile_len(d.n, kb);
        std::fill(dk_acc.begin(), dk_acc.end(), 0.f);
        std::fill(dv_acc.begin(), dv_acc.end(), 0.f);
        std::fill(dpk.begin(), dpk.end(), 0.f);
        std::fill(dek_acc.begin(), dek_acc.end(), 0.f);
        for (int64_t qb = kb; qb <= last_query_tile(s, d, kb); ++qb) {
          const int64_t t0 = qb * kB;
          const int nr = tile_len(d.n, qb);
          const TileInfo info = classify(s, has_p, t0, nr, j0, cols);
          const bool grad_bias = want_dp && info.biased;
          const bool per_head = blocks && info.biased;
          if (per_head) {
            for (int64_t r = 0; r < RH; ++r) group_tile(d, pm.q(r), pm.t(r), t0, nr, j0, add.data() + r * T2);
            for (int64_t h = 0; h < d.H; ++h)
              head_tile(s, d, blocks, add.data() + d.router_of(h / d.gs) * T2, h, t0, nr, j0, cols, info,
                        head_add.data() + h * T2, head_inv.data() + h * T2, head_blk.data() + h * T2);
            std::fill(x.begin(), x.end(), 0.f);
          } else if (info.add()) {
            for (int64_t r = 0; r < info.add_tiles(RH); ++r)  // mask-only tiles: once
              build_tile(s, d, has_p ? pm.q(r) : nullptr, has_p ? pm.t(r) : nullptr, t0, nr, j0, cols, info,
                         add.data() + r * T2, grad_bias ? inv.data() + r * T2 : nullptr);
          }
          if (grad_bias) std::fill(db.begin(), db.end(), 0.f);
          for (int64_t kvh = 0; kvh < d.KVH; ++kvh) {
            const int R = (int)(d.gs * nr);
            const int64_t row0 = qb * kB * d.H + kvh * d.gs * nr;  // first packed row of this group
            const float* qg = qp.data() + row0 * hdp;
            const float* dog = dop.data() + row0 * hdp;
            const float* ktile = ktp.data() + (kb * d.KVH + kvh) * hdp * kB;
            const float* vtile = vtp.data() + (kb * d.KVH + kvh) * hdp * kB;
            const float* krows = kp.data() + (kb * kB * d.KVH + kvh * cols) * hdp;
            float* P = st.data();
            float* dS = dpt.data();
            const float* addr = add.data() + info.add_tile_of(d.router_of(kvh)) * T2;
            // Row rr of the group's additive tile (rows head by head, nr each).
            auto add_row = [&](int rr) {
              return per_head ? head_add.data() + (kvh * d.gs + rr / nr) * T2 + (rr % nr) * kB : addr + (rr % nr) * kB;
            };
            // P = exp(S + add - lse) [R, 64], recomputed exactly as in the forward.
            gemm<false>(qg, hdp, ktile, kB, P, kB, R, (int)hdp, kB, false);
            for (int rr = 0; rr < R; ++rr) {
              float* pr = P + rr * kB;
              const float* ar = add_row(rr);
              const float lr = lsep[row0 + rr];
              for (int c = 0; c < kB; c += kV) {
                const vf x = info.add() ? load(pr + c) + load(ar + c) : load(pr + c);
                store(pr + c, vexp_cephes(x - lr));
              }
            }
            // dP = dO V^T [R, 64]; dV += P^T dO; dS = P * (dP - delta); dK += dS^T (scale q); dQ += dS K.
            gemm<false>(dog, hdp, vtile, kB, dS, kB, R, (int)hdp, kB, false);
            gemm<true>(P, kB, dog, hdp, dv_acc.data() + kvh * kB * hdp, hdp, cols, R, (int)hdp, true);
            for (int rr = 0; rr < R; ++rr) {
              const vf dr = bcast(delta[row0 + rr]);
              for (int c = 0; c < kB; c += kV)
                store(dS + rr * kB + c, load(P + rr * kB + c) * (load(dS + rr * kB + c) - dr));
            }
            gemm<true>(dS, kB, qg, hdp, dk_acc.data() + kvh * kB * hdp, hdp, cols, R, (int)hdp, true);
            gemm<false>(dS, kB, krows, hdp, dqp + row0 * hdp, hdp, R, cols, (int)hdp, true);
            if (grad_bias && per_head) {
              // dA = dS / (A + eps) per head; a pair its blocks read gives dA times its weight to
              // the terms (x), any other to the router's memberships (db, summed over its heads)
              // unless the head reads no group.
              const int64_t r = d.router_of(kvh);
              for (int rr = 0; rr < R; ++rr) {
                const int64_t h = kvh * d.gs + rr / nr, t = rr % nr;
                const bool to_groups = blocks.groups_of(h);
                const float* ir = head_inv.data() + h * T2 + t * kB;
                const float* br = head_blk.data() + h * T2 + t * kB;
                float* dr = db.data() + r * T2 + t * kB;
                float* xr = x.data() + r * T2 + t * kB;
                const float* sr = dS + rr * kB;
                for (int c = 0; c < kB; ++c) {
                  const float da = sr[c] * ir[c];
                  if (br[c] > 0.f)
                    xr[c] += da * br[c];
                  else if (to_groups)
                    dr[c] += da;
                }
              }
            } else if (grad_bias)  // dBias = sum over the router's heads of dS
              for (int rr = 0; rr < R; ++rr) {
                float* br = db.data() + d.router_of(kvh) * T2 + (rr % nr) * kB;
                for (int c = 0; c < kB; c += kV) store(br + c, load(br + c) + load(dS + rr * kB + c));
              }
          }
          if (grad_bias)
            for (int64_t r = 0; r < RH; ++r) {
              // dA = dBias / (A + eps); dp_i += dA pk_j (query side), dpk_j += dA^T p_i (key side).
              float* dbr = db.data() + r * T2;
              if (!per_head) {  // per head it is dA already
                const float* ivr = inv.data() + r * T2;
                for (int e = 0; e < nr * kB; e += kV) store(dbr + e, load(dbr + e) * load(ivr + e));
              } else if (want_de) {  // the terms: each row's and each key's sum of x
                const float* xr = x.data() + r * T2;
                for (int t = 0; t < nr; ++t) {
                  float rs = 0.f;
                  for (int c = 0; c < cols; ++c) rs += xr[t * kB + c], dek_acc[r * kB + c] += xr[t * kB + c];
                  if (deqp) deqp[r * d.n + t0 + t] += rs;
                }
              }
              if (want_dq)
                gemm<false>(dbr, kB, pm.k(r) + j0 * d.Gp, d.Gp, dpp + r * pr_rows + t0 * d.Gp, d.Gp, nr, cols,
                            (int)d.Gp, true);
              if (want_dk)
                gemm<true>(dbr, kB, pm.q(r) + t0 * d.Gp, d.Gp, dpk.data() + r * kB * d.Gp, d.Gp, cols, nr, (int)d.Gp,
                           true);
            }
        }
        // This key tile's rows are ours alone.
        for (int c = 0; c < cols; ++c)
          for (int64_t kvh = 0; kvh < d.KVH; ++kvh) {
            const float* a = dk_acc.data() + (kvh * kB + c) * hdp;
            const float* b = dv_acc.data() + (kvh * kB + c) * hdp;
            float* ko = dk + ((j0 + c) * d.KVH + kvh) * d.hd;
            float* vo = dv + ((j0 + c) * d.KVH + kvh) * d.hd;
            for (int64_t e = 0; e < d.hd; ++e) ko[e] += a[e], vo[e] += b[e];
          }
        if (want_dk)
          for (int64_t r = 0; r < RH; ++r)
            for (int c = 0; c < cols; ++c)
              for (int64_t g = 0; g < d.G; ++g)
                dk_out[(r * d.n + j0 + c) * d.G + g] += dpk[(r * kB + c) * d.Gp + g];
        if (want_de && keys.dek)
          for (int64_t r = 0; r < RH; ++r)
            for (int c = 0; c < cols; ++c) keys.dek[r * d.n + j0 + c] += dek_acc[r * kB + c];
      }
    }
  }

  // Fixed-order reduction of the partial buffers.
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < d.n; ++i) {
    for (int64_t h = 0; h < d.H; ++h) {
      const int64_t row = row_index(d.n, d.H, i, h);
      float* out = dq + (i * d.H + h) * d.hd;
      for (int64_t e = 0; e < d.hd; ++e) {
        float acc = 0.f;
        for (int li = 0; li < nlists; ++li) acc += dq_part[((size_t)li * nrows + row) * hdp + e];
        out[e] += s.scale * acc;
      }
    }
    if (!deq_part.empty())
      for (int64_t r = 0; r < RH; ++r) {
        float acc = 0.f;
        for (int li = 0; li < nlists; ++li) acc += deq_part[((size_t)li * RH + r) * d.n + i];
        keys.deq[r * d.n + i] += acc;
      }
    if (want_dq)
      for (int64_t r = 0; r < RH; ++r)
        for (int64_t g = 0; g < d.G; ++g) {
          float acc = 0.f;
          for (int li = 0; li < nlists; ++li) acc += dp_part[(size_t)li * RH * pr_rows + r * pr_rows + i * d.Gp + g];
          dp[(r * d.n + i) * d.G + g] += acc;
        }
  }
}

}  // namespace focus::cpu
