// KV caches of 16-bit elements: the conversions against the exact scalar converters, the attention
// kernels on a 16-bit cache against the same kernels on its widened floats (bit for bit), the
// decoding kernel against the float64 reference, and a model run on each cache type.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/error.h"
#include "io/ggml_types.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/cached_attention.h"
#include "kernels/cpu/grouped_attention.h"
#include "kernels/cpu/kv_types.h"
#include "model/model.h"
#include "test_util.h"

using namespace focus;
using cpu::AttnShape;
using cpu::KvType;
using cpu::KvView;

namespace {

// Floats of every kind: normal values of many magnitudes, half subnormals and the values around
// them, ties, the overflow edge of half, zeros, infinities and NaN.
std::vector<float> awkward_floats() {
  std::vector<float> x = {0.f, -0.f, 1.f, -1.f, 65504.f, 65519.f, 65520.f, -65520.f, 1e6f, 6.1e-5f, 5.96e-8f,
                          2.98e-8f, 2.99e-8f, 1e-9f, 1e-40f, std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                          1.00048828125f /* a half tie */, 1.0009765625f};
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 5000; ++i) {
    uint32_t u = bits(rng);
    float f;
    std::memcpy(&f, &u, 4);
    x.push_back(f);
  }
  std::normal_distribution<float> nd(0.f, 3.f);
  for (int i = 0; i < 5000; ++i) x.push_back(nd(rng) * std::pow(2.f, (float)(i % 40 - 30)));
  return x;
}

bool same_bits_or_both_nan(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return std::memcmp(&a, &b, 4) == 0;
}

}  // namespace

TEST(KvTypes, StoreAndLoadAgreeWithTheScalarConverters) {
  const std::vector<float> x = awkward_floats();
  const int64_t n = (int64_t)x.size();
  for (KvType t : {KvType::F16, KvType::BF16}) {
    std::vector<uint16_t> stored(n);
    cpu::kv_store(x.data(), n, t, stored.data());
    std::vector<float> back(n), rounded = x;
    cpu::kv_load_floats(KvView(stored.data(), t), n, back.data());
    cpu::kv_round(rounded.data(), n, t);
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t want = t == KvType::F16 ? io::fp32_to_fp16(x[i]) : io::fp32_to_bf16(x[i]);
      const float want_f = t == KvType::F16 ? io::fp16_to_fp32(want) : io::bf16_to_fp32(want);
      if (!std::isnan(x[i])) {
        ASSERT_EQ(stored[i], want) << cpu::to_string(t) << " " << x[i];
      }
      ASSERT_TRUE(same_bits_or_both_nan(back[i], want_f)) << cpu::to_string(t) << " " << x[i];
      ASSERT_TRUE(same_bits_or_both_nan(rounded[i], want_f)) << cpu::to_string(t) << " " << x[i];
    }
  }
  EXPECT_EQ(cpu::parse_kv_type("bf16"), KvType::BF16);
  EXPECT_EQ(cpu::to_string(cpu::parse_kv_type("f16")), "f16");
  EXPECT_THROW(cpu::parse_kv_type("q8"), Error);
}

namespace {

struct Attn {
  std::vector<float> q, k, v;  // k, v: already rounded to the cache type (the widened values)
  std::vector<uint16_t> k16, v16;
  AttnShape s;
};

Attn make_attn(int64_t n_q, int64_t n_kv, int64_t heads, int64_t kv_heads, int64_t hd, int64_t window, KvType t,
               uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  Attn a;
  const int64_t qs = heads * hd, ks = kv_heads * hd;
  a.q.resize(n_q * qs);
  a.k.resize(n_kv * ks);
  a.v.resize(n_kv * ks);
  for (auto& x : a.q) x = nd(rng);
  for (auto& x : a.k) x = nd(rng);
  for (auto& x : a.v) x = nd(rng);
  if (t != KvType::F32) {
    a.k16.resize(a.k.size());
    a.v16.resize(a.v.size());
    cpu::kv_store(a.k.data(), (int64_t)a.k.size(), t, a.k16.data());
    cpu::kv_store(a.v.data(), (int64_t)a.v.size(), t, a.v16.data());
  }
  cpu::kv_round(a.k.data(), (int64_t)a.k.size(), t);
  cpu::kv_round(a.v.data(), (int64_t)a.v.size(), t);
  a.s = AttnShape{n_q, n_kv, n_kv - n_q, heads, kv_heads, hd, qs, ks, qs, 1.0f / std::sqrt((float)hd), window};
  return a;
}

}  // namespace

TEST(KvTypes, FlashAttentionOnA16BitCacheIsTheFloatKernelOnItsValues) {
  for (KvType t : {KvType::F16, KvType::BF16})
    for (int64_t n_q : {1, 3, 70, 200})  // decoding rows, a short chunk, prefill tiles
      for (int64_t hd : {64, 40}) {
        const Attn a = make_attn(n_q, 300, 6, 2, hd, n_q == 70 ? 50 : 0, t, (uint32_t)(n_q + hd));
        std::vector<float> o1(a.q.size()), o2(a.q.size()), l1(6 * n_q), l2(6 * n_q);
        cpu::flash_attention(a.q.data(), KvView(a.k16.data(), t), KvView(a.v16.data(), t), o1.data(), l1.data(), a.s);
        cpu::flash_attention(a.q.data(), a.k.data(), a.v.data(), o2.data(), l2.data(), a.s);
        ASSERT_EQ(std::memcmp(o1.data(), o2.data(), o1.size() * 4), 0) << cpu::to_string(t) << " n_q " << n_q;
        ASSERT_EQ(std::memcmp(l1.data(), l2.data(), l1.size() * 4), 0) << cpu::to_string(t) << " n_q " << n_q;
      }
}

// The decoding kernel (every cached key, split in slices over the threads) against the float64
// reference: head sizes of the vector path (64, 256) and of the scalar one (40), groups of query
// heads that fill the blocks of four and leave a remainder, sliding windows, 16-bit caches.
TEST(KvTypes, DecodingKernelMatchesTheReference) {
  struct C {
    int64_t heads, kv_heads, hd, n_kv, window;
  };
  for (const C& c : {C{9, 3, 64, 700, 0}, C{4, 1, 256, 600, 0}, C{10, 2, 64, 1000, 300}, C{6, 6, 40, 513, 0},
                     C{7, 1, 128, 257, 100}})
    for (KvType t : {KvType::F32, KvType::F16, KvType::BF16})
      for (int64_t n_q : {1, 3}) {
        const Attn a = make_attn(n_q, c.n_kv, c.heads, c.kv_heads, c.hd, c.window, t, (uint32_t)(c.hd * 31 + c.n_kv));
        std::vector<float> o1(a.q.size()), o2(a.q.size());
        const KvView kk = t == KvType::F32 ? KvView(a.k.data()) : KvView(a.k16.data(), t);
        const KvView vv = t == KvType::F32 ? KvView(a.v.data()) : KvView(a.v16.data(), t);
        cpu::decode_attention(a.q.data(), kk, vv, o1.data(), a.s);
        cpu::attention_reference(a.q.data(), a.k.data(), a.v.data(), o2.data(), nullptr, a.s);
        double err = 0;
        for (size_t i = 0; i < o1.size(); ++i) err = std::max(err, (double)std::fabs(o1[i] - o2[i]));
        EXPECT_LT(err, 2e-5) << "heads " << c.heads << "/" << c.kv_heads << " hd " << c.hd << " n_kv " << c.n_kv
                             << " window " << c.window << " " << cpu::to_string(t) << " n_q " << n_q;
      }
}

TEST(KvTypes, CachedFocusAttentionOnA16BitCacheIsTheFloatKernelOnItsValues) {
  for (KvType t : {KvType::F16, KvType::BF16})
    for (FocusMode mode : {FocusMode::Off, FocusMode::Window}) {
      Attn a = make_attn(2, 900, 8, 2, 64, 0, t, 99);
      a.s.local_window = 128;
      a.s.sinks = 2;
      static const FocusLayerCache none;
      std::vector<float> o1(a.q.size()), o2(a.q.size());
      const int64_t p1 = cpu::focus_cached_attention(a.q.data(), KvView(a.k16.data(), t), KvView(a.v16.data(), t),
                                                     o1.data(), a.s, a.s.q_pos0, 2, mode, none);
      const int64_t p2 = cpu::focus_cached_attention(a.q.data(), a.k.data(), a.v.data(), o2.data(), a.s, a.s.q_pos0, 2,
                                                     mode, none);
      EXPECT_EQ(p1, p2);
      ASSERT_EQ(std::memcmp(o1.data(), o2.data(), o1.size() * 4), 0) << cpu::to_string(t);
    }
}

// A model on each cache type: prefill and token-by-token decoding agree (both read the stored
// values), and the 16-bit caches stay close to the float one.
TEST(KvTypes, Stories260KPrefillEqualsDecodeOnEveryCacheType) {
  FOCUS_NEED_FILE(test::stories());
  auto m = load_model(test::stories(), LoadOptions{test::tok512()});
  const int64_t T = 120, D = m->cfg.dim;
  std::vector<int32_t> ids(T);
  for (int64_t i = 0; i < T; ++i) ids[i] = (int32_t)((i * 37 + 11) % m->cfg.vocab);
  std::vector<float> ref(T * D);
  for (KvType t : {KvType::F32, KvType::F16, KvType::BF16}) {
    KVCache a, b;
    a.init(m->cfg, T, t);
    b.init(m->cfg, T, t);
    EXPECT_EQ(a.bytes(), 2 * m->cfg.layers * T * m->cfg.kv_dim() * cpu::kv_type_bytes(t));
    std::vector<float> ha(T * D), hb(D);
    forward(*m, ids.data(), T, a, ha.data());
    double err = 0, l1 = 0, norm = 0;
    for (int64_t i = 0; i < T; ++i) {
      forward(*m, &ids[i], 1, b, hb.data());
      for (int64_t d = 0; d < D; ++d) {
        err = std::max(err, (double)std::fabs(hb[d] - ha[i * D + d]));
        l1 += std::fabs(hb[d] - ha[i * D + d]), norm += std::fabs(ha[i * D + d]);
      }
    }
    // Float32: the two paths differ by summation order only. 16-bit: a key or value that the
    // two paths compute a rounding error apart can round to neighbouring 16-bit values, an error
    // of one unit in the last place of the type that later layers carry on.
    if (t == KvType::F32)
      EXPECT_LT(err, 1e-4);
    else
      EXPECT_LT(l1 / norm, 1e-4) << cpu::to_string(t) << " max " << err;
    if (t == KvType::F32) {
      ref = ha;
    } else {
      double diff = 0, norm = 0;
      for (int64_t i = 0; i < T * D; ++i) diff += std::fabs(ha[i] - ref[i]), norm += std::fabs(ref[i]);
      EXPECT_LT(diff / norm, t == KvType::F16 ? 2e-3 : 2e-2) << cpu::to_string(t);
      EXPECT_GT(diff, 0.0) << "a 16-bit cache must round something";
    }
  }
}

// The grouped (asymmetric) kernel's decoding path on a 16-bit cache: the float kernel on the
// widened values, bit for bit, with query heads of a kv head that read the same groups (one unit)
// and that read different ones (a unit per head).
TEST(KvTypes, GroupedDecodingOnA16BitCacheIsTheFloatKernelOnItsValues) {
  const int64_t n_kv = 700, heads = 6, kv_heads = 2, G = 8, kq = 2;
  for (KvType t : {KvType::F16, KvType::BF16})
    for (bool same_groups : {true, false}) {
      Attn a = make_attn(1, n_kv, heads, kv_heads, 64, 0, t, 5);
      a.s.local_window = 64;
      a.s.sinks = 1;
      std::mt19937 rng(3);
      std::vector<int32_t> key_group(kv_heads * n_kv), qg(heads * kq);
      for (auto& g : key_group) g = (int32_t)(rng() % G);
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t c = 0; c < kq; ++c)
          qg[h * kq + c] = same_groups ? (int32_t)((h / 3) * 2 + c) : (int32_t)((h + 3 * c) % G);
      cpu::GroupedRouting r{G, kv_heads, key_group.data(), (int)kq, qg.data()};
      cpu::GroupedKeyIndex idx;
      idx.build(r, n_kv);
      std::vector<float> o1(a.q.size()), o2(a.q.size()), l1(heads), l2(heads);
      cpu::grouped_attention(a.q.data(), KvView(a.k16.data(), t), KvView(a.v16.data(), t), o1.data(), l1.data(), a.s,
                             r, idx);
      cpu::grouped_attention(a.q.data(), a.k.data(), a.v.data(), o2.data(), l2.data(), a.s, r, idx);
      ASSERT_EQ(std::memcmp(o1.data(), o2.data(), o1.size() * 4), 0) << cpu::to_string(t) << " " << same_groups;
      ASSERT_EQ(std::memcmp(l1.data(), l2.data(), l1.size() * 4), 0) << cpu::to_string(t) << " " << same_groups;
      std::vector<float> o3(a.q.size()), l3(heads);
      cpu::grouped_attention_reference(a.q.data(), a.k.data(), a.v.data(), o3.data(), l3.data(), a.s, r);
      double err = 0;
      for (size_t i = 0; i < o1.size(); ++i) err = std::max(err, (double)std::fabs(o1[i] - o3[i]));
      EXPECT_LT(err, 2e-5) << cpu::to_string(t) << " " << same_groups;
    }
}

// The memory estimate's KV part is what the cache allocates; the limit's units parse.
TEST(MemoryEstimate, KvCacheEstimateIsTheAllocationAndLimitsParse) {
  ModelConfig c;
  c.layers = 3, c.dim = 32, c.heads = 4, c.kv_heads = 2, c.head_dim = 8, c.ffn = 64, c.vocab = 100;
  for (KvType t : {KvType::F32, KvType::F16, KvType::BF16}) {
    KVCache cache;
    cache.init(c, 37, t);
    const MemoryNeed need = inference_memory(c, 37, 5, t, 2);
    ASSERT_FALSE(need.parts.empty());
    EXPECT_EQ(need.parts[0].first, "KV cache");
    EXPECT_EQ(need.parts[0].second, (double)cache.bytes());
    EXPECT_GT(need.total(), need.parts[0].second);
    // Two layers' keys and values kept again while decoding (grouped Focus's runs of its groups).
    const MemoryNeed more = inference_memory(c, 37, 5, t, 2, 2);
    EXPECT_EQ(more.total() - need.total(), 2.0 * (double)cache.bytes() / (double)c.layers);
  }
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(3.0 * (1 << 30)), "3.00 GiB");
  setenv("FOCUS_MEMORY_LIMIT", "1.5G", 1);
  EXPECT_EQ(available_memory(), (int64_t)(1.5 * (1 << 30)));
  setenv("FOCUS_MEMORY_LIMIT", "off", 1);
  EXPECT_EQ(available_memory(), -1);
  MemoryNeed huge;
  huge.add("everything", 1e30);
  EXPECT_NO_THROW(check_memory("job", huge, ""));  // off: no check
  setenv("FOCUS_MEMORY_LIMIT", "1000", 1);
  try {
    check_memory("job", huge, "do less");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("job needs about"), std::string::npos) << m;
    EXPECT_NE(m.find("(everything "), std::string::npos) << m;
    EXPECT_NE(m.find("1000 B is free; do less"), std::string::npos) << m;
  }
  unsetenv("FOCUS_MEMORY_LIMIT");
  EXPECT_GT(available_memory(), 0);  // this machine's reading
}

// A layer's keys and values of 2 MiB or more start on a 2 MiB boundary (where a transparent huge
// page can back them: sparse decoding gathers rows from anywhere in them); smaller ones on a cache
// line.
TEST(KvTypes, LargeCacheLayersAreHugePageAligned) {
  focus::ModelConfig c;
  c.layers = 2;
  c.dim = 64;
  c.heads = 4;
  c.kv_heads = 2;
  c.head_dim = 64;
  for (auto [rows, align] : {std::pair<int64_t, uintptr_t>{16384, uintptr_t{2} << 20}, {100, 64}}) {
    for (KvType t : {KvType::F32, KvType::F16}) {
      focus::KVCache cache;
      cache.init(c, rows, t);
      for (int64_t l = 0; l < c.layers; ++l) {
        EXPECT_EQ(reinterpret_cast<uintptr_t>(cache.k_layer(l)) % align, 0u) << rows << " rows, layer " << l;
        EXPECT_EQ(reinterpret_cast<uintptr_t>(cache.v_layer(l)) % align, 0u) << rows << " rows, layer " << l;
      }
    }
  }
}
