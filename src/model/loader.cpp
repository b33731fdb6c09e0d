// Loading models from GGUF, llama2.c and safetensors checkpoints. Each format maps its own
// tensor names and conventions onto ModelConfig / ModelWeights here.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <type_traits>

#include "core/error.h"
#include "core/mapped_file.h"
#include "core/memory.h"
#include "io/gguf.h"
#include "io/safetensors.h"
#include "model/model.h"

namespace fs = std::filesystem;

namespace focus {
namespace {

// A JSON number read as T. An integer setting written as a float must hold a whole number in
// range (converting anything else would be undefined).
template <class T>
T json_number(const nlohmann::json& v, const char* key, const std::string& path) {
  FOCUS_CHECK(v.is_number(), path, ": '", key, "' is not a number");
  if constexpr (std::is_integral_v<T>) {
    if (v.is_number_float()) {
      const double d = v.get<double>();
      FOCUS_CHECK(std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e15, path, ": '", key,
                  "' is not an integer (", d, ")");
      return (T)d;
    }
  }
  return v.get<T>();
}

// The sizes a header gives, checked before anything is allocated from them (layer tables first).
void check_sizes(const ModelConfig& c, const std::string& path) {
  FOCUS_CHECK(c.vocab > 0 && c.dim > 0 && c.layers > 0 && c.heads > 0 && c.kv_heads > 0 && c.ffn > 0, path,
              ": invalid model sizes (vocab ", c.vocab, ", dim ", c.dim, ", layers ", c.layers, ", heads ", c.heads,
              ", kv heads ", c.kv_heads, ", ffn ", c.ffn, ")");
  FOCUS_CHECK(c.vocab < (1 << 24) && c.dim < (1 << 16) && c.layers < 1024 && c.heads <= 1024 && c.ffn < (1 << 20),
              path, ": absurd model sizes (vocab ", c.vocab, ", dim ", c.dim, ", layers ", c.layers, ", heads ", c.heads,
              ", ffn ", c.ffn, ")");
}

void check_config(const ModelConfig& c, const std::string& path) {
  check_sizes(c, path);
  FOCUS_CHECK(c.heads % c.kv_heads == 0, path, ": ", c.heads, " attention heads are not a multiple of ", c.kv_heads,
              " kv heads");
  FOCUS_CHECK(c.head_dim > 0 && c.head_dim <= 1024, path, ": invalid head dimension ", c.head_dim);
  FOCUS_CHECK(c.rope_dim % 2 == 0 && c.rope_dim <= c.head_dim, path, ": invalid rotary dimension ", c.rope_dim);
  FOCUS_CHECK((int64_t)c.layer_sliding_window.size() == c.layers, path, ": window layout has ", c.layer_sliding_window.size(),
              " entries for ", c.layers, " layers");
}

// ---------------------------------------------------------------- matrices
// A matrix [rows, cols] of `type` at `data` (inside a mapped file that outlives the model, or in
// a buffer the caller will drop) held as LoadOptions::weights says: a view of the bytes where the
// mode and alignment allow (`viewed` is then set: the caller keeps the file alive), else an owned
// float32 or BF16 copy.
// Whether a matrix of `type` is held as a view of its bytes under `mode` (alignment permitting):
// float32 unless BF16 is asked for, BF16 under BF16, and every other type natively (the
// kernels read the file's blocks).
bool held_in_place(WeightsMode mode, io::GGMLType type) {
  using io::GGMLType;
  if (type == GGMLType::F32) return mode != WeightsMode::BF16;
  return mode == WeightsMode::Native || (mode == WeightsMode::BF16 && type == GGMLType::BF16);
}

Weight hold_matrix(ModelWeights& w, WeightsMode mode, io::GGMLType type, int64_t rows, int64_t cols,
                   const uint8_t* data, bool can_view, bool& viewed) {
  using io::GGMLType;
  // A float32 view, and a BF16 one under BF16, must be aligned to the element; the native kernels
  // read the other types as bytes.
  const size_t align = type == GGMLType::F32 ? 4 : mode == WeightsMode::BF16 ? 2 : 1;
  if (can_view && held_in_place(mode, type) && reinterpret_cast<uintptr_t>(data) % align == 0)
    return viewed = true, Weight{type, rows, cols, data};
  std::vector<float> f((size_t)(rows * cols));
  io::dequantize(type, data, f.data(), rows * cols);
  if (mode == WeightsMode::BF16) {
    std::vector<uint16_t> b(f.size());
    for (size_t i = 0; i < f.size(); ++i) b[i] = io::fp32_to_bf16(f[i]);
    return Weight{GGMLType::BF16, rows, cols, w.keep16(std::move(b))};
  }
  return Weight::f32(w.keep(std::move(f)), rows, cols);
}

// Bytes hold_matrix allocates for n elements of `type` (a view costs nothing; the float32 made on
// the way to BF16 is freed matrix by matrix).
double held_bytes(WeightsMode mode, io::GGMLType type, int64_t n) {
  return held_in_place(mode, type) ? 0 : (double)n * (mode == WeightsMode::BF16 ? 2 : 4);
}

void check_weight_memory(const std::string& path, WeightsMode mode, double bytes) {
  MemoryNeed need;
  need.add(std::string("weights held as ") + (mode == WeightsMode::BF16 ? "bf16" : "float32"), bytes);
  check_memory(path + ": loading with --weights " + to_string(mode), need,
               mode == WeightsMode::Native ? "" : "use --weights native (the file's own format, read in place)");
}

// ---------------------------------------------------------------- GGUF
std::string gguf_arch_key(const std::string& arch, const std::string& k) {
  return arch + "." + k;
}

std::unique_ptr<Model> load_gguf(const std::string& path, const LoadOptions& opt) {
  auto file = std::make_shared<io::GGUFFile>(path);
  const io::GGUFFile& f = *file;
  auto m = std::make_unique<Model>();
  m->path = path;
  m->format = "gguf";
  ModelConfig& c = m->cfg;
  const std::string arch = f.get_string("general.architecture");
  c.arch_name = arch;
  if (arch == "llama")
    c.arch = Arch::Llama;
  else if (arch == "gemma3")
    c.arch = Arch::Gemma3;
  else
    fail(path, ": unsupported architecture '", arch, "' (supported in GGUF: llama, gemma3)");
  auto key = [&](const char* k) { return gguf_arch_key(arch, k); };
  c.dim = f.get_int(key("embedding_length"));
  c.layers = f.get_int(key("block_count"));
  c.heads = f.get_int(key("attention.head_count"));
  c.kv_heads = f.get_int(key("attention.head_count_kv"), c.heads);
  c.ffn = f.get_int(key("feed_forward_length"));
  c.max_ctx = f.get_int(key("context_length"), 2048);
  c.norm_eps = (float)f.get_float(key("attention.layer_norm_rms_epsilon"), 1e-5);
  c.rope_theta = (float)f.get_float(key("rope.freq_base"), 10000.0);
  c.head_dim = f.get_int(key("attention.key_length"), 0);
  c.rope_dim = f.get_int(key("rope.dimension_count"), 0);
  {
    // The key head size is attention.key_length, or embedding_length / head_count without it; the
    // value head size (attention.value_length, default: the key head size) must equal it.
    const int64_t k_len = c.head_dim ? c.head_dim : c.heads > 0 ? c.dim / c.heads : 0;
    const int64_t v_len = f.get_int(key("attention.value_length"), k_len);
    const std::string k_from =
        c.head_dim ? key("attention.key_length") : key("embedding_length") + " / " + key("attention.head_count");
    FOCUS_CHECK(v_len == k_len, path, ": ", key("attention.value_length"), " is ", v_len, " but the key head size (",
                k_from, ") is ", k_len, "; different key and value head sizes are not supported");
  }
  const io::GGUFTensor& emb = f.tensor("token_embd.weight");
  FOCUS_CHECK(emb.ne.size() == 2 && emb.ne[0] == c.dim, path, ": token_embd.weight has the wrong shape");
  c.vocab = emb.ne[1];
  check_sizes(c, path);
  if (c.arch == Arch::Gemma3) {
    // Gemma 3: sliding-window layers with local RoPE base 10000; every 6th layer is global.
    const int64_t sw = f.get_int(key("attention.sliding_window"), 512);
    c.layer_sliding_window.assign(c.layers, sw);
    for (int64_t l = 0; l < c.layers; ++l)
      if ((l + 1) % 6 == 0) c.layer_sliding_window[l] = 0;
    c.rope_theta_local = 10000.f;
    // GGUF norm weights of Gemma already include the +1 offset of Gemma's RMSNorm.
  }
  apply_arch_defaults(c);  // attn_scale: 1 / sqrt(head_dim), Gemma 3 included
  check_config(c, path);

  {
    double bytes = 0;
    for (const io::GGUFTensor& t : f.tensors())
      bytes += t.ne.size() >= 2 ? held_bytes(opt.weights, t.type, t.n_elements()) : 4.0 * (double)t.n_elements();
    check_weight_memory(path, opt.weights, bytes);
  }
  std::map<std::string, int> type_count;
  bool viewed = false;
  auto find = [&](const std::string& name, const std::vector<int64_t>& shape, bool required) -> const io::GGUFTensor* {
    const io::GGUFTensor* t = f.find(name);
    if (!t) {
      FOCUS_CHECK(!required, path, ": missing tensor '", name, "'");
      return nullptr;
    }
    FOCUS_CHECK(t->ne == shape, path, ": tensor '", name, "' has shape ", [&] {
      std::string s;
      for (auto d : t->ne) s += std::to_string(d) + " ";
      return s;
    }(), "but the config needs ", [&] {
      std::string s;
      for (auto d : shape) s += std::to_string(d) + " ";
      return s;
    }());
    FOCUS_CHECK(io::type_supported(t->type), path, ": tensor '", name, "' has type ", io::type_name(t->type),
                ", which this engine cannot read");
    type_count[io::type_name(t->type)]++;
    m->w.n_params += t->n_elements();
    return t;
  };
  // Vectors (norms) as float32; matrices as LoadOptions::weights says. GGUF shapes are ggml's
  // order: {cols, rows}.
  auto get = [&](const std::string& name, std::vector<int64_t> shape, bool required = true) -> const float* {
    const io::GGUFTensor* t = find(name, shape, required);
    return t ? m->w.keep(f.to_float(*t)) : nullptr;
  };
  auto mat = [&](const std::string& name, std::vector<int64_t> shape, bool required = true) -> Weight {
    const io::GGUFTensor* t = find(name, shape, required);
    if (!t) return Weight{};
    return hold_matrix(m->w, opt.weights, t->type, shape[1], shape[0], t->data, true, viewed);
  };
  const int64_t D = c.dim, QD = c.q_dim(), KV = c.kv_dim(), F = c.ffn, hd = c.head_dim;
  m->w.tok_emb = mat("token_embd.weight", {D, c.vocab});
  m->w.out_norm = get("output_norm.weight", {D});
  m->w.lm_head = mat("output.weight", {D, c.vocab}, false);
  c.tied_output = !m->w.lm_head;
  if (c.tied_output) m->w.lm_head = m->w.tok_emb;
  m->w.layers.resize(c.layers);
  for (int64_t l = 0; l < c.layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    LayerWeights& L = m->w.layers[l];
    L.attn_norm = get(p + "attn_norm.weight", {D});
    L.wq = mat(p + "attn_q.weight", {D, QD});
    L.wk = mat(p + "attn_k.weight", {D, KV});
    L.wv = mat(p + "attn_v.weight", {D, KV});
    L.wo = mat(p + "attn_output.weight", {QD, D});
    L.ffn_norm = get(p + "ffn_norm.weight", {D});
    L.w_gate = mat(p + "ffn_gate.weight", {D, F});
    L.w_up = mat(p + "ffn_up.weight", {D, F});
    L.w_down = mat(p + "ffn_down.weight", {F, D});
    if (c.arch == Arch::Gemma3) {
      L.q_norm = get(p + "attn_q_norm.weight", {hd});
      L.k_norm = get(p + "attn_k_norm.weight", {hd});
      L.post_attn_norm = get(p + "post_attention_norm.weight", {D});
      L.post_ffn_norm = get(p + "post_ffw_norm.weight", {D});
    }
  }
  for (auto& [k, v] : type_count) m->w.tensor_types.push_back(k + " x " + std::to_string(v));
  if (opt.need_tokenizer)
    m->tok = opt.tokenizer.empty() ? io::make_tokenizer(io::vocab_from_gguf(f)) : io::load_tokenizer(opt.tokenizer);
  if (viewed) m->w.owners.push_back(file);
  return m;
}

// ---------------------------------------------------------------- llama2.c (legacy v0)
std::unique_ptr<Model> load_llama2c(const std::string& path, const LoadOptions& opt) {
  auto file = std::make_shared<MappedFile>(path);
  const MappedFile& f = *file;
  FOCUS_CHECK(f.size() >= 28, path, ": too small for a llama2.c header (", f.size(), " bytes)");
  int32_t h[7];
  std::memcpy(h, f.data(), sizeof(h));
  auto m = std::make_unique<Model>();
  m->path = path;
  m->format = "llama2c";
  ModelConfig& c = m->cfg;
  c.arch = Arch::Llama;
  c.arch_name = "llama";
  c.dim = h[0];
  c.ffn = h[1];
  c.layers = h[2];
  c.heads = h[3];
  c.kv_heads = h[4];
  c.tied_output = h[5] > 0;
  c.vocab = std::abs((int64_t)h[5]);
  c.max_ctx = h[6];
  c.norm_eps = 1e-5f;
  c.rope_theta = 10000.f;
  FOCUS_CHECK(c.dim > 0 && c.heads > 0 && c.kv_heads > 0 && c.dim % c.heads == 0 && c.max_ctx > 0, path,
              ": not a llama2.c checkpoint (header dim ", h[0], ", hidden ", h[1], ", layers ", h[2], ", heads ", h[3],
              ", kv heads ", h[4], ", vocab ", h[5], ", seq_len ", h[6], ")");
  check_sizes(c, path);
  apply_arch_defaults(c);
  check_config(c, path);
  const int64_t D = c.dim, F = c.ffn, Lr = c.layers, hd = c.head_dim, KV = c.kv_dim();
  FOCUS_CHECK(c.max_ctx < (1 << 24), path, ": absurd seq_len ", c.max_ctx);
  int64_t need = c.vocab * D + Lr * D + Lr * D * D + 2 * Lr * KV * D + Lr * D * D + Lr * D + 3 * Lr * F * D + D +
                 c.max_ctx * hd;  // freq_cis real + imag (hd/2 each)
  if (!c.tied_output) need += c.vocab * D;
  const size_t bytes = 28 + (size_t)need * 4;
  FOCUS_CHECK(f.size() >= bytes, path, ": truncated llama2.c checkpoint: header needs ", bytes, " bytes, file has ",
              f.size());
  FOCUS_CHECK(f.size() == bytes, path, ": llama2.c checkpoint has ", f.size() - bytes,
              " unexpected trailing bytes (not a legacy v0 file?)");
  check_weight_memory(path, opt.weights, held_bytes(opt.weights, io::GGMLType::F32, need));
  // Every tensor is float32 at a 4-byte aligned offset: the model views the mapping.
  m->w.owners.push_back(file);
  const float* p = reinterpret_cast<const float*>(f.data() + 28);
  auto take = [&](int64_t n) {
    const float* v = p;
    p += n;
    m->w.n_params += n;
    return v;
  };
  bool viewed = false;
  auto mat = [&](const float* data, int64_t rows, int64_t cols) {
    return hold_matrix(m->w, opt.weights, io::GGMLType::F32, rows, cols, reinterpret_cast<const uint8_t*>(data), true,
                       viewed);
  };
  m->w.tok_emb = mat(take(c.vocab * D), c.vocab, D);
  m->w.layers.resize(Lr);
  const float* rms_att = take(Lr * D);
  const float* wq = take(Lr * D * D);
  const float* wk = take(Lr * KV * D);
  const float* wv = take(Lr * KV * D);
  const float* wo = take(Lr * D * D);
  const float* rms_ffn = take(Lr * D);
  const float* w1 = take(Lr * F * D);
  const float* w2 = take(Lr * D * F);
  const float* w3 = take(Lr * F * D);
  m->w.out_norm = take(D);
  p += c.max_ctx * hd;  // stored RoPE tables: recomputed instead
  m->w.lm_head = c.tied_output ? m->w.tok_emb : mat(take(c.vocab * D), c.vocab, D);
  for (int64_t l = 0; l < Lr; ++l) {
    LayerWeights& L = m->w.layers[l];
    L.attn_norm = rms_att + l * D;
    L.wq = mat(wq + l * D * D, D, D);
    L.wk = mat(wk + l * KV * D, KV, D);
    L.wv = mat(wv + l * KV * D, KV, D);
    L.wo = mat(wo + l * D * D, D, D);
    L.ffn_norm = rms_ffn + l * D;
    L.w_gate = mat(w1 + l * F * D, F, D);
    L.w_down = mat(w2 + l * D * F, D, F);
    L.w_up = mat(w3 + l * F * D, F, D);
  }
  m->w.tensor_types.push_back("F32 (llama2.c)");
  if (opt.need_tokenizer) {
    std::string tp = opt.tokenizer;
    if (tp.empty()) {
      const fs::path dir = fs::path(path).parent_path();
      for (const std::string& cand : {"tok" + std::to_string(c.vocab) + ".bin", std::string("tokenizer.bin")})
        if (fs::exists(dir / cand)) {
          tp = (dir / cand).string();
          break;
        }
    }
    FOCUS_CHECK(!tp.empty(), path, ": llama2.c checkpoints need --tokenizer FILE (no tokenizer.bin beside it)");
    m->tok = io::make_tokenizer(io::vocab_from_llama2c(tp, (int32_t)c.vocab));
  }
  return m;
}

}  // namespace

// Every architecture-specific default lives here.
void apply_arch_defaults(ModelConfig& c) {
  if (c.head_dim == 0 && c.heads > 0) c.head_dim = c.dim / c.heads;
  if (c.attn_scale == 0.f) c.attn_scale = 1.0f / std::sqrt((float)c.head_dim);
  if (c.layer_sliding_window.empty()) c.layer_sliding_window.assign(c.layers, 0);
  switch (c.arch) {
    case Arch::Llama:
      c.norm = NormKind::RMS;
      c.mlp = MlpKind::SwiGLU;
      if (c.rope_dim == 0) c.rope_dim = c.head_dim;
      break;
    case Arch::Gemma3:
      c.norm = NormKind::RMS;
      c.mlp = MlpKind::GeGLU;
      c.qk_norm = true;
      c.post_norms = true;
      c.rope_style = cpu::RopeStyle::SplitHalf;
      if (c.rope_dim == 0) c.rope_dim = c.head_dim;
      c.embed_scale = std::sqrt((float)c.dim);
      break;
    case Arch::DeepseekV2:
      c.norm = NormKind::RMS;
      c.mlp = MlpKind::SwiGLU;
      c.kv_heads = 1;  // absorbed: one row [k_pe | latent] per token serves every head
      c.head_dim = c.mla_rope + c.mla_kv_rank;
      c.rope_dim = c.mla_rope;
      c.rope_style = cpu::RopeStyle::Interleaved;  // HF's de-interleaving permutation leaves q.k unchanged
      c.attn_scale = 1.0f / std::sqrt((float)(c.mla_nope + c.mla_rope));
      break;
    case Arch::GPT2:
      c.norm = NormKind::Layer;
      c.mlp = MlpKind::GELU;
      c.learned_pos = true;
      c.rope_dim = 0;
      break;
  }
}

// ---------------------------------------------------------------- safetensors + config.json
ModelConfig config_from_hf_json(const nlohmann::json& j, const std::string& cfg_path) {
  FOCUS_CHECK(j.is_object(), cfg_path, ": not a JSON object");
  ModelConfig c;
  auto num = [&](const char* k, auto def) {
    using T = decltype(def);
    if (!j.contains(k) || j[k].is_null()) return def;
    return json_number<T>(j[k], k, cfg_path);
  };
  FOCUS_CHECK(!j.contains("model_type") || j["model_type"].is_string(), cfg_path, ": 'model_type' is not a string");
  const std::string mt = j.value("model_type", "");
  c.arch_name = mt;
  // The sizes every Llama-style config names alike (get reads one key of the right object).
  auto llama_sizes = [&](auto&& get) {
    c.dim = get("hidden_size", int64_t(0));
    c.layers = get("num_hidden_layers", int64_t(0));
    c.heads = get("num_attention_heads", int64_t(0));
    c.vocab = get("vocab_size", int64_t(0));
    c.ffn = get("intermediate_size", int64_t(0));
    c.max_ctx = get("max_position_embeddings", int64_t(2048));
    c.norm_eps = get("rms_norm_eps", 1e-6);
    c.rope_theta = get("rope_theta", 10000.0);
  };
  if (mt == "gpt2") {
    c.arch = Arch::GPT2;
    c.dim = num("n_embd", int64_t(0));
    c.layers = num("n_layer", int64_t(0));
    c.heads = num("n_head", int64_t(0));
    c.kv_heads = c.heads;
    c.vocab = num("vocab_size", int64_t(0));
    c.max_ctx = num("n_positions", int64_t(1024));
    c.ffn = num("n_inner", int64_t(0));
    if (c.ffn == 0) c.ffn = 4 * c.dim;
    c.norm_eps = num("layer_norm_epsilon", 1e-5);
  } else if (mt == "llama" || mt == "mistral" || mt == "qwen2" || mt == "gemma3" || mt == "gemma3_text") {
    c.arch = (mt == "gemma3" || mt == "gemma3_text") ? Arch::Gemma3 : Arch::Llama;
    const nlohmann::json& t = (mt == "gemma3" && j.contains("text_config")) ? j["text_config"] : j;
    auto tnum = [&](const char* k, auto def) {
      using T = decltype(def);
      if (!t.contains(k) || t[k].is_null()) return def;
      return json_number<T>(t[k], k, cfg_path);
    };
    llama_sizes(tnum);
    c.kv_heads = tnum("num_key_value_heads", c.heads);
    c.head_dim = tnum("head_dim", int64_t(0));
    c.rope_style = cpu::RopeStyle::SplitHalf;  // HF stores q/k unpermuted
    check_sizes(c, cfg_path);
    if (c.arch == Arch::Gemma3) {
      c.rope_theta_local = tnum("rope_local_base_freq", 10000.0);
      const int64_t sw = tnum("sliding_window", int64_t(512));
      c.layer_sliding_window.assign(c.layers, 0);
      if (t.contains("layer_types") && t["layer_types"].is_array()) {
        FOCUS_CHECK((int64_t)t["layer_types"].size() == c.layers, cfg_path, ": layer_types has the wrong length");
        for (int64_t l = 0; l < c.layers; ++l)
          if (t["layer_types"][l] == "sliding_attention") c.layer_sliding_window[l] = sw;
      } else {
        const int64_t pat = tnum("sliding_window_pattern", int64_t(6));
        FOCUS_CHECK(pat >= 1, cfg_path, ": sliding_window_pattern must be at least 1 (got ", pat, ")");
        for (int64_t l = 0; l < c.layers; ++l)
          if ((l + 1) % pat != 0) c.layer_sliding_window[l] = sw;
      }
      const double qs = tnum("query_pre_attn_scalar", 0.0);
      if (qs > 0) c.attn_scale = (float)(1.0 / std::sqrt(qs));
    } else {
      if (j.contains("rope_scaling") && !j["rope_scaling"].is_null())
        fail(cfg_path, ": rope_scaling is not supported yet");
    }
  } else if (mt == "deepseek_v2") {
    c.arch = Arch::DeepseekV2;
    llama_sizes(num);
    c.kv_heads = 1;
    c.mla_kv_rank = num("kv_lora_rank", int64_t(0));
    c.mla_nope = num("qk_nope_head_dim", int64_t(0));
    c.mla_rope = num("qk_rope_head_dim", int64_t(0));
    c.mla_v = num("v_head_dim", int64_t(0));
    FOCUS_CHECK(c.mla_kv_rank > 0 && c.mla_kv_rank <= 4096 && c.mla_nope > 0 && c.mla_nope <= 1024 &&
                    c.mla_rope > 0 && c.mla_rope % 2 == 0 && c.mla_rope <= 1024 && c.mla_v > 0 && c.mla_v <= 1024,
                cfg_path, ": invalid latent attention sizes (kv_lora_rank ", c.mla_kv_rank, ", qk_nope_head_dim ",
                c.mla_nope, ", qk_rope_head_dim ", c.mla_rope, ", v_head_dim ", c.mla_v, ")");
    if (j.contains("q_lora_rank") && !j["q_lora_rank"].is_null()) {
      c.mla_q_rank = num("q_lora_rank", int64_t(0));
      FOCUS_CHECK(c.mla_q_rank > 0 && c.mla_q_rank <= 16384, cfg_path, ": invalid q_lora_rank ", c.mla_q_rank);
    }
    FOCUS_CHECK(!j.contains("n_routed_experts") || j["n_routed_experts"].is_null() ||
                    num("first_k_dense_replace", int64_t(0)) >= c.layers,
                cfg_path, ": mixture-of-experts layers are not supported (only dense MLPs)");
    if (j.contains("rope_scaling") && !j["rope_scaling"].is_null())
      fail(cfg_path, ": rope_scaling is not supported yet");
  } else {
    fail(cfg_path, ": unsupported model_type '", mt, "' (supported: gpt2, llama, mistral, qwen2, gemma3, deepseek_v2)");
  }
  FOCUS_CHECK(!j.contains("tie_word_embeddings") || j["tie_word_embeddings"].is_boolean(), cfg_path,
              ": 'tie_word_embeddings' is not a boolean");
  c.tied_output = j.value("tie_word_embeddings", c.arch == Arch::GPT2 || c.arch == Arch::Gemma3);
  check_sizes(c, cfg_path);
  apply_arch_defaults(c);
  check_config(c, cfg_path);
  return c;
}

namespace {

std::unique_ptr<Model> load_safetensors(const std::string& dir, const LoadOptions& opt) {
  auto st_ptr = std::make_shared<io::SafetensorsModel>(io::load_safetensors_dir(dir));
  io::SafetensorsModel& st = *st_ptr;
  const std::string cfg_path = (fs::path(dir) / "config.json").string();
  auto m = std::make_unique<Model>();
  m->path = dir;
  m->format = "safetensors";
  m->cfg = config_from_hf_json(st.config, cfg_path);
  ModelConfig& c = m->cfg;
  auto has = [&](const std::string& n) { return st.find(n) != nullptr; };
  // The tensor name prefix.
  std::string pre = "model.";
  if (c.arch == Arch::GPT2) pre = has("transformer.wte.weight") ? "transformer." : "";
  if (c.arch == Arch::Gemma3 && has("model.language_model.embed_tokens.weight")) pre = "model.language_model.";

  std::map<std::string, int> type_count;
  bool viewed = false;
  auto find = [&](const std::string& name, const std::vector<int64_t>& shape, bool required) -> const io::STTensor* {
    const io::STTensor* t = st.find(name);
    if (!t) {
      FOCUS_CHECK(!required, dir, ": missing tensor '", name, "'");
      return nullptr;
    }
    FOCUS_CHECK(t->shape == shape, dir, ": tensor '", name, "' has an unexpected shape");
    type_count[t->dtype]++;
    m->w.n_params += t->n_elements();
    return t;
  };
  {
    double bytes = 0;
    for (const auto& file : st.files)
      for (const io::STTensor& t : file->tensors()) {
        const std::string& dt = t.dtype;
        const bool half = dt == "F16" || dt == "BF16";
        if (t.shape.size() < 2) bytes += 4.0 * (double)t.n_elements();
        else if (dt == "F32" || half)
          bytes += held_bytes(opt.weights, dt == "F32" ? io::GGMLType::F32 : dt == "F16" ? io::GGMLType::F16
                                                                                            : io::GGMLType::BF16,
                              t.n_elements());
        else bytes += (double)t.n_elements() * (opt.weights == WeightsMode::BF16 ? 2 : 4);
      }
    check_weight_memory(dir, opt.weights, bytes);
  }
  // Matrices [rows, cols] in F32 / F16 / BF16 as LoadOptions::weights says (other dtypes: the
  // float conversion's error names them).
  auto mat = [&](const std::string& name, std::vector<int64_t> shape, bool required = true) -> Weight {
    const io::STTensor* t = find(name, shape, required);
    if (!t) return Weight{};
    const std::string& dt = t->dtype;
    if (dt == "F32" || dt == "F16" || dt == "BF16") {
      const io::GGMLType type = dt == "F32" ? io::GGMLType::F32 : dt == "F16" ? io::GGMLType::F16 : io::GGMLType::BF16;
      return hold_matrix(m->w, opt.weights, type, shape[0], shape[1], t->data, true, viewed);
    }
    std::vector<float> v = st.owner(name).to_float(*t);
    bool unused = false;
    return hold_matrix(m->w, opt.weights, io::GGMLType::F32, shape[0], shape[1],
                       reinterpret_cast<const uint8_t*>(v.data()), false, unused);
  };
  auto get = [&](const std::string& name, std::vector<int64_t> shape, bool required = true,
                 bool transpose = false) -> const float* {
    const io::STTensor* t = find(name, shape, required);
    if (!t) return nullptr;
    std::vector<float> v = st.owner(name).to_float(*t);
    if (transpose) {  // Conv1D [in, out] -> Linear [out, in]
      std::vector<float> tr(v.size());
      const int64_t R = shape[0], C = shape[1];
      for (int64_t r = 0; r < R; ++r)
        for (int64_t k = 0; k < C; ++k) tr[k * R + r] = v[r * C + k];
      v.swap(tr);
    }
    return m->w.keep(std::move(v));
  };
  // Gemma's RMSNorm scales by (1 + w): fold the offset into the weight once.
  auto get_norm = [&](const std::string& name, int64_t n) -> const float* {
    const float* w = get(name, {n});
    if (c.arch == Arch::Gemma3) {
      float* mw = const_cast<float*>(w);
      for (int64_t i = 0; i < n; ++i) mw[i] += 1.0f;
    }
    return w;
  };
  const int64_t D = c.dim, QD = c.q_dim(), KV = c.kv_dim(), F = c.ffn;
  m->w.layers.resize(c.layers);
  // GPT-2's Conv1D matrices are stored [in, out]: transposed into float32, then held.
  auto conv1d = [&](const std::string& name, int64_t in, int64_t out) {
    const float* t = get(name, {in, out}, true, true);
    if (opt.weights != WeightsMode::BF16) return Weight::f32(t, out, in);
    bool unused = false;
    return hold_matrix(m->w, opt.weights, io::GGMLType::F32, out, in, reinterpret_cast<const uint8_t*>(t), false,
                       unused);
  };
  if (c.arch == Arch::GPT2) {
    m->w.tok_emb = mat(pre + "wte.weight", {c.vocab, D});
    m->w.pos_emb = get(pre + "wpe.weight", {c.max_ctx, D});
    m->w.out_norm = get(pre + "ln_f.weight", {D});
    m->w.out_norm_b = get(pre + "ln_f.bias", {D});
    m->w.lm_head = m->w.tok_emb;
    for (int64_t l = 0; l < c.layers; ++l) {
      const std::string p = pre + "h." + std::to_string(l) + ".";
      LayerWeights& L = m->w.layers[l];
      L.attn_norm = get(p + "ln_1.weight", {D});
      L.attn_norm_b = get(p + "ln_1.bias", {D});
      const Weight qkv = conv1d(p + "attn.c_attn.weight", D, 3 * D);  // now [3D, D]
      const float* qkv_b = get(p + "attn.c_attn.bias", {3 * D});
      L.wq = Weight{qkv.type, D, D, qkv.row(0)};
      L.wk = Weight{qkv.type, D, D, qkv.row(D)};
      L.wv = Weight{qkv.type, D, D, qkv.row(2 * D)};
      L.bq = qkv_b;
      L.bk = qkv_b + D;
      L.bv = qkv_b + 2 * D;
      L.wo = conv1d(p + "attn.c_proj.weight", D, D);
      L.bo = get(p + "attn.c_proj.bias", {D});
      L.ffn_norm = get(p + "ln_2.weight", {D});
      L.ffn_norm_b = get(p + "ln_2.bias", {D});
      L.w_up = conv1d(p + "mlp.c_fc.weight", D, F);
      L.b_up = get(p + "mlp.c_fc.bias", {F});
      L.w_down = conv1d(p + "mlp.c_proj.weight", F, D);
      L.b_down = get(p + "mlp.c_proj.bias", {D});
    }
  } else {
    m->w.tok_emb = mat(pre + "embed_tokens.weight", {c.vocab, D});
    m->w.out_norm = get_norm(pre + "norm.weight", D);
    m->w.lm_head = mat("lm_head.weight", {c.vocab, D}, false);
    c.tied_output = !m->w.lm_head;
    if (c.tied_output) m->w.lm_head = m->w.tok_emb;
    for (int64_t l = 0; l < c.layers; ++l) {
      const std::string p = pre + "layers." + std::to_string(l) + ".";
      LayerWeights& L = m->w.layers[l];
      L.attn_norm = get_norm(p + "input_layernorm.weight", D);
      L.w_gate = mat(p + "mlp.gate_proj.weight", {F, D});
      L.w_up = mat(p + "mlp.up_proj.weight", {F, D});
      L.w_down = mat(p + "mlp.down_proj.weight", {D, F});
      if (c.mla()) {
        const int64_t C = c.mla_kv_rank, R = c.mla_rope;
        if (c.mla_q_rank > 0) {
          L.wq_a = mat(p + "self_attn.q_a_proj.weight", {c.mla_q_rank, D});
          L.q_a_norm = get(p + "self_attn.q_a_layernorm.weight", {c.mla_q_rank});
          L.wq = mat(p + "self_attn.q_b_proj.weight", {c.q_proj_dim(), c.mla_q_rank});
        } else {
          L.wq = mat(p + "self_attn.q_proj.weight", {c.q_proj_dim(), D});
        }
        L.wk = mat(p + "self_attn.kv_a_proj_with_mqa.weight", {C + R, D});
        L.kv_a_norm = get(p + "self_attn.kv_a_layernorm.weight", {C});
        L.w_kv_b = Weight::f32(get(p + "self_attn.kv_b_proj.weight", {c.heads * (c.mla_nope + c.mla_v), C}),
                               c.heads * (c.mla_nope + c.mla_v), C);
        L.wo = mat(p + "self_attn.o_proj.weight", {D, c.o_proj_dim()});
        L.ffn_norm = get_norm(p + "post_attention_layernorm.weight", D);
        continue;
      }
      L.wq = mat(p + "self_attn.q_proj.weight", {QD, D});
      L.wk = mat(p + "self_attn.k_proj.weight", {KV, D});
      L.wv = mat(p + "self_attn.v_proj.weight", {KV, D});
      L.wo = mat(p + "self_attn.o_proj.weight", {D, QD});
      L.bq = get(p + "self_attn.q_proj.bias", {QD}, false);
      L.bk = get(p + "self_attn.k_proj.bias", {KV}, false);
      L.bv = get(p + "self_attn.v_proj.bias", {KV}, false);
      if (c.arch == Arch::Gemma3) {
        L.q_norm = get_norm(p + "self_attn.q_norm.weight", c.head_dim);
        L.k_norm = get_norm(p + "self_attn.k_norm.weight", c.head_dim);
        L.post_attn_norm = get_norm(p + "post_attention_layernorm.weight", D);
        L.ffn_norm = get_norm(p + "pre_feedforward_layernorm.weight", D);
        L.post_ffn_norm = get_norm(p + "post_feedforward_layernorm.weight", D);
      } else {
        L.ffn_norm = get_norm(p + "post_attention_layernorm.weight", D);
      }
    }
  }
  for (auto& [k, v] : type_count) m->w.tensor_types.push_back(k + " x " + std::to_string(v));
  if (opt.need_tokenizer) {
    std::string tp = opt.tokenizer;
    if (tp.empty()) {
      for (const char* cand : {"tokenizer.json", "vocab.json", "tokenizer.bin"})
        if (fs::exists(fs::path(dir) / cand)) {
          tp = (fs::path(dir) / (std::string(cand) == "vocab.json" ? "" : cand)).string();
          break;
        }
    }
    FOCUS_CHECK(!tp.empty(), dir,
                ": no tokenizer found (tokenizer.json, vocab.json + merges.txt, or a llama2.c tokenizer.bin); pass "
                "--tokenizer");
    m->tok = io::load_tokenizer(tp, (int32_t)c.vocab);
  }
  if (viewed) m->w.owners.push_back(st_ptr);
  return m;
}

std::unique_ptr<Model> load_any(const std::string& path, const LoadOptions& opt);

bool has_suffix(const std::string& s, const std::string& suf) {
  return s.size() >= suf.size() && s.compare(s.size() - suf.size(), suf.size(), suf) == 0;
}

}  // namespace

std::string default_model_path(const std::string& name) {
  std::string cache;
  if (const char* e = std::getenv("FOCUS_CACHE"))
    cache = e;
  else
    cache = std::string(std::getenv("HOME") ? std::getenv("HOME") : ".") + "/.cache/focus";
  if (name == "smollm2") return cache + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (name == "gemma3-270m") return cache + "/models/gemma-3-270m-q4_k_m.gguf";
  return "";
}

int64_t ModelWeights::matrix_bytes() const {
  auto bytes = [](const Weight& w) { return w ? (int64_t)w.bytes() : 0; };
  int64_t n = bytes(tok_emb) + (lm_head.data != tok_emb.data ? bytes(lm_head) : 0);
  for (const LayerWeights& L : layers)
    for (const Weight* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down, &L.wq_a}) n += bytes(*w);
  return n;
}

WeightsMode parse_weights_mode(const std::string& s) {
  if (s == "native") return WeightsMode::Native;
  if (s == "f32") return WeightsMode::F32;
  if (s == "bf16") return WeightsMode::BF16;
  fail("--weights: unknown mode '", s, "' (native, f32 or bf16)");
}

std::string to_string(WeightsMode m) {
  switch (m) {
    case WeightsMode::Native: return "native";
    case WeightsMode::F32: return "f32";
    case WeightsMode::BF16: return "bf16";
  }
  return "?";
}

std::unique_ptr<Model> load_model(const std::string& spec, const LoadOptions& opt) {
  std::string path = spec;
  if (const std::string d = default_model_path(spec); !d.empty()) {
    FOCUS_CHECK(fs::exists(d), "model '", spec, "' is not in the cache (", d, "); run scripts/setup.sh");
    path = d;
  }
  FOCUS_CHECK(fs::exists(path), path, ": no such file or folder");
  std::unique_ptr<Model> m = load_any(path, opt);
  m->w.weights_mode = to_string(opt.weights);
  return m;
}

namespace {
std::unique_ptr<Model> load_any(const std::string& path, const LoadOptions& opt) {
  if (fs::is_directory(path)) return load_safetensors(path, opt);
  // Decide by content, not by name: GGUF files start with the magic "GGUF".
  {
    MappedFile f(path);
    if (f.size() >= 4 && std::memcmp(f.data(), "GGUF", 4) == 0) return load_gguf(path, opt);
    if (has_suffix(path, ".gguf")) fail(path, ": not a GGUF file (bad magic)");
    if (has_suffix(path, ".safetensors"))
      fail(path, ": pass the folder holding the safetensors files and config.json, not the file");
  }
  return load_llama2c(path, opt);
}
}  // namespace

}  // namespace focus
