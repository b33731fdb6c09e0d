// What a model is: the architecture and its sizes. Everything that differs between
// architectures is decided here (arch_traits) and in the loaders, never inside kernels.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cpu/ops.h"

namespace focus {

enum class Arch { Llama, Gemma3, GPT2 };
enum class NormKind { RMS, Layer };
enum class MlpKind { SwiGLU, GeGLU, GELU };

struct ModelConfig {
  Arch arch = Arch::Llama;
  std::string arch_name;      // as the file names it ("llama", "gemma3", "gpt2")
  int64_t vocab = 0, dim = 0, layers = 0, heads = 0, kv_heads = 0, head_dim = 0, ffn = 0;
  int64_t max_ctx = 0;        // trained context length
  float norm_eps = 1e-5f;
  NormKind norm = NormKind::RMS;
  MlpKind mlp = MlpKind::SwiGLU;
  // Positions.
  bool learned_pos = false;   // GPT-2
  cpu::RopeStyle rope_style = cpu::RopeStyle::Interleaved;
  int64_t rope_dim = 0;       // rotated dims per head (0 = none)
  float rope_theta = 10000.f;        // global layers
  float rope_theta_local = 10000.f;  // sliding-window layers (Gemma 3)
  // Attention.
  float attn_scale = 0.f;     // multiplies q.k (1/sqrt(head_dim) unless the model says otherwise)
  std::vector<int64_t> layer_sliding_window;  // per layer: 0 = global causal, w = sliding window of w keys
  bool qk_norm = false;       // per-head RMSNorm of q and k (Gemma 3)
  bool post_norms = false;    // norms on the attention / MLP outputs before the residual (Gemma 3)
  float embed_scale = 1.f;    // token embeddings are multiplied by this (Gemma: sqrt(dim))
  bool tied_output = true;

  int64_t q_dim() const { return heads * head_dim; }
  int64_t kv_dim() const { return kv_heads * head_dim; }
};

std::string to_string(Arch a);

}  // namespace focus
