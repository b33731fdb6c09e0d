// A loaded model (config, float32 weights, tokenizer) and its forward pass.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "focus/focus_cache.h"
#include "focus/focus_model.h"
#include "io/tokenizer.h"
#include "model/config.h"
#include "model/weights.h"

namespace focus {

struct LoadOptions {
  std::string tokenizer;   // explicit tokenizer path (llama2.c models, or to override)
  bool need_tokenizer = true;
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
// The path a default name resolves to ("" if spec is not a default name).
std::string default_model_path(const std::string& name);

// Keys and values of every layer for positions 0 .. len-1 and, for the layers that ran Focus
// routers, the routing of those positions indexed by group (what decoding with Focus reads).
struct KVCache {
  int64_t capacity = 0, len = 0, kv_dim = 0;
  std::vector<std::vector<float>> k, v;  // per layer [capacity, kv_dim]
  std::vector<FocusLayerCache> focus;    // per layer (empty until a forward pass with routers)
  void init(const ModelConfig& c, int64_t cap);
  // Keeps positions 0 .. n-1 (n <= len), keys, values and routing alike.
  void truncate(int64_t n);
  void clear() { truncate(0); }
};

// Runs tokens ids[0..T) at positions cache.len .. cache.len+T-1, appends their keys/values to
// the cache, and writes the final-normed hidden states to hidden[T, dim].
// With `focus` (mode soft, hard or window), every layer that has a router uses Focus attention
// once the context is longer than the Focus window; otherwise the plain kernel runs, so the logits
// equal the frozen model's bit for bit. The routing of the new positions goes into the cache, so
// a later call (decoding, chunked prefill) attends to the cached positions under the same
// pattern; such a cache must have been filled from position 0 with the same routers and mode.
// `stats` (optional) accumulates the hard pattern's density. The sparse kernels' scratch of the
// calling thread is kept for the next call up to kAttentionScratchKept bytes; a long prefill's
// larger buffers are freed before it returns.
constexpr size_t kAttentionScratchKept = size_t{64} << 20;
void forward(const Model& m, const int32_t* ids, int64_t T, KVCache& cache, float* hidden,
             const FocusRouters* focus = nullptr, FocusStats* stats = nullptr);

// logits[r, :] = hidden[r, :] . lm_head^T for r in [0, rows).
void compute_logits(const Model& m, const float* hidden, int64_t rows, float* logits);

}  // namespace focus
