// focus tokenize: the token ids of a text, with a model's tokenizer or a tokenizer file.
#include <cstdio>

#include "cli/setup.h"
#include "core/error.h"
#include "io/tokenizer.h"

namespace focus::cli {
namespace {

struct TokenizeFlags {
  ModelSetup s;
  std::string text;
  bool bos = false;
};

int run_tokenize(const TokenizeFlags& f) {
  std::unique_ptr<io::Tokenizer> tok;
  if (!f.s.model.empty()) {
    tok = std::move(f.s.load().model->tok);
  } else {
    FOCUS_CHECK(!f.s.tokenizer.empty(), "tokenize: give --model or --tokenizer");
    tok = io::load_tokenizer(f.s.tokenizer);
  }
  const std::vector<int32_t> ids = tok->encode(f.text, f.bos);
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? " " : "") + std::to_string(ids[i]);
  std::printf("%s\n", s.c_str());
  return 0;
}

}  // namespace

Command add_tokenize(CLI::App& app) {
  auto f = std::make_shared<TokenizeFlags>();
  auto* sub = app.add_subcommand("tokenize", "print token ids of a text");
  sub->add_option("--model", f->s.model, "MODEL whose tokenizer to use");
  sub->add_option("--tokenizer", f->s.tokenizer, "tokenizer file or folder");
  sub->add_option("-p,--prompt", f->text, "text")->required();
  sub->add_flag("--bos", f->bos, "prepend BOS");
  return {sub, [f] { return run_tokenize(*f); }};
}

}  // namespace focus::cli
