// Multiple-choice benchmarks scored by log-likelihood (`focus bench-tasks`), the way
// lm-evaluation-harness scores them: every choice is a continuation of a context, its score is
// the summed log-probability of the continuation tokens given the context; acc takes the argmax
// of the sum, acc_norm the argmax of the sum per byte of the choice, MC2 (TruthfulQA) the
// normalised probability mass of the true answers.
#pragma once
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "model/model.h"

namespace focus {

// Accuracy: exactly one true choice per item (acc and acc_norm). MC2: one or more true choices,
// scored by the probability mass on them (TruthfulQA MC2).
enum class TaskMetric { Accuracy, MC2 };

struct TaskItem {
  std::string context;                // shared by every choice (unless `contexts` is given)
  std::vector<std::string> contexts;  // optional, one per choice (WinoGrande: the option is in the context)
  std::vector<std::string> choices;   // answer texts; the scored continuation is delimiter + choice
  std::vector<int> labels;            // per choice: 1 = true, 0 = false
  int64_t line = 0;                   // 1-based line where the item starts (TruthfulQA: entry number)

  const std::string& context_of(size_t choice) const { return contexts.empty() ? context : contexts[choice]; }
  int gold() const;                   // index of the first true choice (-1 if none)
};

struct TaskSet {
  std::string name;                   // "hellaswag", "truthfulqa_mc1", ...
  std::string path;                   // source file
  TaskMetric metric = TaskMetric::Accuracy;
  std::string delimiter = " ";        // put between the context and each choice
  std::vector<TaskItem> items;
};

// ---- Loaders (errors name the file and the line) ----

// llama.cpp HellaSwag text: 6 lines per task (context, gold 0-3, four endings).
TaskSet load_hellaswag_txt(const std::string& path, const std::string& name = "hellaswag");
// TruthfulQA mc_task.json (list of {question, mc1_targets{answer: 0/1}, mc2_targets{...}}).
// which = 1: MC1 (Accuracy over mc1_targets), 2: MC2 (over mc2_targets). The context is the
// standard 6-shot QA prompt followed by "\n\nQ: <question>\nA:"; answers keep the file's order.
TaskSet load_truthfulqa_mc(const std::string& path, int which);
// JSONL {query, choices[], gold} (llm-foundry ARC / OpenBookQA / BoolQ); context = query + suffix.
TaskSet load_query_choices_jsonl(const std::string& path, const std::string& name,
                                 const std::string& context_suffix = "");
// JSONL {context_options[], continuation, gold} (llm-foundry WinoGrande): partial scoring of the
// shared continuation after each option's context.
TaskSet load_winogrande_jsonl(const std::string& path, const std::string& name = "winogrande");

// The 6-shot QA prompt of the TruthfulQA paper (without the trailing blank line).
const std::string& truthfulqa_qa_prompt();

// ---- Tasks under a bench directory (../shared/data/bench) ----

struct TaskInfo {
  std::string name;          // what load_task takes
  std::string rel_path;      // file relative to the bench directory
  std::string description;
  int64_t expected_items;    // as documented in bench/MANIFEST.md
};
// Every task this code knows, whether or not its file is present.
const std::vector<TaskInfo>& known_tasks();
// The known tasks whose file exists under bench_dir, in known_tasks() order.
std::vector<TaskInfo> list_tasks(const std::string& bench_dir);
// The default bench directory: $FOCUS_DATA/bench, else ../shared/data/bench.
std::string default_bench_dir();
// Task names as a user gives them: none means hellaswag, truthfulqa_mc1, truthfulqa_mc2; "all"
// means every known task present under bench_dir (Error if none is).
std::vector<std::string> resolve_task_names(const std::vector<std::string>& names, const std::string& bench_dir);
// Loads a task by name (see known_tasks()); unknown names and missing files throw Error.
TaskSet load_task(const std::string& name, const std::string& bench_dir);

// ---- Scoring ----

// Tokens of one (context, continuation) request as they are run: ids = [BOS] + context +
// continuation, minus the last token (it predicts nothing). The continuation's tokens are those
// of encode(context + continuation) after encode(context)'s count; trailing spaces of the
// context move to the continuation first. Longer than the model's max context: the oldest
// context tokens after BOS are dropped (truncated = true).
struct ChoiceTokens {
  std::vector<int32_t> ids;      // model input
  std::vector<int32_t> targets;  // per row: next token for continuation rows, -1 otherwise
  int64_t n_cont = 0;            // continuation tokens (rows scored)
  bool truncated = false;
};
ChoiceTokens tokenize_choice(const Model& m, const std::string& context, const std::string& continuation);

struct ChoiceScore {
  double ll = 0;                 // sum of log p over the continuation tokens (nats)
  int64_t tokens = 0;            // continuation tokens
  bool truncated = false;
};
// One forward over the request (window_nll); attention may be null (the model's own).
ChoiceScore score_choice(const Model& m, const std::string& context, const std::string& continuation,
                         const AttentionPlan* attention = nullptr);

struct ItemScore {
  std::vector<double> ll;        // per choice
  int pred = -1, pred_norm = -1; // argmax of ll, of ll / bytes(choice) (first on ties)
  double mc2 = 0;                // mass on the true choices (every metric)
};

struct TaskResult {
  std::string name;
  TaskMetric metric = TaskMetric::Accuracy;
  double acc = 0;                // argmax ll is a true choice (the gold one for Accuracy tasks)
  double acc_norm = 0;           // argmax ll / bytes(choice)
  double mc2 = 0;                // mean mass on the true answers (meaningful for MC2)
  int64_t count = 0;             // items scored
  int64_t requests = 0;          // forwards run (item x choice)
  int64_t tokens = 0;            // tokens of the requests
  int64_t computed = 0;          // tokens run through the model (shared prefixes run once)
  int64_t truncated = 0;         // requests cut from the left to fit the model's context
  double seconds = 0;
  bool interrupted = false;      // stopped by Ctrl-C; the numbers cover `count` items
  std::vector<ItemScore> items;  // per scored item, in order
};

// Scores the first `limit` items (limit <= 0: all), one forward per (item, choice). Stops
// cleanly when interrupted() becomes true (the partial item is dropped). Truncations are noted
// on stderr. With progress, a bar with the running accuracy is drawn on stderr.
TaskResult score_task(const Model& m, const TaskSet& t, const AttentionPlan* attention, int64_t limit,
                      bool progress);

// {"task", "metric", "acc", "acc_norm", "mc2" (MC2 only), "count", "requests", "tokens",
//  "truncated", "seconds", "interrupted"}.
nlohmann::json task_result_json(const TaskResult& r);
std::string to_string(TaskMetric m);  // "acc" | "mc2"

}  // namespace focus
