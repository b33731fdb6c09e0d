// Perplexity of a model on a text file, through the installed libfocus API.
//   perplexity MODEL TEXT [CTX]
#include <libfocus.h>

#include <cstdio>
#include <cstdlib>

int main(int argc, char** argv) {
  if (argc < 3 || argc > 4) {
    std::fprintf(stderr, "usage: %s MODEL TEXT [CTX]\n", argv[0]);
    return 2;
  }
  try {
    auto model = focus::load_model(argv[1]);
    std::string text = focus::io::load_text(argv[2]);  // drops BOM, CRLF, Gutenberg boilerplate
    std::vector<int32_t> ids = model->tok->encode(text, false);

    focus::PplOptions o;
    o.ctx = argc == 4 ? std::atoll(argv[3]) : 256;
    if (o.ctx < 2) throw focus::Error("CTX must be at least 2");
    if (o.ctx > model->cfg.max_ctx) o.ctx = model->cfg.max_ctx;
    o.progress = false;
    focus::PplResult r = focus::perplexity(*model, ids, o);
    std::printf("%s: %lld tokens in %lld windows of %lld, mean NLL %.4f nats, perplexity %.3f\n", argv[2],
                (long long)r.tokens, (long long)r.windows, (long long)o.ctx, r.nll(), r.ppl());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "perplexity: %s\n", e.what());
    return 1;
  }
}
