// The focus command: each subcommand (cli/cmd_*.cpp) parses its flags, calls the library and
// prints; cli/setup.* holds what they share. Here: the process set-up and the dispatch.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <new>
#include <vector>

#include "cli/process.h"
#include "cli/setup.h"
#include "core/error.h"
#include "core/threads.h"

int main(int argc, char** argv) {
  using namespace focus::cli;
  reexec_for_blas_kernels(argv);
  CLI::App app{"focus: Focus sparse attention for pretrained language models"};
  app.require_subcommand(1);
  int threads = 0;
  app.add_option("-t,--threads", threads, "threads (default: all cores)");
  const std::vector<Command> commands = {add_info(app),   add_eval(app),     add_generate(app), add_tokenize(app),
                                         add_prepare(app), add_retrofit(app), add_lora(app),     add_train(app),
                                         add_groups(app),        add_budget(app),
                                         add_bench_tasks(app), add_bench(app)};
  CLI11_PARSE(app, argc, argv);
  try {
    focus::set_threads(threads);
    for (const Command& c : commands)
      if (c.app->parsed()) return c.run();
  } catch (const focus::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "error: out of memory\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
