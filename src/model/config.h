// What a model is: the architecture and its sizes. Everything that differs between
// architectures is decided here (arch_traits) and in the loaders, never inside kernels.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cpu/ops.h"

namespace focus {

enum class Arch { Llama, Gemma3, GPT2, DeepseekV2 };
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
  // Multi-head latent attention (DeepSeek-V2; mla_kv_rank > 0). Per head, the query and key have
  // mla_nope dims without and mla_rope dims with RoPE (the key's RoPE part shared by the heads),
  // the value mla_v dims; keys and values come up from one latent of mla_kv_rank dims per token.
  // The engine runs it absorbed: each head's no-RoPE query is taken into the latent space through
  // the key up-projection, so attention is multi-query over rows [k_pe | latent] of head_dim =
  // mla_rope + mla_kv_rank (kv_heads 1, keys and values the same row: the KV cache holds the
  // latent once), and each head's output goes back up through the value up-projection.
  // mla_q_rank > 0: the queries come from a low-rank latent too (q_a_proj [q_rank, dim], its RMS
  // norm, q_b_proj [q_proj_dim, q_rank]); 0: one q_proj [q_proj_dim, dim].
  int64_t mla_kv_rank = 0, mla_nope = 0, mla_rope = 0, mla_v = 0, mla_q_rank = 0;

  bool mla() const { return mla_kv_rank > 0; }
  int64_t q_dim() const { return heads * head_dim; }   // the attention's query row
  int64_t kv_dim() const { return kv_heads * head_dim; }
  // Widths of the query projection's output and the output projection's input.
  int64_t q_proj_dim() const { return mla() ? heads * (mla_nope + mla_rope) : q_dim(); }
  int64_t o_proj_dim() const { return mla() ? heads * mla_v : q_dim(); }
  // Keys and values share their cache rows (MLA).
  bool shared_kv() const { return mla(); }
};

std::string to_string(Arch a);

}  // namespace focus
