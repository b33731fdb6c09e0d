// A model whose every weight is trained (training from scratch): its float32 parameters as named
// tensors in the Hugging Face layout of its architecture, the Model views over them that the
// forward and backward passes read, the matching gradient buffers, initialisation, and the
// safetensors + config.json folder that load_model reads back.
//
// Architectures: the Llama family (MHA, GQA and MQA are kv_heads = heads, heads / k, 1), Gemma 3
// (sliding-window and global layers, QK norms, extra norms) and DeepSeek-V2's multi-head latent
// attention (dense MLPs). Presets give small models
// of each for `focus train`.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/model.h"
#include "train/backward.h"

namespace focus {

// The presets of `focus train --arch`: "mha", "gqa", "mqa", "local-global", "mla". Sizes: dim
// 256, 6 layers, 8 heads of 32 (kv heads 8 / 2 / 1; local-global: 2, with layers 0-1 and 3-4
// seeing a sliding window of ctx / 4 and layers 2 and 5 the whole context; mla: DeepSeek-V2's
// latent attention with a key/value latent of 64, a query latent of 128, per head 32 + 16 (RoPE)
// query-key dims and 32 value dims), SwiGLU (GeGLU for local-global) with ffn 704, tied embeddings.
ModelConfig preset_config(const std::string& arch, int64_t vocab, int64_t ctx);
const std::vector<std::string>& preset_names();

struct ParamTensor {
  std::string name;            // as in the saved file (e.g. model.layers.0.self_attn.q_proj.weight)
  std::vector<int64_t> shape;  // [out, in] for matrices
  bool decay = false;          // weight decay applies (matrices and embeddings, not norms or biases)
};

struct ModelParams {
  ModelConfig cfg;
  std::vector<ParamTensor> tensors;
  std::vector<std::vector<float>> data;  // parallel to tensors; norms hold the scale the forward
                                         // pass multiplies by (Gemma's file stores scale - 1)
  int64_t n_params() const;
};

// The tensors of c (names, shapes) initialised: matrices and embeddings N(0, 0.02), the output
// projections of attention and MLP N(0, 0.02 / sqrt(2 layers)), norm scales 1, biases 0.
// Deterministic in seed.
ModelParams init_model_params(const ModelConfig& c, uint64_t seed);

// Points m's config and weights at p (p must outlive m and keep its buffers in place).
void bind_model(const ModelParams& p, Model& m);

// The ModelGrads over buffers grads[offset + i] laid out like p.data[i] (sizes checked).
ModelGrads grad_views(const ModelParams& p, std::vector<std::vector<float>>& grads, size_t offset = 0);
// Gradient buffers laid out like p.data, sized and zeroed here, and the ModelGrads over them.
ModelGrads bind_grads(const ModelParams& p, std::vector<std::vector<float>>& grads);

// DIR/model.safetensors and DIR/config.json in the Hugging Face layout of the architecture (model
// type "llama", "gemma3_text" or "deepseek_v2"), written atomically, and the tokenizer copied beside them
// (tokenizer.json, or tokenizer.bin for a llama2.c tokenizer), so `focus eval --model DIR` loads it.
void save_model_params(const ModelParams& p, const std::string& dir, const std::string& tokenizer_path);

// The Hugging Face config.json of c.
std::string hf_config_json(const ModelConfig& c, int32_t bos, int32_t eos);

}  // namespace focus
