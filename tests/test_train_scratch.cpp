// focus train: a model trained from scratch learns, is saved as a folder that load_model reads
// back to the perplexity the trainer reported, resumes to the same bits, and prints its result.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/mapped_file.h"
#include "eval/perplexity.h"
#include "io/safetensors_writer.h"
#include "test_util.h"
#include "train/data.h"
#include "train/pretrain.h"

namespace focus {
namespace {

namespace fs = std::filesystem;
using test::book;

PretrainOptions small_run(const std::string& name, const std::string& arch, const std::string& attention) {
  PretrainOptions o = test::small_training_run<PretrainOptions>((fs::temp_directory_path() / name).string());
  o.tokenizer = test::tok512();
  o.arch = arch;
  o.attention = attention;
  o.ctx = 64;
  o.steps = 8;
  o.batch = 2;
  o.warmup = 2;
  o.adam.lr = 3e-3f;
  o.valid_windows = 4;
  o.focus.local_window = 16;
  o.focus.groups = 4;
  o.focus.topk = 1;
  o.measure_peak = false;  // three 2048^3 products after each run, most of these tests' time
  return o;
}

TEST(TrainScratch, LearnsAndTheSavedModelScoresWhatTheTrainerReported) {
  FOCUS_NEED_FILE(test::tok512());
  const PretrainOptions o = small_run("focus_train_learns", "gqa", "dense");
  const PretrainResult r = run_pretrain(o);
  EXPECT_EQ(r.steps, 8);
  EXPECT_EQ(r.train_tokens, 8 * 2 * 63);
  EXPECT_LT(r.valid_ppl, 0.6 * r.valid_ppl_initial) << "training lowered the validation perplexity";
  // The saved folder, loaded like any model, on the trainer's validation windows.
  const auto m = load_model(r.model_dir);
  const auto docs = tokenize_docs(*m->tok, o.valid);
  double nll = 0;
  int64_t tokens = 0;
  for (const WindowRef& ref : validation_windows(docs, o.ctx, m->tok->bos(), o.valid_windows)) {
    const Window w = make_window(docs, ref, o.ctx, m->tok->bos());
    int64_t n = 0;
    nll += window_nll(*m, w.ids, w.targets, nullptr, nullptr, &n);
    tokens += n;
  }
  EXPECT_EQ(tokens, r.valid_tokens);
  EXPECT_NEAR(std::exp(nll / tokens), r.valid_ppl, 1e-4 * r.valid_ppl);
}

// An interrupted run resumed from its checkpoint ends with the bits of an uninterrupted one, on
// each of the five architectures, with dense attention or routers trained jointly (SwAV). With the
// smaller shapes: 4 steps stopped after 2, on windows of 32 tokens.
TEST(TrainScratch, ResumeGivesTheBitsOfAnUninterruptedRun) {
  FOCUS_NEED_FILE(test::tok512());
  const bool small = test::small_shapes();
  const int64_t steps = small ? 4 : 6;
  for (auto [arch, attention] : {std::pair<const char*, const char*>{"mha", "dense"}, {"gqa", "focus"}, {"mqa", "dense"},
                                {"local-global", "focus"}, {"mla", "focus"}}) {
    auto options = [&, arch = arch, attention = attention](const char* name) {  // (clang 14: no captured bindings)
      PretrainOptions o = small_run(name, arch, attention);
      o.balance = "swav";
      o.steps = steps;
      if (small) o.ctx = 32;
      return o;
    };
    const PretrainResult ra = run_pretrain(options("focus_train_whole"));
    PretrainOptions b = options("focus_train_parts");
    b.stop_after = steps / 2;
    EXPECT_TRUE(run_pretrain(b).interrupted);
    b.stop_after = 0;
    b.resume = true;
    const PretrainResult rb = run_pretrain(b);
    EXPECT_EQ(rb.steps, steps);
    EXPECT_TRUE(read_file(ra.model_dir + "/model.safetensors") == read_file(rb.model_dir + "/model.safetensors"))
        << arch << " " << attention;
    EXPECT_EQ(ra.valid_ppl, rb.valid_ppl);
    if (std::string(attention) == "focus") {
      EXPECT_TRUE(read_file(ra.routers_dir + "/router.safetensors") == read_file(rb.routers_dir + "/router.safetensors"));
      EXPECT_GT(ra.valid_ppl_hard, 0);
    }
  }
}

// --config: the architecture and sizes from a Hugging Face config.json (here a small DeepSeek-V2
// with its latent attention); its vocabulary must be the tokenizer's.
TEST(TrainScratch, ConfigFileGivesTheArchitecture) {
  FOCUS_NEED_FILE(test::tok512());
  ModelConfig c = preset_config("mla", 512, 64);
  c.layers = 2;
  c.layer_sliding_window.resize(2);
  c.dim = 64;
  c.heads = 2;
  c.ffn = 96;
  PretrainOptions o = small_run("focus_train_config", "gqa", "dense");
  o.config = (fs::temp_directory_path() / "focus_train_config.json").string();
  io::write_file_atomic(o.config, hf_config_json(c, -1, -1));
  o.steps = 2;
  const PretrainResult r = run_pretrain(o);
  EXPECT_EQ(r.arch, "deepseek_v2");
  const auto m = load_model(r.model_dir);
  EXPECT_TRUE(m->cfg.mla());
  EXPECT_EQ(m->cfg.mla_q_rank, 128);  // the preset's low-rank queries, through config.json
  EXPECT_EQ(m->cfg.dim, 64);
  EXPECT_EQ(m->cfg.layers, 2);
  EXPECT_EQ(r.params, m->w.n_params);
  c.vocab = 300;
  io::write_file_atomic(o.config, hf_config_json(c, -1, -1));
  const std::string err = test::error_of([&] { run_pretrain(o); });
  EXPECT_NE(err.find("vocab_size 300 but the tokenizer has 512 tokens"), std::string::npos) << err;
}

TEST(TrainScratch, CommandLineReportsJson) {
  FOCUS_NEED_FILE(test::tok512());
  const std::string out = (fs::temp_directory_path() / "focus_train_cli").string();
  const test::BinRun r = test::run_focus(
      "-t 1 train --arch mha --attention focus --window 16 --groups 4 --tokenizer " + test::tok512() + " --train " +
      book("pg-345-dracula.txt") + " --valid " + book("pg-1342-pride-and-prejudice.txt") +
      " --ctx 64 --steps 3 --batch 2 --valid-windows 2 --out " + out + " --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out.substr(r.out.rfind('{')));
  for (const char* k : {"valid_ppl", "valid_ppl_hard", "train_tokens", "tokens_per_s", "steps", "params"})
    EXPECT_TRUE(j.contains(k)) << k;
  EXPECT_EQ(j["steps"], 3);
  const test::BinRun e = test::run_focus("-t 1 eval --model " + out + "/model --focus " + out +
                                             "/routers --mode hard --text " + book("pg-1342-pride-and-prejudice.txt") +
                                             " --ctx 64 --max-tokens 256 --json",
                                         "eval");
  EXPECT_EQ(e.code, 0) << e.err;
  const test::BinRun bad = test::run_focus("-t 1 train --arch mla2 --tokenizer " + test::tok512() + " --train " +
                                               book("pg-345-dracula.txt") + " --valid " +
                                               book("pg-1342-pride-and-prejudice.txt") + " --out " + out,
                                           "bad");
  EXPECT_EQ(bad.code, 1);
  EXPECT_NE(bad.err.find("unknown --arch 'mla2'"), std::string::npos) << bad.err;
}

}  // namespace
}  // namespace focus
