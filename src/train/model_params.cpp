#include "train/model_params.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/rng.h"
#include "io/safetensors_writer.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace focus {
namespace {

// Which weight of the model a tensor is.
enum class Slot {
  TokEmb, OutNorm, LmHead,
  AttnNorm, Wq, Wk, Wv, Wo, QNorm, KNorm, PostAttnNorm, FfnNorm, WGate, WUp, WDown, PostFfnNorm, KvANorm, WKvB, WqA, QANorm
};

struct Entry {
  ParamTensor t;
  int64_t layer = -1;
  Slot slot = Slot::TokEmb;
  bool norm = false;      // a norm scale (initialised to 1)
  bool residual = false;  // writes into the residual stream (smaller initialisation)
};

void check_supported(const ModelConfig& c) {
  FOCUS_CHECK(c.arch == Arch::Llama || c.arch == Arch::Gemma3 || c.arch == Arch::DeepseekV2,
              "training from scratch supports the Llama family, Gemma 3 and DeepSeek-V2 (got ", to_string(c.arch), ")");
  FOCUS_CHECK(c.vocab > 0 && c.dim > 0 && c.layers > 0 && c.heads > 0 && c.kv_heads > 0 && c.head_dim > 0 &&
                  c.ffn > 0 && c.heads % c.kv_heads == 0,
              "training from scratch: bad model sizes (vocab ", c.vocab, ", dim ", c.dim, ", layers ", c.layers,
              ", heads ", c.heads, ", kv heads ", c.kv_heads, ", head dim ", c.head_dim, ", ffn ", c.ffn, ")");
}

std::vector<Entry> layout(const ModelConfig& c) {
  check_supported(c);
  const int64_t D = c.dim, QD = c.q_dim(), KD = c.kv_dim(), F = c.ffn;
  const bool gemma = c.arch == Arch::Gemma3;
  std::vector<Entry> e;
  auto add = [&](std::string name, std::vector<int64_t> shape, int64_t layer, Slot slot, bool norm = false,
                 bool residual = false) {
    Entry x;
    x.t.name = std::move(name);
    x.t.shape = std::move(shape);
    x.t.decay = x.t.shape.size() == 2;
    x.layer = layer;
    x.slot = slot;
    x.norm = norm;
    x.residual = residual;
    e.push_back(std::move(x));
  };
  add("model.embed_tokens.weight", {c.vocab, D}, -1, Slot::TokEmb);
  for (int64_t l = 0; l < c.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {D}, l, Slot::AttnNorm, true);
    if (c.mla()) {
      if (c.mla_q_rank > 0) {
        add(p + "self_attn.q_a_proj.weight", {c.mla_q_rank, D}, l, Slot::WqA);
        add(p + "self_attn.q_a_layernorm.weight", {c.mla_q_rank}, l, Slot::QANorm, true);
        add(p + "self_attn.q_b_proj.weight", {c.q_proj_dim(), c.mla_q_rank}, l, Slot::Wq);
      } else {
        add(p + "self_attn.q_proj.weight", {c.q_proj_dim(), D}, l, Slot::Wq);
      }
      add(p + "self_attn.kv_a_proj_with_mqa.weight", {c.mla_kv_rank + c.mla_rope, D}, l, Slot::Wk);
      add(p + "self_attn.kv_a_layernorm.weight", {c.mla_kv_rank}, l, Slot::KvANorm, true);
      add(p + "self_attn.kv_b_proj.weight", {c.heads * (c.mla_nope + c.mla_v), c.mla_kv_rank}, l, Slot::WKvB);
      add(p + "self_attn.o_proj.weight", {D, c.o_proj_dim()}, l, Slot::Wo, false, true);
      add(p + "post_attention_layernorm.weight", {D}, l, Slot::FfnNorm, true);
      add(p + "mlp.gate_proj.weight", {F, D}, l, Slot::WGate);
      add(p + "mlp.up_proj.weight", {F, D}, l, Slot::WUp);
      add(p + "mlp.down_proj.weight", {D, F}, l, Slot::WDown, false, true);
      continue;
    }
    add(p + "self_attn.q_proj.weight", {QD, D}, l, Slot::Wq);
    add(p + "self_attn.k_proj.weight", {KD, D}, l, Slot::Wk);
    add(p + "self_attn.v_proj.weight", {KD, D}, l, Slot::Wv);
    add(p + "self_attn.o_proj.weight", {D, QD}, l, Slot::Wo, false, true);
    if (gemma) {
      add(p + "self_attn.q_norm.weight", {c.head_dim}, l, Slot::QNorm, true);
      add(p + "self_attn.k_norm.weight", {c.head_dim}, l, Slot::KNorm, true);
      add(p + "post_attention_layernorm.weight", {D}, l, Slot::PostAttnNorm, true);
      add(p + "pre_feedforward_layernorm.weight", {D}, l, Slot::FfnNorm, true);
    } else {
      add(p + "post_attention_layernorm.weight", {D}, l, Slot::FfnNorm, true);
    }
    add(p + "mlp.gate_proj.weight", {F, D}, l, Slot::WGate);
    add(p + "mlp.up_proj.weight", {F, D}, l, Slot::WUp);
    add(p + "mlp.down_proj.weight", {D, F}, l, Slot::WDown, false, true);
    if (gemma) add(p + "post_feedforward_layernorm.weight", {D}, l, Slot::PostFfnNorm, true);
  }
  add("model.norm.weight", {D}, -1, Slot::OutNorm, true);
  if (!c.tied_output) add("lm_head.weight", {c.vocab, D}, -1, Slot::LmHead);
  return e;
}

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Calls f(entry, index) for each tensor of p, checking p against its config's layout.
template <class F>
void for_each(const ModelParams& p, F f) {
  const std::vector<Entry> e = layout(p.cfg);
  FOCUS_CHECK(e.size() == p.tensors.size() && p.data.size() == p.tensors.size(), "model parameters: ",
              p.tensors.size(), " tensors where the configuration has ", e.size());
  for (size_t i = 0; i < e.size(); ++i) {
    FOCUS_CHECK(e[i].t.name == p.tensors[i].name && e[i].t.shape == p.tensors[i].shape &&
                    (int64_t)p.data[i].size() == numel(e[i].t.shape),
                "model parameters: tensor ", i, " (", p.tensors[i].name, ") does not match the configuration");
    f(e[i], i);
  }
}

}  // namespace

const std::vector<std::string>& preset_names() {
  static const std::vector<std::string> n = {"mha", "gqa", "mqa", "local-global", "mla"};
  return n;
}

ModelConfig preset_config(const std::string& arch, int64_t vocab, int64_t ctx) {
  FOCUS_CHECK(vocab > 0, "preset '", arch, "': the vocabulary is empty");
  FOCUS_CHECK(ctx >= 8, "preset '", arch, "': ctx must be at least 8 (got ", ctx, ")");
  ModelConfig c;
  c.vocab = vocab;
  c.dim = 256;
  c.layers = 6;
  c.heads = 8;
  c.head_dim = 32;
  c.ffn = 704;
  c.max_ctx = ctx;
  c.rope_style = cpu::RopeStyle::SplitHalf;  // the Hugging Face layout the saved model uses
  c.rope_theta = c.rope_theta_local = 10000.f;
  c.tied_output = true;
  c.layer_sliding_window.assign(c.layers, 0);
  if (arch == "mha" || arch == "gqa" || arch == "mqa") {
    c.arch = Arch::Llama;
    c.arch_name = "llama";
    c.kv_heads = arch == "mha" ? 8 : arch == "gqa" ? 2 : 1;
    c.norm_eps = 1e-5f;
  } else if (arch == "local-global") {
    c.arch = Arch::Gemma3;
    c.arch_name = "gemma3_text";
    c.kv_heads = 2;
    c.norm_eps = 1e-6f;
    const int64_t w = std::max<int64_t>(1, ctx / 4);
    for (int64_t l = 0; l < c.layers; ++l) c.layer_sliding_window[l] = (l % 3 == 2) ? 0 : w;
  } else if (arch == "mla") {
    c.arch = Arch::DeepseekV2;
    c.arch_name = "deepseek_v2";
    c.norm_eps = 1e-6f;
    c.mla_kv_rank = 64;
    c.mla_q_rank = 128;
    c.mla_nope = 32;
    c.mla_rope = 16;
    c.mla_v = 32;
  } else {
    std::string names;
    for (const auto& n : preset_names()) names += (names.empty() ? "" : ", ") + n;
    FOCUS_CHECK(false, "unknown --arch '", arch, "' (presets: ", names, ")");
  }
  apply_arch_defaults(c);  // norms, MLP, positions, embedding scale, MLA's head: as the loader sets them
  return c;
}

int64_t ModelParams::n_params() const {
  int64_t n = 0;
  for (const auto& d : data) n += (int64_t)d.size();
  return n;
}

ModelParams init_model_params(const ModelConfig& c, uint64_t seed) {
  ModelParams p;
  p.cfg = c;
  Rng rng{seed * 0x9e3779b97f4a7c15ull + 0x5eed};
  const double std_base = 0.02, std_resid = 0.02 / std::sqrt(2.0 * (double)c.layers);
  for (Entry& e : layout(c)) {
    std::vector<float> d(numel(e.t.shape));
    if (e.norm) {
      std::fill(d.begin(), d.end(), 1.0f);
    } else {
      const double sd = e.residual ? std_resid : std_base;
      for (float& x : d) x = (float)(sd * rng.normal());
    }
    p.tensors.push_back(e.t);
    p.data.push_back(std::move(d));
  }
  return p;
}

namespace {

// Points the field of slot s at a tensor: mat for matrices and embeddings, vec for norm scales.
// The same switch serves the model's weights (Weight, const float*) and its gradients (float*).
template <class Top, class Layer, class Mat, class Vec>
void set_slot(Slot s, Top& top, Layer* L, const Mat& mat, Vec vec) {
  switch (s) {
    case Slot::TokEmb: top.tok_emb = mat; break;
    case Slot::OutNorm: top.out_norm = vec; break;
    case Slot::LmHead: top.lm_head = mat; break;
    case Slot::AttnNorm: L->attn_norm = vec; break;
    case Slot::Wq: L->wq = mat; break;
    case Slot::Wk: L->wk = mat; break;
    case Slot::Wv: L->wv = mat; break;
    case Slot::Wo: L->wo = mat; break;
    case Slot::QNorm: L->q_norm = vec; break;
    case Slot::KNorm: L->k_norm = vec; break;
    case Slot::PostAttnNorm: L->post_attn_norm = vec; break;
    case Slot::FfnNorm: L->ffn_norm = vec; break;
    case Slot::WGate: L->w_gate = mat; break;
    case Slot::WUp: L->w_up = mat; break;
    case Slot::WDown: L->w_down = mat; break;
    case Slot::PostFfnNorm: L->post_ffn_norm = vec; break;
    case Slot::KvANorm: L->kv_a_norm = vec; break;
    case Slot::WKvB: L->w_kv_b = mat; break;
    case Slot::WqA: L->wq_a = mat; break;
    case Slot::QANorm: L->q_a_norm = vec; break;
  }
}

}  // namespace

void bind_model(const ModelParams& p, Model& m) {
  const ModelConfig& c = p.cfg;
  m.cfg = c;
  m.w = ModelWeights();
  m.w.layers.resize(c.layers);
  m.w.weights_mode = "f32";
  m.w.n_params = p.n_params();
  for_each(p, [&](const Entry& e, size_t i) {
    const float* d = p.data[i].data();
    const int64_t rows = e.t.shape[0], cols = e.t.shape.size() > 1 ? e.t.shape[1] : 1;
    set_slot(e.slot, m.w, e.layer >= 0 ? &m.w.layers[e.layer] : nullptr, Weight::f32(d, rows, cols), d);
  });
  if (c.tied_output) m.w.lm_head = m.w.tok_emb;
}

ModelGrads bind_grads(const ModelParams& p, std::vector<std::vector<float>>& grads) {
  grads.resize(p.data.size());
  for (size_t i = 0; i < p.data.size(); ++i) grads[i].assign(p.data[i].size(), 0.f);
  return grad_views(p, grads);
}

ModelGrads grad_views(const ModelParams& p, std::vector<std::vector<float>>& grads, size_t offset) {
  FOCUS_CHECK(grads.size() >= offset + p.data.size(), "model gradients: ", grads.size() - std::min(offset, grads.size()),
              " buffers for ", p.data.size(), " tensors");
  ModelGrads g;
  g.layers.resize(p.cfg.layers);
  for_each(p, [&](const Entry& e, size_t i) {
    FOCUS_CHECK(grads[offset + i].size() == p.data[i].size(), "model gradients: the buffer of ", e.t.name,
                " has the wrong size");
    float* d = grads[offset + i].data();
    set_slot(e.slot, g, e.layer >= 0 ? &g.layers[e.layer] : nullptr, d, d);
  });
  if (p.cfg.tied_output) g.lm_head = g.tok_emb;
  return g;
}

std::string hf_config_json(const ModelConfig& c, int32_t bos, int32_t eos) {
  check_supported(c);
  json j;
  j["hidden_size"] = c.dim;
  j["num_hidden_layers"] = c.layers;
  j["num_attention_heads"] = c.heads;
  j["num_key_value_heads"] = c.kv_heads;
  j["head_dim"] = c.head_dim;
  j["intermediate_size"] = c.ffn;
  j["vocab_size"] = c.vocab;
  j["max_position_embeddings"] = c.max_ctx;
  j["rms_norm_eps"] = c.norm_eps;
  j["rope_theta"] = c.rope_theta;
  j["tie_word_embeddings"] = c.tied_output;
  j["torch_dtype"] = "float32";
  if (bos >= 0) j["bos_token_id"] = bos;
  if (eos >= 0) j["eos_token_id"] = eos;
  if (c.arch == Arch::Gemma3) {
    j["model_type"] = "gemma3_text";
    j["architectures"] = {"Gemma3ForCausalLM"};
    j["hidden_activation"] = "gelu_pytorch_tanh";
    j["rope_local_base_freq"] = c.rope_theta_local;
    j["query_pre_attn_scalar"] = 1.0 / ((double)c.attn_scale * c.attn_scale);
    int64_t sw = 0;
    json types = json::array();
    for (int64_t w : c.layer_sliding_window) {
      FOCUS_CHECK(w == 0 || sw == 0 || w == sw, "Gemma 3 layout: every sliding-window layer must share one window");
      if (w > 0) sw = w;
      types.push_back(w > 0 ? "sliding_attention" : "full_attention");
    }
    j["sliding_window"] = sw > 0 ? sw : c.max_ctx;
    j["layer_types"] = types;
  } else if (c.arch == Arch::DeepseekV2) {
    j["model_type"] = "deepseek_v2";
    j["architectures"] = {"DeepseekV2ForCausalLM"};
    j["hidden_act"] = "silu";
    if (c.mla_q_rank > 0) j["q_lora_rank"] = c.mla_q_rank;
    else j["q_lora_rank"] = nullptr;
    j["kv_lora_rank"] = c.mla_kv_rank;
    j["qk_nope_head_dim"] = c.mla_nope;
    j["qk_rope_head_dim"] = c.mla_rope;
    j["v_head_dim"] = c.mla_v;
    j["num_key_value_heads"] = c.heads;
    j.erase("head_dim");  // per-part head sizes above
    j["n_routed_experts"] = nullptr;
    j["first_k_dense_replace"] = c.layers;
    j["attention_bias"] = false;
    j["rope_scaling"] = nullptr;
  } else {
    FOCUS_CHECK(c.rope_style == cpu::RopeStyle::SplitHalf, "the Hugging Face Llama layout rotates split halves");
    j["model_type"] = "llama";
    j["architectures"] = {"LlamaForCausalLM"};
    j["hidden_act"] = "silu";
  }
  return j.dump(2) + "\n";
}

void save_model_params(const ModelParams& p, const std::string& dir, const std::string& tokenizer_path) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  FOCUS_CHECK(!ec, dir, ": cannot create the folder: ", ec.message());
  std::map<std::string, io::F32Tensor> tensors;
  const bool gemma = p.cfg.arch == Arch::Gemma3;
  for_each(p, [&](const Entry& e, size_t i) {
    io::F32Tensor t{e.t.shape, p.data[i]};
    if (gemma && e.norm)  // Gemma's files store the norm scale minus one
      for (float& x : t.data) x -= 1.0f;
    tensors.emplace(e.t.name, std::move(t));
  });
  io::save_safetensors((fs::path(dir) / "model.safetensors").string(), tensors, {{"format", "pt"}});
  int32_t bos = -1, eos = -1;
  if (!tokenizer_path.empty()) {
    const fs::path src(tokenizer_path);
    const std::string name = src.filename().string();
    const bool is_json = name.size() > 5 && name.substr(name.size() - 5) == ".json";
    FOCUS_CHECK(fs::is_regular_file(src), tokenizer_path,
                ": the tokenizer to save with the model must be a tokenizer.json or a llama2.c tokenizer .bin file");
    std::ifstream in(src, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    FOCUS_CHECK(in.good() || in.eof(), tokenizer_path, ": cannot read");
    io::write_file_atomic((fs::path(dir) / (is_json ? "tokenizer.json" : "tokenizer.bin")).string(), ss.str());
  }
  io::write_file_atomic((fs::path(dir) / "config.json").string(), hf_config_json(p.cfg, bos, eos));
}

}  // namespace focus
