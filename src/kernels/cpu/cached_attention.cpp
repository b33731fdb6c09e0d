#include "kernels/cpu/cached_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <omp.h>

#include "core/error.h"
#include "kernels/cpu/simd.h"

namespace focus::cpu {

namespace {

using namespace simd;

float dot(const float* a, const float* b, int64_t d) {
  int64_t x = 0;
  float s = 0.f;
  if (d >= kV) {
    vf acc{};
    for (; x + kV <= d; x += kV) acc = vfma(load(a + x), load(b + x), acc);
    s = hsum(acc);
  }
  for (; x < d; ++x) s += a[x] * b[x];
  return s;
}

// What row i (absolute position) reads: ascending key positions and, in soft mode, their biases.
struct RowKeys {
  std::vector<int32_t> idx;
  std::vector<float> bias;  // soft mode: one per entry of idx
  std::vector<int32_t> merged;
};

void row_keys(int64_t i, const AttnShape& s, FocusMode mode, const FocusLayerCache& fc, float eps, RowKeys& rk) {
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
        b = std::log(acc + eps);
      }
      rk.bias.push_back(b);
    }
    return;
  }
  if (mode == FocusMode::Off) {  // full causal attention: every cached key
    for (int64_t j = 0; j <= i; ++j) idx.push_back((int32_t)j);
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

// One (row, head): softmax over the listed keys, times their values.
void row_head(const float* qh, const float* k, const float* v, float* oh, const AttnShape& s, int64_t kvh,
              const RowKeys& rk, std::vector<float>& sc) {
  const int64_t n = (int64_t)rk.idx.size(), D = s.head_dim;
  sc.resize(n);
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t m = 0; m < n; ++m) {
    float x = dot(qh, k + (int64_t)rk.idx[m] * s.kv_stride + kvh * D, D) * s.scale;
    if (!rk.bias.empty()) x += rk.bias[m];
    sc[m] = x;
    mx = std::max(mx, x);
  }
  double sum = 0;
  for (int64_t m = 0; m < n; ++m) {
    sc[m] = std::exp(sc[m] - mx);
    sum += sc[m];
  }
  std::fill(oh, oh + D, 0.f);
  for (int64_t m = 0; m < n; ++m) {
    const float w = sc[m];
    const float* vr = v + (int64_t)rk.idx[m] * s.kv_stride + kvh * D;
    for (int64_t x = 0; x < D; ++x) oh[x] += w * vr[x];
  }
  const float inv = (float)(1.0 / sum);
  for (int64_t x = 0; x < D; ++x) oh[x] *= inv;
}

// Decoding one row (flash-decoding): the key list is cut into fixed slices; each task takes one
// slice and one key/value head, loads every key and value row of the slice once for all the
// query heads that share it, and leaves a partial softmax (max, sum, weighted values) per head.
// The partials are merged in slice order, so the result does not depend on the thread count.
void decode_row(const float* q, const float* k, const float* v, float* o, const AttnShape& s,
                const RowKeys& rk) {
  constexpr int64_t kSlice = 256;
  const int64_t n = (int64_t)rk.idx.size(), D = s.head_dim, KV = s.kv_heads, per_kv = s.heads / s.kv_heads;
  const int64_t slices = (n + kSlice - 1) / kSlice, tasks = slices * KV, part = D + 2;
  std::vector<float> parts(slices * s.heads * part);
  const bool vec = D % kV == 0;
#pragma omp parallel if (tasks > 1 && n * s.heads * D > 32768)
  {
    std::vector<float> sc(per_kv * kSlice);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t c = task / KV, kvh = task % KV, m0 = c * kSlice, len = std::min(kSlice, n - m0);
      const int32_t* idx = rk.idx.data() + m0;
      const float* qh = q + kvh * per_kv * D;
      for (int64_t m = 0; m < len; ++m) {
        if (m + 4 < len) __builtin_prefetch(k + (int64_t)idx[m + 4] * s.kv_stride + kvh * D);
        const float* kr = k + (int64_t)idx[m] * s.kv_stride + kvh * D;
        const float b = rk.bias.empty() ? 0.f : rk.bias[m0 + m];
        for (int64_t hh = 0; hh < per_kv; ++hh) sc[hh * kSlice + m] = dot(qh + hh * D, kr, D) * s.scale + b;
      }
      for (int64_t hh = 0; hh < per_kv; ++hh) {
        float* w = sc.data() + hh * kSlice;
        float mx = -std::numeric_limits<float>::infinity(), sum = 0.f;
        for (int64_t m = 0; m < len; ++m) mx = std::max(mx, w[m]);
        for (int64_t m = 0; m < len; ++m) sum += (w[m] = std::exp(w[m] - mx));
        float* pr = parts.data() + (c * s.heads + kvh * per_kv + hh) * part;
        pr[0] = mx;
        pr[1] = sum;
        std::fill(pr + 2, pr + part, 0.f);
      }
      for (int64_t m = 0; m < len; ++m) {
        if (m + 4 < len) __builtin_prefetch(v + (int64_t)idx[m + 4] * s.kv_stride + kvh * D);
        const float* vr = v + (int64_t)idx[m] * s.kv_stride + kvh * D;
        for (int64_t hh = 0; hh < per_kv; ++hh) {
          float* acc = parts.data() + (c * s.heads + kvh * per_kv + hh) * part + 2;
          const float w = sc[hh * kSlice + m];
          int64_t x = 0;
          if (vec) {
            const vf wv = bcast(w);
            for (; x < D; x += kV) store(acc + x, vfma(wv, load(vr + x), load(acc + x)));
          }
          for (; x < D; ++x) acc[x] += w * vr[x];
        }
      }
    }
  }
  for (int64_t h = 0; h < s.heads; ++h) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < slices; ++c) mx = std::max(mx, parts[(c * s.heads + h) * part]);
    float* oh = o + h * D;
    std::fill(oh, oh + D, 0.f);
    double sum = 0;
    for (int64_t c = 0; c < slices; ++c) {
      const float* pr = parts.data() + (c * s.heads + h) * part;
      const float f = std::exp(pr[0] - mx);
      sum += (double)pr[1] * f;
      for (int64_t x = 0; x < D; ++x) oh[x] += f * pr[2 + x];
    }
    const float inv = (float)(1.0 / sum);
    for (int64_t x = 0; x < D; ++x) oh[x] *= inv;
  }
}

}  // namespace

int64_t focus_cached_attention(const float* q, const float* k, const float* v, float* o, const AttnShape& s,
                               int64_t pos0, int64_t t, FocusMode mode, const FocusLayerCache& fc, float eps) {

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
  const int64_t H = s.heads, per_kv = s.heads / s.kv_heads, D = s.head_dim;
  int64_t pairs = 0;
  if (t == 1) {
    RowKeys rk;
    row_keys(pos0, s, mode, fc, eps, rk);
    decode_row(q, k, v, o, s, rk);
    return (int64_t)rk.idx.size();
  }
  // A chunk: rows in parallel, each row's key list shared by its heads.
#pragma omp parallel reduction(+ : pairs)
  {
    RowKeys rk;
    std::vector<float> sc;
#pragma omp for schedule(dynamic, 4)
    for (int64_t r = 0; r < t; ++r) {
      row_keys(pos0 + r, s, mode, fc, eps, rk);
      pairs += (int64_t)rk.idx.size();
      for (int64_t h = 0; h < H; ++h)
        row_head(q + r * s.q_stride + h * D, k, v, o + r * s.o_stride + h * D, s, h / per_kv, rk, sc);
    }
  }
  return pairs;
}

}  // namespace focus::cpu
