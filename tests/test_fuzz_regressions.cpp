// Inputs found by the fuzz harnesses (fuzz/, scripts/fuzz.sh) that once crashed a reader, threw
// something other than focus::Error, or made it allocate from an unchecked header size. Each
// must now end in a focus::Error naming the file and the problem.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "eval/tasks.h"
#include "focus/focus_model.h"
#include "io/tokenizer.h"
#include "model/model.h"
#include "test_gguf_builder.h"
#include "train/lora.h"
#include "train/trainer.h"
#include "../fuzz/fuzz_model_config.h"

namespace fs = std::filesystem;
using namespace focus;

namespace {

std::string scratch(const std::string& name) {
  const fs::path d = fs::path(::testing::TempDir()) / "focus_fuzz_regressions" / name;
  fs::remove_all(d);
  fs::create_directories(d);
  return d.string();
}

void write(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), (std::streamsize)bytes.size());
}

// Runs fn and returns the focus::Error message it throws ("" and a test failure if none).
template <class Fn>
std::string error_of(Fn&& fn) {
  const std::string m = focus::test::error_of(fn);
  if (m.empty()) ADD_FAILURE() << "expected focus::Error";
  return m;
}

// The fuzzers' tiny Llama (fuzz/fuzz_model_config.h).
ModelConfig tiny_llama_config() { return fuzz::tiny_config(false); }

LoadOptions no_tokenizer() {
  LoadOptions o;
  o.need_tokenizer = false;
  return o;
}

}  // namespace

// fuzz_llama2c: a header claiming 0x4e4e4e4e layers made the loader allocate a per-layer table
// of 10 GB before the sizes were checked.
TEST(FuzzRegressions, Llama2cAbsurdLayerCountIsCheckedBeforeAllocating) {
  const std::string d = scratch("llama2c");
  int32_t h[7] = {8, 16, 0x4e4e4e4e, 2, 1, 8, 4};
  std::string bytes(reinterpret_cast<const char*>(h), sizeof(h));
  bytes += std::string(100, 'N');
  write(d + "/model.bin", bytes);
  const std::string msg = error_of([&] { load_model(d + "/model.bin", no_tokenizer()); });
  EXPECT_NE(msg.find("model.bin"), std::string::npos) << msg;
  EXPECT_NE(msg.find("absurd model sizes"), std::string::npos) << msg;
}

// The same for a GGUF Gemma 3 (whose sliding-window table was filled from block_count before the
// check) and a safetensors Gemma 3 config.
TEST(FuzzRegressions, GgufAbsurdBlockCountIsCheckedBeforeAllocating) {
  using namespace focus::test::gguf;
  Builder b;
  b.kv_str("general.architecture", "gemma3")
      .kv<uint32_t>("gemma3.embedding_length", V_UINT32, 32)
      .kv<uint64_t>("gemma3.block_count", V_UINT64, uint64_t(1) << 40)
      .kv<uint32_t>("gemma3.attention.head_count", V_UINT32, 4)
      .kv<uint32_t>("gemma3.feed_forward_length", V_UINT32, 64)
      .tensor("token_embd.weight", {32, 4}, GGMLType::F32, std::string(32 * 4 * 4, '\0'));
  TempFile f("absurd_blocks.gguf", b.build());
  const std::string msg = error_of([&] { load_model(f.path, no_tokenizer()); });
  EXPECT_NE(msg.find("absurd model sizes"), std::string::npos) << msg;
}

TEST(FuzzRegressions, SafetensorsConfigAbsurdLayerCount) {
  const std::string d = scratch("st_layers");
  write(d + "/config.json", R"({"model_type": "gemma3_text", "hidden_size": 32, "num_hidden_layers": 2000000000,
    "num_attention_heads": 4, "vocab_size": 16, "intermediate_size": 64})");
  write(d + "/model.safetensors", std::string("\x02\0\0\0\0\0\0\0{}", 10));
  const std::string msg = error_of([&] { load_model(d, no_tokenizer()); });
  EXPECT_NE(msg.find("config.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("absurd model sizes"), std::string::npos) << msg;
}

// A float where an integer belongs was converted without a range check (undefined for 1e300),
// and a sliding_window_pattern of 0 divided by zero.
TEST(FuzzRegressions, SafetensorsConfigBadNumbers) {
  const std::string d = scratch("st_numbers");
  write(d + "/model.safetensors", std::string("\x02\0\0\0\0\0\0\0{}", 10));
  const std::string base = R"("model_type": "gemma3_text", "num_attention_heads": 4, "vocab_size": 16,
    "intermediate_size": 64, )";
  write(d + "/config.json", "{" + base + R"("hidden_size": 1e300, "num_hidden_layers": 2})");
  std::string msg = error_of([&] { load_model(d, no_tokenizer()); });
  EXPECT_NE(msg.find("'hidden_size' is not an integer"), std::string::npos) << msg;
  write(d + "/config.json", "{" + base + R"("hidden_size": 32.5, "num_hidden_layers": 2})");
  msg = error_of([&] { load_model(d, no_tokenizer()); });
  EXPECT_NE(msg.find("'hidden_size' is not an integer"), std::string::npos) << msg;
  write(d + "/config.json", "{" + base + R"("hidden_size": 32.0, "num_hidden_layers": 2, "sliding_window_pattern": 0})");
  msg = error_of([&] { load_model(d, no_tokenizer()); });
  EXPECT_NE(msg.find("sliding_window_pattern must be at least 1"), std::string::npos) << msg;
  write(d + "/config.json", R"({"model_type": 7})");
  msg = error_of([&] { load_model(d, no_tokenizer()); });
  EXPECT_NE(msg.find("'model_type' is not a string"), std::string::npos) << msg;
}

// fuzz_router_folder: a focus.json whose "format" is not a string (or which is not an object)
// escaped as a JSON type error instead of a focus::Error.
TEST(FuzzRegressions, RouterConfigFormatOfTheWrongType) {
  const std::string d = scratch("router");
  const ModelConfig c = tiny_llama_config();
  for (const char* json : {R"({"format": 4, "window": 8})", "[1, 2]", "\"focus-router\""}) {
    write(d + "/focus.json", json);
    const std::string msg = error_of([&] { load_focus_settings(d, c); });
    EXPECT_NE(msg.find("not a focus router config"), std::string::npos) << json << ": " << msg;
    EXPECT_NE(msg.find("focus.json"), std::string::npos) << msg;
  }
}

TEST(FuzzRegressions, LoraConfigFormatOfTheWrongType) {
  const std::string d = scratch("lora");
  write(d + "/lora.json", R"({"format": ["focus-lora"], "rank": 2})");
  const std::string msg = error_of([&] { load_lora(d, tiny_llama_config()); });
  EXPECT_NE(msg.find("not a focus LoRA config"), std::string::npos) << msg;
}

// fuzz_bpe_files: an added token id of 10^9 resized the token table to 10^9 strings (32 GB),
// and a non-boolean "special" escaped as a JSON type error.
TEST(FuzzRegressions, HfTokenizerJsonAddedTokens) {
  const std::string d = scratch("hf");
  const std::string model = R"("model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]})";
  write(d + "/tokenizer.json", "{" + model + R"(, "added_tokens": [{"id": 1000000000, "content": "<x>", "special": true}]})");
  std::string msg = error_of([&] { io::load_tokenizer(d + "/tokenizer.json"); });
  EXPECT_NE(msg.find("added token id 1000000000 out of range"), std::string::npos) << msg;
  write(d + "/tokenizer.json", "{" + model + R"(, "added_tokens": [{"id": 2, "content": "<x>", "special": 3}]})");
  msg = error_of([&] { io::load_tokenizer(d + "/tokenizer.json"); });
  EXPECT_NE(msg.find("malformed entry in added_tokens"), std::string::npos) << msg;
  // A token added right after the vocabulary passes these checks (this toy vocabulary is then
  // refused for not being byte-level, which is beside the point here).
  write(d + "/tokenizer.json", "{" + model + R"(, "added_tokens": [{"id": 3, "content": "<x>", "special": true}]})");
  msg = error_of([&] { io::load_tokenizer(d + "/tokenizer.json"); });
  EXPECT_EQ(msg.find("added"), std::string::npos) << msg;
}

// fuzz_bpe_files (2026-11-29, after 6.7 million executions): a tokenizer.json whose model.type is
// a number escaped as a JSON type error; so did other fields of a wrong JSON type (byte_fallback,
// a pre-tokenizer's type or pattern). Each is now an error naming the file.
TEST(FuzzRegressions, HfTokenizerJsonFieldsOfTheWrongType) {
  const std::string d = scratch("hf_types");
  const std::string vocab = R"("vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"])";
  const std::pair<std::string, std::string> cases[] = {
      {R"({"model": {"type": 30, )" + vocab + "}}", "model.type is 30, not a string"},
      {R"({"model": {"type": "BPE", "byte_fallback": "yes", )" + vocab + "}}", "malformed tokenizer.json"},
      {R"({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "ByteLevel"}, 7]},)"
       R"( "model": {"type": "BPE", )" + vocab + "}}",
       "malformed tokenizer.json"},
  };
  for (const auto& [text, expect] : cases) {
    write(d + "/tokenizer.json", text);
    const std::string msg = error_of([&] { io::load_tokenizer(d + "/tokenizer.json"); });
    EXPECT_NE(msg.find("tokenizer.json"), std::string::npos) << text << ": " << msg;
    EXPECT_NE(msg.find(expect), std::string::npos) << text << ": " << msg;
  }
}

// fuzz_checkpoint: checkpoint metadata that is JSON but not an object escaped as a JSON type
// error; negative step counts were accepted; a trainer's load_state reading malformed metadata
// let JSON type errors through.
TEST(FuzzRegressions, CheckpointMalformedMetadata) {
  const std::string out = scratch("checkpoint");
  std::vector<float> a(6, 0.f);
  TrainTask task;
  task.name = "test";
  task.identity = {{"x", 1}};
  task.params = {&a};
  task.block_names = {"a."};
  task.loss_and_grad = [](const TrainWindow&, float, std::vector<std::vector<float>>&) { return 0.0; };
  task.validate = [](ValidPhase, int64_t, const nlohmann::json&) { return nlohmann::json::object(); };
  task.save_outputs = [] {};
  task.load_state = [](const io::SafetensorsFile&, const nlohmann::json& meta) {
    if (meta.contains("far_mass")) (void)meta["far_mass"].get<std::vector<float>>();
  };
  TrainOptions o;
  o.out = out;
  o.resume = true;
  o.steps = 0;
  o.progress = false;
  const std::string ck = out + "/checkpoint.safetensors";
  auto save = [&](const std::string& meta) {
    io::save_safetensors(ck, {{"a.params", {{6}, std::vector<float>(6, 0.f)}}}, {{"focus_checkpoint", meta}});
  };
  TrainData d;
  for (const char* meta : {"[1, 2]", R"({"identity": {"x": 1}, "step": -3, "adam_t": 0, "before": {}})",
                           R"({"identity": {"x": 1}, "step": 0, "adam_t": 0, "before": {}, "far_mass": "x"})"}) {
    save(meta);
    const std::string msg = error_of([&] { run_train_loop(o, d, task); });
    EXPECT_NE(msg.find("malformed checkpoint metadata"), std::string::npos) << meta << ": " << msg;
    EXPECT_NE(msg.find("checkpoint.safetensors"), std::string::npos) << msg;
  }
}

// fuzz_router_folder, fuzz_lora_folder: integer fields holding huge floats (8e54, 1.7e117) were
// converted to int64 without a range check (undefined behaviour).
TEST(FuzzRegressions, FolderConfigsWithFloatIntegers) {
  const ModelConfig c = tiny_llama_config();
  const std::string r = scratch("router_float");
  write(r + "/focus.json", R"({"format": "focus-router", "window": 8.11111e54, "sinks": 1, "groups": 4, "dg": 4,
    "model_dim": 32, "model_layers": 3, "layers": [0]})");
  std::string msg = error_of([&] { load_focus_settings(r, c); });
  EXPECT_NE(msg.find("'window' must be an integer"), std::string::npos) << msg;
  const std::string l = scratch("lora_float");
  write(l + "/lora.json", R"({"format": "focus-lora", "rank": 1.7e117, "alpha": 2, "targets": "qv",
    "model_dim": 32, "model_layers": 3, "layers": [0]})");
  msg = error_of([&] { load_lora(l, c); });
  EXPECT_NE(msg.find("'rank' must be an integer"), std::string::npos) << msg;
  write(l + "/lora.json", R"({"format": "focus-lora", "rank": 2, "alpha": 2, "targets": "qv",
    "model_dim": 32, "model_layers": 3, "layers": [1e300]})");
  msg = error_of([&] { load_lora(l, c); });
  EXPECT_NE(msg.find("'layers' must be an integer"), std::string::npos) << msg;
}

// fuzz_tasks: a TruthfulQA file with a number beyond double's range made the JSON parser throw
// its out_of_range error, which the loader did not turn into a clear error.
TEST(FuzzRegressions, TruthfulQaNumberOverflowIsAClearError) {
  const std::string p = scratch("tqa_overflow") + "/mc_task.json";
  write(p, "[8e8888888888\x01{\"quhh :\xa0\"W\"");
  for (int which : {1, 2}) {
    const std::string msg = error_of([&] { load_truthfulqa_mc(p, which); });
    EXPECT_NE(msg.find(p), std::string::npos) << msg;
    EXPECT_NE(msg.find("malformed JSON"), std::string::npos) << msg;
  }
}
