// focus generate: text from a prompt, greedy or sampled, streamed as it is generated.
#include <algorithm>
#include <cstdio>

#include "cli/process.h"
#include "cli/setup.h"
#include "core/error.h"
#include "io/text.h"
#include "model/generate.h"

namespace focus::cli {
namespace {

struct GenerateFlags {
  ModelSetup s;
  std::string prompt, prompt_file;
  int64_t n = 64;
  float temp = 0.f;
  uint64_t seed = 1;
  bool print_ids = false;
};

int run_generate(const GenerateFlags& f) {
  FOCUS_CHECK(f.prompt_file.empty() || f.prompt.empty(), "generate: give --prompt or --prompt-file, not both");
  const Loaded l = f.s.load();
  l.check_decodes("generate");
  const Model& m = *l.model;
  std::string prompt = f.prompt;
  if (!f.prompt_file.empty()) {
    prompt = io::load_text(f.prompt_file);
    FOCUS_CHECK(!prompt.empty(), f.prompt_file, ": empty prompt file");
  }
  const std::vector<int32_t> ids = encode_prompt(m, prompt);
  GenerateOptions o;
  o.max_new_tokens = f.n;
  o.temperature = f.temp;
  o.seed = f.seed;
  o.attention = l.attention();
  o.kv_type = f.s.kv();
  o.on_token = [&](int32_t token, int32_t previous) {
    std::fputs(m.tok->piece(token, previous).c_str(), stdout);
    std::fflush(stdout);
    return true;
  };
  install_interrupt_handler();
  if (f.prompt_file.empty()) std::fputs(prompt.c_str(), stdout);
  const GenerateResult r = generate(m, ids, o);
  std::printf("\n");
  std::fprintf(stderr, "[generate] prompt %lld tokens in %.2fs (%.1f tok/s); %lld tokens in %.2fs (%.1f tok/s)\n",
               (long long)r.prompt_tokens, r.prefill_seconds, r.prompt_tokens / std::max(r.prefill_seconds, 1e-9),
               (long long)r.generated, r.decode_seconds, r.generated / std::max(r.decode_seconds, 1e-9));
  if (r.decode_stats.layers > 0)
    std::fprintf(stderr, "[generate] attention %s: decoding read %.3f of the causal keys in its sparse layers\n",
                 l.describe().c_str(), r.decode_stats.density());
  if (f.print_ids) {
    std::string s;
    for (size_t i = 0; i < r.tokens.size(); ++i) s += (i ? " " : "") + std::to_string(r.tokens[i]);
    std::printf("ids: %s\n", s.c_str());
  }
  return 0;
}

}  // namespace

Command add_generate(CLI::App& app) {
  auto f = std::make_shared<GenerateFlags>();
  auto* sub = app.add_subcommand("generate", "generate text (greedy at --temp 0)");
  f->s.add_model(sub);
  sub->add_option("-p,--prompt", f->prompt, "prompt text");
  sub->add_option("--prompt-file", f->prompt_file, "read the prompt from a file (not echoed)");
  f->s.add_focus(sub);
  f->s.add_kv_type(sub);
  sub->add_option("-n", f->n, "tokens to generate")->check(CLI::NonNegativeNumber);
  sub->add_option("--temp", f->temp, "temperature (0 = greedy)")->check(CLI::NonNegativeNumber);
  sub->add_option("--seed", f->seed, "sampling seed");
  sub->add_flag("--ids", f->print_ids, "also print the token ids");
  return {sub, [f] { return run_generate(*f); }};
}

}  // namespace focus::cli
