#include "kernels/cpu/cached_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <omp.h>

#include "core/error.h"
#include "kernels/cpu/simd.h"
#include "kernels/cpu/tile_engine.h"

namespace focus::cpu {

namespace {

using namespace simd;

template <class E>
float dot(const float* a, const E* b, int64_t d) {
  int64_t x = 0;
  float s = 0.f;
  if (d >= kV) {
    vf acc{};
    for (; x + kV <= d; x += kV) acc = vfma(load(a + x), kv_load_vec(b + x), acc);
    s = hsum(acc);
  }
  for (; x < d; ++x) s += a[x] * kv_load(b + x);
  return s;
}

// What row i (absolute position) reads: ascending key positions and, in soft mode, their biases.
struct RowKeys {
  std::vector<int32_t> idx;
  std::vector<float> bias;  // soft mode: one per entry of idx
  std::vector<int32_t> merged;
};

void row_keys(int64_t i, const AttnShape& s, FocusMode mode, const FocusLayerCache& fc, RowKeys& rk) {
  auto& idx = rk.idx;
  idx.clear();
  rk.bias.clear();
  const int64_t lo = std::max<int64_t>(0, i - s.local_window + 1);  // the window: lo .. i
  const int64_t far_from = std::min(s.sinks, lo);              // sinks 0 .. far_from-1 lie before it
  if (mode == FocusMode::Soft) {
    const int64_t G = fc.groups;
    const float* pi = fc.p.data() + i * G;
    for (int64_t j = 0; j <= i; ++j) {
      idx.push_back((int32_t)j);
      float b = 0.f;
      if (j >= s.sinks && j < lo) {
        const float* pj = fc.p.data() + j * G;
        float acc = 0.f;
        for (int64_t g = 0; g < G; ++g) acc += pi[g] * pj[g];
        b = std::log(acc + s.eps);
      }
      rk.bias.push_back(b);
    }
    return;
  }
  if (mode == FocusMode::Off) {  // full causal attention: every cached key (of the sliding window)
    for (int64_t j = s.sliding_window > 0 ? std::max<int64_t>(0, i - s.sliding_window + 1) : 0; j <= i; ++j)
      idx.push_back((int32_t)j);
    return;
  }
  for (int64_t j = 0; j < far_from; ++j) idx.push_back((int32_t)j);
  if (mode == FocusMode::Hard && lo > s.sinks) {
    // Members of row i's groups in [S, lo): one sorted range per group, merged without repeats.
    const int32_t* gi = fc.top.data() + i * fc.topk;
    for (int c = 0; c < fc.topk; ++c) {
      const auto& m = fc.members[gi[c]];
      auto a = std::lower_bound(m.begin(), m.end(), (int32_t)s.sinks);
      auto b = std::lower_bound(a, m.end(), (int32_t)lo);
      if (c == 0) {
        rk.merged.assign(a, b);
      } else {
        const size_t mid = rk.merged.size();
        rk.merged.insert(rk.merged.end(), a, b);
        std::inplace_merge(rk.merged.begin(), rk.merged.begin() + (std::ptrdiff_t)mid, rk.merged.end());
        rk.merged.erase(std::unique(rk.merged.begin(), rk.merged.end()), rk.merged.end());
      }
    }
    idx.insert(idx.end(), rk.merged.begin(), rk.merged.end());
  }
  for (int64_t j = lo; j <= i; ++j) idx.push_back((int32_t)j);
}

// Partial softmax states (tiles::Partial: m, l, then head_dim unnormalised output floats, kPart
// floats per head) of the query heads of kv head kvh over slice c of the row's key list: every
// key and value row of the slice is loaded once for all the query heads that share it. sc holds
// heads / kv_heads * kSlice floats.
constexpr int64_t kSlice = 256;
static_assert(kSlice % kV == 0, "a slice's scores are whole vectors");

// Any head_dim: one dot product per (key, head), the exponentials one by one.
template <class E>
void slice_partials_generic(const float* q, const E* k, const E* v, const AttnShape& s, const RowKeys& rk,
                            int64_t c, int64_t kvh, float* sc, float* parts, int64_t part) {
  const int64_t n = (int64_t)rk.idx.size(), D = s.head_dim, per_kv = s.heads / s.kv_heads;
  const int64_t m0 = c * kSlice, len = std::min(kSlice, n - m0);
  const int32_t* idx = rk.idx.data() + m0;
  const float* qh = q + kvh * per_kv * D;
  const bool vec = D % kV == 0;
  for (int64_t m = 0; m < len; ++m) {
    if (m + 4 < len) __builtin_prefetch(k + (int64_t)idx[m + 4] * s.kv_stride + kvh * D);
    const E* kr = k + (int64_t)idx[m] * s.kv_stride + kvh * D;
    const float b = rk.bias.empty() ? 0.f : rk.bias[m0 + m];
    for (int64_t hh = 0; hh < per_kv; ++hh) sc[hh * kSlice + m] = dot(qh + hh * D, kr, D) * s.scale + b;
  }
  for (int64_t hh = 0; hh < per_kv; ++hh) {
    float* w = sc + hh * kSlice;
    float mx = -std::numeric_limits<float>::infinity(), sum = 0.f;
    for (int64_t m = 0; m < len; ++m) mx = std::max(mx, w[m]);
    for (int64_t m = 0; m < len; ++m) sum += (w[m] = std::exp(w[m] - mx));
    float* pr = parts + (c * s.heads + kvh * per_kv + hh) * part;
    pr[0] = mx;
    pr[1] = sum;
    std::fill(pr + 2, pr + part, 0.f);
  }
  for (int64_t m = 0; m < len; ++m) {
    if (m + 4 < len) __builtin_prefetch(v + (int64_t)idx[m + 4] * s.kv_stride + kvh * D);
    const E* vr = v + (int64_t)idx[m] * s.kv_stride + kvh * D;
    for (int64_t hh = 0; hh < per_kv; ++hh) {
      float* acc = parts + (c * s.heads + kvh * per_kv + hh) * part + 2;
      const float w = sc[hh * kSlice + m];
      int64_t x = 0;
      if (vec) {
        const vf wv = bcast(w);
        for (; x < D; x += kV) store(acc + x, vfma(wv, kv_load_vec(vr + x), load(acc + x)));
      }
      for (; x < D; ++x) acc[x] += w * kv_load(vr + x);
    }
  }
}

// head_dim = NV vectors: a key row is widened once into registers for all the heads that read
// it, the exponentials of a head's slice are taken a vector at a time, and the values are summed
// into register accumulators, up to four heads and a few vectors of the row per pass.
template <class E, int NV>
void slice_partials_vec(const float* q, const E* k, const E* v, const AttnShape& s, const RowKeys& rk, int64_t c,
                        int64_t kvh, float* sc, float* parts, int64_t part) {
  constexpr int64_t D = NV * kV;
  const int64_t n = (int64_t)rk.idx.size(), per_kv = s.heads / s.kv_heads;
  const int64_t m0 = c * kSlice, len = std::min(kSlice, n - m0), lv = round_up(len);
  const int32_t* idx = rk.idx.data() + m0;
  const float* bias = rk.bias.empty() ? nullptr : rk.bias.data() + m0;
  const float* qh = q + kvh * per_kv * D;
  const E* kb = k + kvh * D;
  const E* vb = v + kvh * D;
  for (int64_t m = 0; m < len; ++m) {
    if (m + 4 < len) __builtin_prefetch(kb + (int64_t)idx[m + 4] * s.kv_stride);
    const E* kr = kb + (int64_t)idx[m] * s.kv_stride;
    vf kr_v[NV];
    for (int x = 0; x < NV; ++x) kr_v[x] = kv_load_vec(kr + x * kV);
    const float b = bias ? bias[m] : 0.f;
    for (int64_t hh = 0; hh < per_kv; ++hh) {
      const float* qr = qh + hh * D;
      vf acc = load(qr) * kr_v[0];
      for (int x = 1; x < NV; ++x) acc = vfma(load(qr + x * kV), kr_v[x], acc);
      sc[hh * kSlice + m] = hsum(acc) * s.scale + b;
    }
  }
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t hh = 0; hh < per_kv; ++hh) {
    float* w = sc + hh * kSlice;
    for (int64_t m = len; m < lv; ++m) w[m] = ninf;  // padding: weight exactly 0
    vf vm = bcast(ninf);
    for (int64_t m = 0; m < lv; m += kV) vm = vmax(vm, load(w + m));
    const float mx = hmax(vm);
    vf vs{};
    if (mx != ninf) {
      const vf vmx = bcast(mx);
      for (int64_t m = 0; m < lv; m += kV) {
        const vf e = vexp(load(w + m) - vmx);
        store(w + m, e);
        vs += e;
      }
    } else {
      std::fill(w, w + lv, 0.f);
    }
    float* pr = parts + (c * s.heads + kvh * per_kv + hh) * part;
    pr[0] = mx;
    pr[1] = hsum(vs);
  }
  for (int64_t h0 = 0; h0 < per_kv; h0 += 4) {
    with_count<4>((int)std::min<int64_t>(4, per_kv - h0), [&]<int NH>() {
      for_chunks<16 / NH>(NV, [&]<int XC>(int x0) {
        vf acc[NH][XC] = {};
        for (int64_t m = 0; m < len; ++m) {
          if (m + 4 < len) __builtin_prefetch(vb + (int64_t)idx[m + 4] * s.kv_stride + x0 * kV);
          const E* vr = vb + (int64_t)idx[m] * s.kv_stride + x0 * kV;
          vf vv[XC];
          for (int x = 0; x < XC; ++x) vv[x] = kv_load_vec(vr + x * kV);
          for (int hh = 0; hh < NH; ++hh) {
            const vf wv = bcast(sc[(h0 + hh) * kSlice + m]);
            for (int x = 0; x < XC; ++x) acc[hh][x] = vfma(wv, vv[x], acc[hh][x]);
          }
        }
        for (int hh = 0; hh < NH; ++hh) {
          float* o = parts + (c * s.heads + kvh * per_kv + h0 + hh) * part + 2 + x0 * kV;
          for (int x = 0; x < XC; ++x) store(o + x * kV, acc[hh][x]);
        }
      });
    });
  }
}

template <class E>
void slice_partials(const float* q, const E* k, const E* v, const AttnShape& s, const RowKeys& rk, int64_t c,
                    int64_t kvh, float* sc, float* parts, int64_t part) {
  const int64_t nv = s.head_dim % kV == 0 ? s.head_dim / kV : 0;
  bool done = false;
  auto vec = [&]<int NV>() {
    if (nv != NV) return;
    slice_partials_vec<E, NV>(q, k, v, s, rk, c, kvh, sc, parts, part);
    done = true;
  };
  // The head sizes of real models (32 .. 256 dimensions).
  vec.template operator()<2>(), vec.template operator()<4>(), vec.template operator()<5>();
  vec.template operator()<6>(), vec.template operator()<8>(), vec.template operator()<16>();
  if constexpr (kV < 16) vec.template operator()<32>();
  if (!done) slice_partials_generic(q, k, v, s, rk, c, kvh, sc, parts, part);
}

// Output row (all heads) from the partials of every slice, merged in slice order by the tile
// engine, so the result does not depend on who computed which slice.
void merge_slices(const float* parts, int64_t slices, const AttnShape& s, int64_t part, float* o) {
  for (int64_t h = 0; h < s.heads; ++h)
    tiles::merge_partials(slices, s.head_dim, o + h * s.head_dim, [&](int64_t c) {
      const float* pr = parts + (c * s.heads + h) * part;
      return tiles::Partial{pr[0], pr[1], pr + 2};
    });
}

// One row, all heads: the key list cut into fixed slices (slice_partials), merged. Decoding (a
// single row) spreads the (slice, kv head) tasks over threads (flash-decoding); a row of a chunk
// runs them in its own thread.
template <class E>
void attend_row(const float* q, const E* k, const E* v, float* o, const AttnShape& s, const RowKeys& rk,
                std::vector<float>& sc, std::vector<float>& parts, bool parallel) {
  const int64_t n = (int64_t)rk.idx.size(), KV = s.kv_heads, per_kv = s.heads / s.kv_heads;
  const int64_t slices = (n + kSlice - 1) / kSlice, tasks = slices * KV, part = s.head_dim + 2;
  parts.resize(slices * s.heads * part);
  if (parallel && tasks > 1 && n * s.heads * s.head_dim > 32768) {
#pragma omp parallel
    {
      std::vector<float> scr(per_kv * kSlice);
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < tasks; ++task)
        slice_partials(q, k, v, s, rk, task / KV, task % KV, scr.data(), parts.data(), part);
    }
  } else {
    sc.resize(per_kv * kSlice);
    for (int64_t task = 0; task < tasks; ++task)
      slice_partials(q, k, v, s, rk, task / KV, task % KV, sc.data(), parts.data(), part);
  }
  merge_slices(parts.data(), slices, s, part, o);
}

template <class E>
int64_t cached_rows(const float* q, const E* k, const E* v, float* o, const AttnShape& s, int64_t pos0, int64_t t,
                    FocusMode mode, const FocusLayerCache& fc) {
  FOCUS_CHECK(s.heads % s.kv_heads == 0 && s.local_window >= 1 && s.sinks >= 0 && pos0 >= 0 && t >= 1,
              "focus_cached_attention: bad shape");
  const int64_t end = pos0 + t;
  if (mode == FocusMode::Hard)
    FOCUS_CHECK(fc.len >= end && (int64_t)fc.top.size() >= end * fc.topk,
                "focus_cached_attention: the cache holds the groups of ", fc.len, " positions, ", end, " needed");
  if (mode == FocusMode::Soft)
    FOCUS_CHECK(fc.len >= end && (int64_t)fc.p.size() >= end * fc.groups,
                "focus_cached_attention: the cache holds no soft assignments for ", end,
                " positions (was it filled in hard mode?)");
  int64_t pairs = 0;
  if (t == 1) {
    RowKeys rk;
    row_keys(pos0, s, mode, fc, rk);
    std::vector<float> sc, parts;
    attend_row(q, k, v, o, s, rk, sc, parts, /*parallel=*/true);
    return (int64_t)rk.idx.size();
  }
  // A chunk: rows in parallel, each row's key list shared by its heads.
#pragma omp parallel reduction(+ : pairs)
  {
    RowKeys rk;
    std::vector<float> sc, parts;
#pragma omp for schedule(dynamic, 4)
    for (int64_t r = 0; r < t; ++r) {
      row_keys(pos0 + r, s, mode, fc, rk);
      pairs += (int64_t)rk.idx.size();
      attend_row(q + r * s.q_stride, k, v, o + r * s.o_stride, s, rk, sc, parts, /*parallel=*/false);
    }
  }
  return pairs;
}

}  // namespace

int64_t focus_cached_attention(const float* q, const float* k, const float* v, float* o, const AttnShape& s,
                               int64_t pos0, int64_t t, FocusMode mode, const FocusLayerCache& fc) {
  return focus_cached_attention(q, KvView(k), KvView(v), o, s, pos0, t, mode, fc);
}

int64_t focus_cached_attention(const float* q, KvView kv_k, KvView kv_v, float* o, const AttnShape& s, int64_t pos0,
                               int64_t t, FocusMode mode, const FocusLayerCache& fc) {
  FOCUS_CHECK(kv_k.type == kv_v.type, "focus_cached_attention: keys and values of different types");
  return with_kv_type(kv_k.type, [&](auto tag) {
    using E = decltype(tag);
    return cached_rows(q, kv_k.as<E>(), kv_v.as<E>(), o, s, pos0, t, mode, fc);
  });
}

}  // namespace focus::cpu
