// What `focus info` reports about a loaded model: architecture, sizes, parameters, tensor types.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "model/model.h"

namespace focus {

// path, format, architecture, vocab, dim, layers, heads, kv_heads, head_dim, ffn, context,
// params, tied_output, tensor_types, layer_sliding_window, rope ("none" | "interleaved" | "split-half"),
// rope_theta, and tokenizer_vocab when the model has a tokenizer.
nlohmann::json model_info_json(const Model& m);
// The same as a few aligned lines of text.
std::string model_info_text(const Model& m);

}  // namespace focus
