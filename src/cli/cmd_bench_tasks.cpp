// focus bench-tasks: multiple-choice benchmarks scored by log-likelihood.
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>

#include "cli/process.h"
#include "cli/setup.h"
#include "core/error.h"
#include "core/threads.h"
#include "eval/tasks.h"

namespace focus::cli {
namespace {

struct BenchTasksFlags {
  ModelSetup s;
  std::string bench_dir;
  std::vector<std::string> tasks;
  int64_t limit = 0;
  bool list_only = false;
};

int list_known_tasks(const std::string& bench_dir) {
  for (const auto& t : known_tasks()) {
    const bool present = std::filesystem::is_regular_file(std::filesystem::path(bench_dir) / t.rel_path);
    std::printf("%-16s %-8s %6lld items  %s\n", t.name.c_str(), present ? "present" : "missing",
                (long long)t.expected_items, t.description.c_str());
  }
  return 0;
}

int run_bench_tasks(const BenchTasksFlags& f) {
  const std::string bench_dir = f.bench_dir.empty() ? default_bench_dir() : f.bench_dir;
  if (f.list_only) return list_known_tasks(bench_dir);
  FOCUS_CHECK(!f.s.model.empty(), "bench-tasks: give --model MODEL");
  f.s.check();
  FOCUS_CHECK(std::filesystem::is_directory(bench_dir), bench_dir,
              ": no such folder (give --bench-dir, or set FOCUS_DATA to the shared data folder)");
  std::vector<TaskSet> sets;
  for (const auto& name : resolve_task_names(f.tasks, bench_dir))
    sets.push_back(load_task(name, bench_dir));  // every file checked before the model loads
  const Loaded l = f.s.load();
  const Model& m = *l.model;
  install_interrupt_handler();
  nlohmann::json results = nlohmann::json::array();
  std::printf("%-16s %-6s %8s %8s %8s %7s %9s\n", "task", "metric", "acc", "acc_norm", "mc2", "items", "seconds");
  int rc = 0;
  for (const auto& t : sets) {
    const TaskResult r = score_task(m, t, l.attention(), f.limit, true);
    std::printf("%-16s %-6s %8.4f %8.4f %8s %7lld %9.1f%s\n", r.name.c_str(), to_string(r.metric).c_str(), r.acc,
                r.acc_norm, r.metric == TaskMetric::MC2 ? std::to_string(r.mc2).substr(0, 6).c_str() : "-",
                (long long)r.count, r.seconds, r.interrupted ? "  INTERRUPTED (partial)" : "");
    std::fflush(stdout);
    results.push_back(task_result_json(r));
    if (r.interrupted) {
      rc = 130;
      break;
    }
  }
  if (f.s.as_json) {
    nlohmann::json j{{"model", m.path},
                     {"bench_dir", bench_dir},
                     {"limit", f.limit},
                     {"tasks", results},
                     {"focus", l.focus ? to_string(l.focus->settings.mode) : "off"},
                     {"threads", num_threads()}};
    if (l.focus) j["focus_dir"] = f.s.focus.dir;
    if (!f.s.lora.empty()) j["lora"] = f.s.lora;
    std::cout << j.dump() << "\n";
  }
  return rc;
}

}  // namespace

Command add_bench_tasks(CLI::App& app) {
  auto f = std::make_shared<BenchTasksFlags>();
  auto* sub = app.add_subcommand(
      "bench-tasks", "multiple-choice benchmarks scored by log-likelihood (HellaSwag, TruthfulQA, ARC, ...)");
  f->s.add_model(sub, false);
  sub->add_option("--tasks", f->tasks,
                  "task names, comma separated, or 'all' (default: hellaswag,truthfulqa_mc1,truthfulqa_mc2)")
      ->delimiter(',');
  sub->add_option("--bench-dir", f->bench_dir,
                  "folder of the benchmark files (default: $FOCUS_DATA/bench or ../shared/data/bench)");
  sub->add_option("--limit", f->limit, "score only the first N items of each task (0: all)");
  sub->add_flag("--list", f->list_only, "list the known tasks and whether their files are present");
  f->s.add_json(sub);
  f->s.add_lora(sub);
  f->s.add_focus(sub);
  return {sub, [f] { return run_bench_tasks(*f); }};
}

}  // namespace focus::cli
