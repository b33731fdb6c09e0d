// The inference forward pass: embeddings, the blocks (block.h) over the KV cache, the final norm.
#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/grouped_attention.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/sparse_attention.h"
#include "model/block.h"
#include "model/model.h"

namespace focus {

void KVCache::init(const ModelConfig& c, int64_t cap, cpu::KvType t, bool keep_rows) {
  capacity = cap;
  len = 0;
  kv_dim = c.kv_dim();
  type = t;
  k.clear(), v.clear(), k16.clear(), v16.clear();
  shared = c.shared_kv();
  keeps_rows = keeps_rows_for(c, keep_rows);
  if (!keeps_rows) {
    state.clear();
    state.resize(c.layers);
    return;
  }
  // Each layer's arrays are allocated unset, then zeroed in 2 MiB pieces by every thread: the
  // system clears each page on its first touch (hundreds of MB at ctx 8192), and the threads
  // touch theirs side by side instead of one thread touching all.
  constexpr size_t kPiece = size_t{2} << 20;
  std::vector<std::pair<char*, size_t>> pieces;  // (start, bytes): every 2 MiB of every array
  auto make = [&](auto& rows) {
    rows.reserve(c.layers);
    for (int64_t l = 0; l < c.layers; ++l) {
      auto& a = rows.emplace_back(cap * kv_dim);
      char* p = reinterpret_cast<char*>(a.data());
      const size_t n = a.size() * sizeof(a[0]);
      for (size_t o = 0; o < n; o += kPiece) pieces.emplace_back(p + o, std::min(kPiece, n - o));
    }
  };
  if (t == cpu::KvType::F32) {
    make(k);
    if (!shared) make(v);
  } else {
    make(k16);
    if (!shared) make(v16);
  }
  const int64_t np = (int64_t)pieces.size();
#pragma omp parallel for schedule(static) if (np > 1)
  for (int64_t i = 0; i < np; ++i) std::memset(pieces[i].first, 0, pieces[i].second);
  state.clear();
  state.resize(c.layers);
}

int64_t KVCache::bytes() const {
  return (shared ? 1 : 2) * (int64_t)std::max(k.size(), k16.size()) * capacity * kv_dim * cpu::kv_type_bytes(type);
}

MemoryNeed inference_memory(const ModelConfig& c, int64_t positions, int64_t batch, cpu::KvType kv,
                            int64_t logit_rows, int64_t kv_copies) {
  const double D = (double)c.dim, QD = (double)c.q_dim(), KD = (double)c.kv_dim(), F = (double)c.ffn;
  const double layer_kv = (c.shared_kv() ? 1.0 : 2.0) * (double)positions * KD * (double)cpu::kv_type_bytes(kv);
  MemoryNeed need;
  if (positions > 0) need.add("KV cache", (double)c.layers * layer_kv);
  if (kv_copies > 0) need.add("routed layers' group runs (decoding)", (double)kv_copies * layer_kv);
  // The block's buffers (norms, q, k, v, attention output, residual, MLP) and the hidden states;
  // the sparse kernels' per-head routing adds a little per token.
  need.add("activations",
           4.0 * (double)batch * (7 * D + 2 * QD + 2 * KD + 2 * F + 4.0 * (double)c.heads));
  need.add("logits", 4.0 * (double)logit_rows * (double)c.vocab);
  return need;
}

void check_inference_memory(const std::string& what, const ModelConfig& c, int64_t positions, int64_t batch,
                            cpu::KvType kv, int64_t logit_rows, const std::string& hint, int64_t kv_copies) {
  check_memory(what, inference_memory(c, positions, batch, kv, logit_rows, kv_copies),
               hint + (kv == cpu::KvType::F32 && positions > 0 ? ", or use --kv-type f16" : ""));
}

int64_t decode_kv_copies(const ModelConfig& c, const AttentionPlan* plan) {
  int64_t n = 0;
  if (plan)
    for (int64_t l = 0; l < c.layers; ++l) n += plan->at(l).decode_kv_copies();
  return n;
}

void KVCache::truncate(int64_t n) {
  FOCUS_CHECK(n >= 0 && n <= len, "KVCache: cannot keep ", n, " of ", len, " positions");
  for (auto& s : state)
    if (s) s->truncate(n);
  len = n;
}

void forward(const Model& m, const int32_t* ids, int64_t T, KVCache& cache, float* hidden, const AttentionPlan* plan,
             AttentionStats* stats) {
  const ModelConfig& c = m.cfg;
  const int64_t pos0 = cache.len;
  FOCUS_CHECK(T > 0, "forward: empty input");
  FOCUS_CHECK(cache.keeps_rows || pos0 == 0, "forward: the KV cache keeps no rows (it scores one window from "
              "position 0), but ", pos0, " positions were run before; make it with rows kept");
  FOCUS_CHECK(pos0 + T <= cache.capacity, "forward: ", pos0 + T, " positions exceed the cache capacity ",
              cache.capacity);
  if (c.learned_pos)
    FOCUS_CHECK(pos0 + T <= c.max_ctx, "forward: position ", pos0 + T - 1, " is beyond the model's ", c.max_ctx,
                " learned positions");

  float* x = hidden;  // the residual stream lives in the output buffer
  embed_tokens(m, ids, T, pos0, x);
  BlockActs acts;  // one set of buffers for every layer
  for (int64_t l = 0; l < c.layers; ++l) {
    BlockIO io;
    io.layer = l;
    io.pos0 = pos0;
    io.T = T;
    io.x_in = x;
    io.x_out = x;
    io.kv_type = cache.type;
    io.k_cache = cache.k_layer(l);
    io.v_cache = cache.v_layer(l);
    const AttentionPolicy& policy = plan ? plan->at(l) : dense_attention();
    block_forward(m, policy, io, acts, cache.state[l], stats);
  }
  model_norm(c, x, m.w.out_norm, m.w.out_norm_b, x, T);
  cache.len = pos0 + T;
  cpu::focus_attention_trim_scratch(kAttentionScratchKept);
  cpu::grouped_attention_trim_scratch(kAttentionScratchKept);
}

void compute_logits(const Model& m, const float* hidden, int64_t rows, float* logits) {
  cpu::linear(hidden, m.w.lm_head, nullptr, logits, rows, m.cfg.dim, m.cfg.vocab);
}

std::string to_string(Arch a) {
  switch (a) {
    case Arch::Llama: return "llama";
    case Arch::Gemma3: return "gemma3";
    case Arch::GPT2: return "gpt2";
    case Arch::DeepseekV2: return "deepseek_v2";
  }
  return "?";
}

}  // namespace focus
