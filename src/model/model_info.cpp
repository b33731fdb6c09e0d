#include "model/model_info.h"

#include <cstdarg>
#include <cstdio>

namespace focus {
namespace {
__attribute__((format(printf, 2, 3))) void appendf(std::string& s, const char* fmt, ...) {
  char b[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(b, sizeof(b), fmt, ap);
  va_end(ap);
  s += b;
}
}  // namespace

nlohmann::json model_info_json(const Model& m) {
  const ModelConfig& c = m.cfg;
  nlohmann::json j;
  j["path"] = m.path;
  j["format"] = m.format;
  j["architecture"] = c.arch_name;
  j["vocab"] = c.vocab;
  j["dim"] = c.dim;
  j["layers"] = c.layers;
  j["heads"] = c.heads;
  j["kv_heads"] = c.kv_heads;
  j["head_dim"] = c.head_dim;
  j["ffn"] = c.ffn;
  j["context"] = c.max_ctx;
  j["params"] = m.w.n_params;
  j["tied_output"] = c.tied_output;
  j["tensor_types"] = m.w.tensor_types;
  j["weights"] = m.w.weights_mode;
  j["matrix_bytes"] = m.w.matrix_bytes();
  j["layer_sliding_window"] = c.layer_sliding_window;
  j["rope"] = c.rope_dim == 0 ? "none"
                              : (c.rope_style == cpu::RopeStyle::Interleaved ? "interleaved" : "split-half");
  j["rope_theta"] = c.rope_theta;
  if (m.tok) j["tokenizer_vocab"] = m.tok->vocab_size();
  return j;
}

std::string model_info_text(const Model& m) {
  const ModelConfig& c = m.cfg;
  std::string s;
  appendf(s, "model:        %s (%s)\n", m.path.c_str(), m.format.c_str());
  appendf(s, "architecture: %s\n", c.arch_name.c_str());
  appendf(s, "sizes:        vocab %lld, dim %lld, layers %lld, heads %lld, kv heads %lld, head dim %lld, ffn %lld, ctx %lld\n",
       (long long)c.vocab, (long long)c.dim, (long long)c.layers, (long long)c.heads, (long long)c.kv_heads,
       (long long)c.head_dim, (long long)c.ffn, (long long)c.max_ctx);
  if (c.mla())
    appendf(s,
            "latent attn:  kv rank %lld, q rank %lld, per head %lld + %lld (RoPE) query-key dims, %lld value dims; "
            "run as multi-query over rows of %lld (the KV cache holds the latent once)\n",
            (long long)c.mla_kv_rank, (long long)c.mla_q_rank, (long long)c.mla_nope, (long long)c.mla_rope,
            (long long)c.mla_v, (long long)c.head_dim);
  appendf(s, "parameters:   %lld (%.1f M)%s\n", (long long)m.w.n_params, m.w.n_params / 1e6,
       c.tied_output ? ", output tied to embeddings" : "");
  const char* rope = c.rope_dim == 0 ? "none"
                                     : (c.rope_style == cpu::RopeStyle::Interleaved ? "interleaved" : "split-half");
  appendf(s, "positions:    %s, theta %g\n", rope, c.rope_theta);
  int64_t local = 0;
  for (auto w : c.layer_sliding_window) local += w > 0;
  if (local)
    appendf(s, "attention:    %lld sliding-window layers (window %lld), %lld global\n", (long long)local,
         (long long)c.layer_sliding_window[0], (long long)(c.layers - local));
  std::string types;
  for (auto& t : m.w.tensor_types) types += (types.empty() ? "" : ", ") + t;
  s += "tensor types: " + types + "\n";
  appendf(s, "weights:      %s, matrices %.1f MB in memory\n", m.w.weights_mode.c_str(), m.w.matrix_bytes() / 1e6);
  if (m.tok) appendf(s, "tokenizer:    %d tokens, bos %d, eos %d\n", m.tok->vocab_size(), m.tok->bos(), m.tok->eos());
  return s;
}

}  // namespace focus
