// focus groups: what the routers learned (group sizes and frequent tokens per layer).
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "cli/process.h"
#include "cli/setup.h"
#include "core/error.h"
#include "core/progress.h"
#include "eval/groups_report.h"
#include "io/text.h"

namespace focus::cli {
namespace {

struct GroupsFlags {
  ModelSetup s;
  std::vector<std::string> texts;
  int64_t ctx = 512, max_tokens = 0;
  int top_n = 8;
};

int run_groups(const GroupsFlags& f) {
  FOCUS_CHECK(!f.s.focus.dir.empty(), "groups: give --focus DIR (routers to inspect)");
  const Loaded l = f.s.load();
  const Model& m = *l.model;
  const std::vector<int32_t> ids = io::load_text_tokens(*m.tok, f.texts, f.max_tokens);
  install_interrupt_handler();
  const GroupsReport r = groups_report(m, *l.focus, ids, f.ctx, f.max_tokens, f.top_n, true);
  std::fputs(groups_report_text(m, r).c_str(), stdout);
  if (f.s.as_json)
    std::cout << groups_report_json(m, r).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  return interrupted() ? 130 : 0;
}

}  // namespace

Command add_groups(CLI::App& app) {
  auto f = std::make_shared<GroupsFlags>();
  auto* sub = app.add_subcommand("groups", "what the routers learned: group sizes and frequent tokens per layer");
  f->s.add_model(sub);
  sub->add_option("--text", f->texts, "text files")->required();
  sub->add_option("--ctx", f->ctx, "window length in tokens (incl. BOS)");
  sub->add_option("--max-tokens", f->max_tokens, "use only the first T text tokens");
  sub->add_option("--top", f->top_n, "tokens listed per group");
  f->s.add_json(sub);
  f->s.add_focus(sub);
  return {sub, [f] { return run_groups(*f); }};
}

}  // namespace focus::cli
