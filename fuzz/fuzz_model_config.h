// The shapes of the tiny models the tests use (vocab 50, dim 32, 3 layers, 4 heads, head dim 8,
// ffn 48): a Llama with 2 kv heads, and a Gemma 3 whose layers 0 and 2 use a sliding window.
// Router and adapter folders are checked against these.
#pragma once
#include <cmath>

#include "model/config.h"

namespace focus::fuzz {

inline ModelConfig tiny_config(bool gemma) {
  ModelConfig c;
  c.arch = gemma ? Arch::Gemma3 : Arch::Llama;
  c.vocab = 50;
  c.dim = 32;
  c.layers = 3;
  c.heads = 4;
  c.kv_heads = 2;
  c.head_dim = 8;
  c.ffn = 48;
  c.max_ctx = 64;
  c.rope_dim = 8;
  c.norm_eps = 1e-5f;
  c.attn_scale = 1.f / std::sqrt(8.f);
  c.layer_sliding_window = gemma ? std::vector<int64_t>{5, 0, 5} : std::vector<int64_t>{0, 0, 0};
  return c;
}

}  // namespace focus::fuzz
