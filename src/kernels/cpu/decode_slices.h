// The inner kernel of decoding (flash-decoding): the partial softmax states of a few query heads
// that read the same keys, over one slice of a row's key list. Each key and value row is loaded
// (and widened from the cache's element type) once for all those heads. Used by the dense and
// Focus decoding kernels (cached_attention.cpp) and the grouped kernel's decoding path.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kernels/cpu/kv_simd.h"
#include "kernels/cpu/simd.h"

namespace focus::cpu {

// Keys per slice: a row's key list is cut into slices of this many keys, whose partial states
// are merged in order (tiles::merge_partials), so results do not depend on the thread count.
constexpr int64_t kSlice = 256;
static_assert(kSlice % simd::kV == 0, "a slice's scores are whole vectors");

namespace decode_detail {

using namespace simd;

// Rows read ahead: a row list gathered from the groups is scattered over the cache, so the
// hardware prefetchers do not see it coming; every cache line of a key row (in the score pass)
// or of a value row (in the value pass) is requested this many keys ahead.
constexpr int64_t kAhead = 12;

template <class E>
inline void prefetch_row(const E* row, int64_t d) {
  const char* p = (const char*)row;
  for (int64_t b = 0; b < d * (int64_t)sizeof(E); b += 64) __builtin_prefetch(p + b);
}

template <class E>
inline float dot(const float* a, const E* b, int64_t d) {
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

// Any head_dim: one dot product per (key, head), the exponentials one by one.
template <class E>
void slice_generic(const float* q, int64_t nh, const E* k, const E* v, int64_t kv_stride, const int32_t* idx,
                   const float* bias, int64_t bias_hs, int64_t len, int64_t D, float scale, float* sc, float* parts,
                   int64_t part) {
  for (int64_t m = 0; m < len; ++m) {
    if (m + kAhead < len) prefetch_row(k + (int64_t)idx[m + kAhead] * kv_stride, D);
    const E* kr = k + (int64_t)idx[m] * kv_stride;
    for (int64_t hh = 0; hh < nh; ++hh)
      sc[hh * kSlice + m] = dot(q + hh * D, kr, D) * scale + (bias ? bias[hh * bias_hs + m] : 0.f);
  }
  for (int64_t hh = 0; hh < nh; ++hh) {
    float* w = sc + hh * kSlice;
    float mx = -std::numeric_limits<float>::infinity(), sum = 0.f;
    for (int64_t m = 0; m < len; ++m) mx = std::max(mx, w[m]);
    if (mx == -std::numeric_limits<float>::infinity())
      std::fill(w, w + len, 0.f);  // every key hidden from this head
    else
      for (int64_t m = 0; m < len; ++m) sum += (w[m] = std::exp(w[m] - mx));
    float* pr = parts + hh * part;
    pr[0] = mx;
    pr[1] = sum;
    std::fill(pr + 2, pr + 2 + D, 0.f);
  }
  const bool vec = D % kV == 0;
  for (int64_t m = 0; m < len; ++m) {
    if (m + kAhead < len) prefetch_row(v + (int64_t)idx[m + kAhead] * kv_stride, D);
    const E* vr = v + (int64_t)idx[m] * kv_stride;
    for (int64_t hh = 0; hh < nh; ++hh) {
      float* acc = parts + hh * part + 2;
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

// Vector registers (16 with AVX2, 32 with AVX-512): the value pass's accumulators must fit in
// them with the weights and a row vector; a spilled accumulator costs a store and a load per key.
constexpr int kRegs = kV >= 16 ? 32 : 16;

// head_dim = NV vectors: a key row is widened once into registers for all the heads, the
// exponentials of a head's slice are taken a vector at a time, and the values are summed into
// register accumulators, up to four heads and a few vectors of the row per pass.
template <class E, int NV>
void slice_vec(const float* q, int64_t nh, const E* k, const E* v, int64_t kv_stride, const int32_t* idx,
               const float* bias, int64_t bias_hs, int64_t len, float scale, float* sc, float* parts, int64_t part) {
  constexpr int64_t D = NV * kV;
  const int64_t lv = round_up(len);
  for (int64_t m = 0; m < len; ++m) {
    if (m + kAhead < len) prefetch_row(k + (int64_t)idx[m + kAhead] * kv_stride, D);
    const E* kr = k + (int64_t)idx[m] * kv_stride;
    vf kr_v[NV];
    for (int x = 0; x < NV; ++x) kr_v[x] = kv_load_vec(kr + x * kV);
    for (int64_t hh = 0; hh < nh; ++hh) {
      const float* qr = q + hh * D;
      // Two chains (even and odd vectors of the row), half as long as one.
      vf acc0 = load(qr) * kr_v[0], acc1{};
      if constexpr (NV > 1) acc1 = load(qr + kV) * kr_v[1];
      for (int x = 2; x < NV; x += 2) {
        acc0 = vfma(load(qr + x * kV), kr_v[x], acc0);
        if (x + 1 < NV) acc1 = vfma(load(qr + (x + 1) * kV), kr_v[x + 1], acc1);
      }
      sc[hh * kSlice + m] = hsum(acc0 + acc1) * scale + (bias ? bias[hh * bias_hs + m] : 0.f);
    }
  }
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t hh = 0; hh < nh; ++hh) {
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
    parts[hh * part] = mx;
    parts[hh * part + 1] = hsum(vs);
  }
  for (int64_t h0 = 0; h0 < nh; h0 += 4) {
    with_count<4>((int)std::min<int64_t>(4, nh - h0), [&]<int NH>() {
      // NH heads' accumulators of XC vectors, their NH weights and one row vector stay in registers.
      for_chunks<(kRegs - 1 - NH) / NH>(NV, [&]<int XC>(int x0) {
        vf acc[NH][XC] = {};
        for (int64_t m = 0; m < len; ++m) {
          if (m + kAhead < len) prefetch_row(v + (int64_t)idx[m + kAhead] * kv_stride + x0 * kV, XC * kV);
          const E* vr = v + (int64_t)idx[m] * kv_stride + x0 * kV;
          vf wv[NH];
          for (int hh = 0; hh < NH; ++hh) wv[hh] = bcast(sc[(h0 + hh) * kSlice + m]);
          for (int x = 0; x < XC; ++x) {
            const vf vv = kv_load_vec(vr + x * kV);
            for (int hh = 0; hh < NH; ++hh) acc[hh][x] = vfma(wv[hh], vv, acc[hh][x]);
          }
        }
        for (int hh = 0; hh < NH; ++hh) {
          float* o = parts + (h0 + hh) * part + 2 + x0 * kV;
          for (int x = 0; x < XC; ++x) store(o + x * kV, acc[hh][x]);
        }
      });
    });
  }
}

}  // namespace decode_detail

// Partial states (tiles::Partial layout: m, l, then D unnormalised output floats) of nh query
// heads, rows q + hh * D, over the keys idx[0 .. len) (1 <= len <= kSlice): key j of the kv head
// is k + j * kv_stride (k and v already offset to the kv head), scores scale * q.k + bias[m]
// (bias may be null; head hh reads bias[hh * bias_hs + m], so bias_hs = 0 shares one bias row
// between the heads, and a bias of -inf hides a key from one head). Head hh's state goes to
// parts + hh * part (m = -inf, l = 0 when every key is hidden from it). sc holds nh * kSlice floats.
template <class E>
void heads_slice_partials(const float* q, int64_t nh, const E* k, const E* v, int64_t kv_stride,
                          const int32_t* idx, const float* bias, int64_t len, int64_t D, float scale, float* sc,
                          float* parts, int64_t part, int64_t bias_hs = 0) {
  const int64_t nv = D % simd::kV == 0 ? D / simd::kV : 0;
  bool done = false;
  auto vec = [&]<int NV>() {
    if (done || nv != NV) return;
    decode_detail::slice_vec<E, NV>(q, nh, k, v, kv_stride, idx, bias, bias_hs, len, scale, sc, parts, part);
    done = true;
  };
  // The head sizes of real models (32 .. 256 dimensions).
  vec.template operator()<2>(), vec.template operator()<4>(), vec.template operator()<5>();
  vec.template operator()<6>(), vec.template operator()<8>(), vec.template operator()<16>();
  if constexpr (simd::kV < 16) vec.template operator()<32>();
  if (!done) decode_detail::slice_generic(q, nh, k, v, kv_stride, idx, bias, bias_hs, len, D, scale, sc, parts, part);
}

}  // namespace focus::cpu
