// A loaded model (config, float32 weights, tokenizer) and its forward pass.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/memory.h"
#include "io/tokenizer.h"
#include "model/attention.h"
#include "model/config.h"
#include "model/weights.h"

namespace focus {

// How the matrices are held in memory: as in the file (quantised blocks, F16, BF16, F32; views
// of the memory-mapped file where it allows), dequantised to float32 (the exact path), or
// converted to BF16.
enum class WeightsMode { Native, F32, BF16 };
WeightsMode parse_weights_mode(const std::string& s);  // "native", "f32", "bf16"; throws Error
std::string to_string(WeightsMode m);

struct LoadOptions {
  std::string tokenizer;   // explicit tokenizer path (llama2.c models, or to override)
  bool need_tokenizer = true;
  WeightsMode weights = WeightsMode::Native;
};

struct Model {
  ModelConfig cfg;
  ModelWeights w;
  std::unique_ptr<io::Tokenizer> tok;  // may be null when not needed
  std::string path, format;            // format: "gguf", "llama2c", "safetensors"
};

// MODEL is a .gguf, a llama2.c .bin, a folder with safetensors + config.json, or a cached
// default name ("smollm2", "gemma3-270m"). Throws Error naming the file and the problem.
std::unique_ptr<Model> load_model(const std::string& spec, const LoadOptions& opt = {});
// What an architecture fixes (norm, MLP, QK and extra norms, positions, embedding scale, MLA's
// absorbed head) given c.arch and the sizes; head_dim, rope_dim and attn_scale when still 0.
void apply_arch_defaults(ModelConfig& c);
// The configuration a Hugging Face config.json describes (model_type gpt2, llama, mistral, qwen2,
// gemma3, deepseek_v2); errors name cfg_path. The loader reads tied output from the tensors.
ModelConfig config_from_hf_json(const nlohmann::json& j, const std::string& cfg_path);
// The path a default name resolves to ("" if spec is not a default name).
std::string default_model_path(const std::string& name);

// Keys and values of every layer for positions 0 .. len-1 and, per layer, the state the layer's
// attention policy keeps about those positions (e.g. their routing, indexed by group, which
// decoding with Focus reads). The states are the policies' own; the cache only holds them.
// Keys and values are held as `type` elements (float32, or half / bfloat16 at half the memory and
// bandwidth); attention always reads the stored values, so prefill and decoding see the same ones.
struct KVCache {
  int64_t capacity = 0, len = 0, kv_dim = 0;
  cpu::KvType type = cpu::KvType::F32;
  bool shared = false;  // keys and values are the same rows (MLA): only k is held
  // Rows are gathered from anywhere in a layer's keys and values (sparse decoding), so each
  // layer's array lives on huge pages where the system gives them.
  template <class E>
  using Rows = std::vector<E, HugePageAllocator<E>>;
  std::vector<Rows<float>> k, v;                        // float32: per layer [capacity, kv_dim]
  std::vector<Rows<uint16_t>> k16, v16;                 // half / bfloat16: the same, 16-bit
  std::vector<std::unique_ptr<AttentionState>> state;  // per layer (null until a policy makes one)
  // false: the cache holds no rows (no arrays are made): one forward of a whole window from
  // position 0 whose keys and values no later call reads (scoring a window); the attention
  // reads the new rows themselves, rounded to `type` as a cache would hold them. (Latent attention,
  // shared keys and values, always keeps them.)
  bool keeps_rows = true;
  // Whether init(c, ..., keep_rows) keeps rows: asked, or latent attention (whose attention reads
  // its rows from the cache even within one window).
  static bool keeps_rows_for(const ModelConfig& c, bool keep_rows) { return keep_rows || c.shared_kv(); }
  void init(const ModelConfig& c, int64_t cap, cpu::KvType t = cpu::KvType::F32, bool keep_rows = true);
  void* k_layer(int64_t l) {
    if (!keeps_rows) return nullptr;
    return type == cpu::KvType::F32 ? (void*)k[l].data() : (void*)k16[l].data();
  }
  void* v_layer(int64_t l) {
    if (shared) return k_layer(l);
    if (!keeps_rows) return nullptr;
    return type == cpu::KvType::F32 ? (void*)v[l].data() : (void*)v16[l].data();
  }
  // Bytes of keys and values held (capacity rows of every layer).
  int64_t bytes() const;
  // Keeps positions 0 .. n-1 (n <= len), keys, values and states alike.
  void truncate(int64_t n);
  void clear() { truncate(0); }
};

// Runs tokens ids[0..T) at positions cache.len .. cache.len+T-1, appends their keys/values to
// the cache, and writes the final-normed hidden states to hidden[T, dim]. Each layer's attention
// is the plan's policy for it (plan null: the model's own dense attention, exact). A policy may
// keep state about the new positions in the cache, so a later call (decoding, chunked prefill)
// attends to the cached positions under the same pattern; such a cache must have been filled
// from position 0 with the same plan. `stats` (optional) accumulates the sparse policies' pair
// counts. The sparse kernels' scratch of the calling thread is kept for the next call up to
// kAttentionScratchKept bytes; a long prefill's larger buffers are freed before it returns.
constexpr size_t kAttentionScratchKept = size_t{64} << 20;
void forward(const Model& m, const int32_t* ids, int64_t T, KVCache& cache, float* hidden,
             const AttentionPlan* plan = nullptr, AttentionStats* stats = nullptr);

// What running the model allocates beyond its weights: a KV cache of `positions` rows, the
// activations of a forward pass over `batch` tokens (the blocks' buffers, the hidden states) and
// `logit_rows` rows of logits; kv_copies more layers' keys and values of `positions` rows kept by
// the attention policies while decoding (decode_kv_copies).
MemoryNeed inference_memory(const ModelConfig& c, int64_t positions, int64_t batch, cpu::KvType kv,
                            int64_t logit_rows, int64_t kv_copies = 0);
// check_memory of inference_memory(...): refuses a job that would not fit before anything is
// allocated; the hint gains "or use --kv-type f16" with a float32 cache that keeps rows.
void check_inference_memory(const std::string& what, const ModelConfig& c, int64_t positions, int64_t batch,
                            cpu::KvType kv, int64_t logit_rows, const std::string& hint, int64_t kv_copies = 0);
// The layers' decode_kv_copies under plan (0 without one).
int64_t decode_kv_copies(const ModelConfig& c, const AttentionPlan* plan);

// logits[r, :] = hidden[r, :] . lm_head^T for r in [0, rows).
void compute_logits(const Model& m, const float* hidden, int64_t rows, float* logits);

}  // namespace focus
