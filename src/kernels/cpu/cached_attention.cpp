#include "kernels/cpu/cached_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <omp.h>

#include "core/error.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/decode_slices.h"
#include "kernels/cpu/simd.h"
#include "kernels/cpu/tile_engine.h"

namespace focus::cpu {

namespace {

using namespace simd;


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
  // Positions j0 .. j1-1 appended in order.
  auto add_range = [&idx](int64_t j0, int64_t j1) {
    if (j1 <= j0) return;
    const size_t at = idx.size();
    idx.resize(at + (size_t)(j1 - j0));
    std::iota(idx.begin() + (std::ptrdiff_t)at, idx.end(), (int32_t)j0);
  };
  if (mode == FocusMode::Off) {  // full causal attention: every cached key (of the sliding window)
    add_range(s.sliding_window > 0 ? std::max<int64_t>(0, i - s.sliding_window + 1) : 0, i + 1);
    return;
  }
  add_range(0, far_from);
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
  add_range(lo, i + 1);
}

// Partial softmax states of the query heads of kv head kvh over slice c of the row's key list
// (decode_slices.h: every key and value row loaded once for all those heads). sc holds
// heads / kv_heads * kSlice floats.
template <class E>
void slice_partials(const float* q, const E* k, const E* v, const AttnShape& s, const RowKeys& rk, int64_t c,
                    int64_t kvh, float* sc, float* parts, int64_t part) {
  const int64_t n = (int64_t)rk.idx.size(), D = s.head_dim, per_kv = s.heads / s.kv_heads;
  const int64_t m0 = c * kSlice, len = std::min(kSlice, n - m0);
  heads_slice_partials(q + kvh * per_kv * D, per_kv, k + kvh * D, v + kvh * D, s.kv_stride, rk.idx.data() + m0,
                       rk.bias.empty() ? nullptr : rk.bias.data() + m0, len, D, s.scale, sc,
                       parts + (c * s.heads + kvh * per_kv) * part, part);
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
      thread_local std::vector<float> scr;  // each thread's scores, kept across calls
      scr.resize(per_kv * kSlice);
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
    // The calling thread's buffers, kept across calls (a decoding step allocates nothing).
    thread_local RowKeys rk;
    thread_local std::vector<float> sc, parts;
    row_keys(pos0, s, mode, fc, rk);
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

void decode_attention(const float* q, KvView k, KvView v, float* o, const AttnShape& s) {
  static const FocusLayerCache none;  // FocusMode::Off reads no routing
  if (s.n_q > 0) focus_cached_attention(q, k, v, o, s, s.q_pos0, s.n_q, FocusMode::Off, none);
}

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
