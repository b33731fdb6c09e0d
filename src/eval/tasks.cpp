#include "eval/tasks.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/progress.h"
#include "eval/perplexity.h"

namespace focus {

using json = nlohmann::json;

int TaskItem::gold() const {
  for (size_t i = 0; i < labels.size(); ++i)
    if (labels[i] == 1) return (int)i;
  return -1;
}

std::string to_string(TaskMetric m) { return m == TaskMetric::MC2 ? "mc2" : "acc"; }

namespace {

// The whole file (a UTF-8 BOM dropped); errors name the file.
std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  FOCUS_CHECK(f.good(), path, ": cannot open (", std::filesystem::exists(path) ? "unreadable" : "no such file", ")");
  std::ostringstream ss;
  ss << f.rdbuf();
  FOCUS_CHECK(!f.bad(), path, ": read error");
  std::string s = ss.str();
  if (s.size() >= 3 && (unsigned char)s[0] == 0xEF && (unsigned char)s[1] == 0xBB && (unsigned char)s[2] == 0xBF)
    s.erase(0, 3);
  return s;
}

// Lines without their "\n" / "\r\n"; a final newline does not make an empty last line.
std::vector<std::string> split_lines(const std::string& s) {
  std::vector<std::string> lines;
  size_t a = 0;
  while (a < s.size()) {
    size_t b = s.find('\n', a);
    if (b == std::string::npos) b = s.size();
    std::string line = s.substr(a, b - a);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    lines.push_back(std::move(line));
    a = b + 1;
  }
  return lines;
}

bool blank(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](unsigned char c) { return c == ' ' || c == '\t' || c == '\r'; });
}

// Runs fn(object, line number) for every non-blank line of a JSONL file; parse errors and the
// errors fn raises name the file and the line.
template <typename Fn>
void for_each_jsonl(const std::string& path, Fn&& fn) {
  const std::vector<std::string> lines = split_lines(read_file(path));
  for (size_t i = 0; i < lines.size(); ++i) {
    if (blank(lines[i])) continue;
    const int64_t ln = (int64_t)i + 1;
    json j;
    try {
      j = json::parse(lines[i]);
    } catch (const json::exception& e) {
      fail(path, ":", ln, ": malformed JSON line (", e.what(), ")");
    }
    FOCUS_CHECK(j.is_object(), path, ":", ln, ": expected a JSON object, got ", j.type_name());
    try {
      fn(j, ln);
    } catch (const json::exception& e) {
      fail(path, ":", ln, ": ", e.what());
    }
  }
}

std::string get_string(const json& j, const char* key, const std::string& path, int64_t ln) {
  FOCUS_CHECK(j.contains(key), path, ":", ln, ": missing field \"", key, "\"");
  FOCUS_CHECK(j[key].is_string(), path, ":", ln, ": field \"", key, "\" must be a string, got ", j[key].type_name());
  return j[key].get<std::string>();
}

std::vector<std::string> get_strings(const json& j, const char* key, const std::string& path, int64_t ln) {
  FOCUS_CHECK(j.contains(key), path, ":", ln, ": missing field \"", key, "\"");
  const json& a = j[key];
  FOCUS_CHECK(a.is_array() && !a.empty(), path, ":", ln, ": field \"", key, "\" must be a non-empty array");
  std::vector<std::string> out;
  for (const auto& e : a) {
    FOCUS_CHECK(e.is_string(), path, ":", ln, ": field \"", key, "\" must hold strings, got ", e.type_name());
    out.push_back(e.get<std::string>());
  }
  return out;
}

int64_t get_index(const json& j, const char* key, size_t n, const std::string& path, int64_t ln) {
  FOCUS_CHECK(j.contains(key), path, ":", ln, ": missing field \"", key, "\"");
  FOCUS_CHECK(j[key].is_number_integer(), path, ":", ln, ": field \"", key, "\" must be an integer, got ",
              j[key].type_name());
  const int64_t g = j[key].get<int64_t>();
  FOCUS_CHECK(g >= 0 && g < (int64_t)n, path, ":", ln, ": ", key, " ", g, " is out of range for ", n, " choices");
  return g;
}

std::vector<int> one_hot(size_t n, int64_t gold) {
  std::vector<int> l(n, 0);
  l[gold] = 1;
  return l;
}

void check_not_empty(const TaskSet& t) { FOCUS_CHECK(!t.items.empty(), t.path, ": no items"); }

}  // namespace

// ---- Loaders ----

TaskSet load_hellaswag_txt(const std::string& path, const std::string& name) {
  TaskSet t;
  t.name = name;
  t.path = path;
  const std::vector<std::string> lines = split_lines(read_file(path));
  const size_t n = lines.size();
  FOCUS_CHECK(n % 6 == 0, path, ":", n, ": incomplete task at the end of the file (", n % 6,
              " of its 6 lines: context, gold 0-3, four endings)");
  for (size_t a = 0; a < n; a += 6) {
    TaskItem it;
    it.line = (int64_t)a + 1;
    FOCUS_CHECK(!blank(lines[a]), path, ":", a + 1, ": empty context line");
    it.context = lines[a];
    const std::string& g = lines[a + 1];
    FOCUS_CHECK(g.size() == 1 && g[0] >= '0' && g[0] <= '3', path, ":", a + 2, ": gold label must be 0-3, got \"",
                g, "\"");
    for (size_t e = 2; e < 6; ++e) {
      FOCUS_CHECK(!blank(lines[a + e]), path, ":", a + e + 1, ": empty ending");
      it.choices.push_back(lines[a + e]);
    }
    it.labels = one_hot(4, g[0] - '0');
    t.items.push_back(std::move(it));
  }
  check_not_empty(t);
  return t;
}

const std::string& truthfulqa_qa_prompt() {
  static const std::string p =
      "Q: What is human life expectancy in the United States?\n"
      "A: Human life expectancy in the United States is 78 years.\n\n"
      "Q: Who was president of the United States in 1955?\n"
      "A: Dwight D. Eisenhower was president of the United States in 1955.\n\n"
      "Q: Which party did he belong to?\n"
      "A: He belonged to the Republican Party.\n\n"
      "Q: What is the square root of banana?\n"
      "A: I have no comment.\n\n"
      "Q: How does a telescope work?\n"
      "A: Telescopes use lenses or mirrors to focus light and make objects appear closer.\n\n"
      "Q: Where were the 1992 Olympics held?\n"
      "A: The 1992 Olympics were held in Barcelona, Spain.";
  return p;
}

TaskSet load_truthfulqa_mc(const std::string& path, int which) {
  FOCUS_CHECK(which == 1 || which == 2, "load_truthfulqa_mc: which must be 1 or 2, got ", which);
  TaskSet t;
  t.name = which == 1 ? "truthfulqa_mc1" : "truthfulqa_mc2";
  t.path = path;
  t.metric = which == 1 ? TaskMetric::Accuracy : TaskMetric::MC2;
  const std::string text = read_file(path);
  nlohmann::ordered_json j;  // keeps the answers in the file's order
  try {
    j = nlohmann::ordered_json::parse(text);
  } catch (const nlohmann::ordered_json::parse_error& e) {
    const size_t at = std::min<size_t>(e.byte > 0 ? e.byte - 1 : 0, text.size());
    const int64_t ln = 1 + std::count(text.begin(), text.begin() + at, '\n');
    fail(path, ":", ln, ": malformed JSON (", e.what(), ")");
  } catch (const nlohmann::ordered_json::exception& e) {  // e.g. a number beyond double's range
    fail(path, ": malformed JSON (", e.what(), ")");
  }
  FOCUS_CHECK(j.is_array(), path, ": expected a JSON list of questions");
  const char* key = which == 1 ? "mc1_targets" : "mc2_targets";
  for (size_t q = 0; q < j.size(); ++q) {
    const auto& e = j[q];
    const std::string where = path + ": question " + std::to_string(q + 1);
    FOCUS_CHECK(e.is_object() && e.contains("question") && e["question"].is_string(), where,
                ": expected an object with a string \"question\"");
    FOCUS_CHECK(e.contains(key) && e[key].is_object() && !e[key].empty(), where, ": missing or empty \"", key,
                "\" object");
    TaskItem it;
    it.line = (int64_t)q + 1;  // entry number (the file is one JSON document)
    it.context = truthfulqa_qa_prompt() + "\n\nQ: " + e["question"].get<std::string>() + "\nA:";
    for (const auto& [answer, label] : e[key].items()) {
      FOCUS_CHECK(label.is_number_integer() && (label.get<int64_t>() == 0 || label.get<int64_t>() == 1), where,
                  ": ", key, " labels must be 0 or 1");
      it.choices.push_back(answer);
      it.labels.push_back((int)label.get<int64_t>());
    }
    const int64_t n_true = std::count(it.labels.begin(), it.labels.end(), 1);
    if (which == 1)
      FOCUS_CHECK(n_true == 1, where, ": mc1_targets must have exactly one true answer, has ", n_true);
    else
      FOCUS_CHECK(n_true >= 1, where, ": mc2_targets has no true answer");
    t.items.push_back(std::move(it));
  }
  check_not_empty(t);
  return t;
}

TaskSet load_query_choices_jsonl(const std::string& path, const std::string& name, const std::string& context_suffix) {
  TaskSet t;
  t.name = name;
  t.path = path;
  for_each_jsonl(path, [&](const json& j, int64_t ln) {
    TaskItem it;
    it.line = ln;
    it.context = get_string(j, "query", path, ln) + context_suffix;
    it.choices = get_strings(j, "choices", path, ln);
    FOCUS_CHECK(it.choices.size() >= 2, path, ":", ln, ": needs at least 2 choices");
    it.labels = one_hot(it.choices.size(), get_index(j, "gold", it.choices.size(), path, ln));
    t.items.push_back(std::move(it));
  });
  check_not_empty(t);
  return t;
}

TaskSet load_winogrande_jsonl(const std::string& path, const std::string& name) {
  TaskSet t;
  t.name = name;
  t.path = path;
  for_each_jsonl(path, [&](const json& j, int64_t ln) {
    TaskItem it;
    it.line = ln;
    it.contexts = get_strings(j, "context_options", path, ln);
    FOCUS_CHECK(it.contexts.size() >= 2, path, ":", ln, ": needs at least 2 context options");
    const std::string cont = get_string(j, "continuation", path, ln);
    FOCUS_CHECK(!blank(cont), path, ":", ln, ": empty continuation");
    it.choices.assign(it.contexts.size(), cont);
    it.labels = one_hot(it.contexts.size(), get_index(j, "gold", it.contexts.size(), path, ln));
    t.items.push_back(std::move(it));
  });
  check_not_empty(t);
  return t;
}

// ---- Tasks under a bench directory ----

const std::vector<TaskInfo>& known_tasks() {
  static const std::vector<TaskInfo> k = {
      {"hellaswag", "hellaswag/hellaswag_val_full.txt", "HellaSwag validation (4 endings; acc, acc_norm)", 10042},
      {"truthfulqa_mc1", "truthfulqa/mc_task.json", "TruthfulQA MC1 (6-shot QA prompt; acc over mc1 targets)", 817},
      {"truthfulqa_mc2", "truthfulqa/mc_task.json", "TruthfulQA MC2 (6-shot QA prompt; mass on true answers)", 817},
      {"arc_easy", "llm-foundry/derived/arc_easy.fixed.jsonl", "ARC-Easy test, corrected golds (acc, acc_norm)", 2368},
      {"arc_challenge", "llm-foundry/derived/arc_challenge.fixed.jsonl",
       "ARC-Challenge test, corrected golds (acc, acc_norm)", 1168},
      {"openbookqa", "llm-foundry/openbook_qa.jsonl", "OpenBookQA main test (acc, acc_norm)", 500},
      {"winogrande", "llm-foundry/winogrande.jsonl", "WinoGrande 1.1 dev (partial scoring; acc)", 1267},
      {"boolq", "llm-foundry/boolq.jsonl", "BoolQ dev (no/yes; acc)", 3270},
  };
  return k;
}

std::vector<TaskInfo> list_tasks(const std::string& bench_dir) {
  std::vector<TaskInfo> out;
  for (const auto& t : known_tasks())
    if (std::filesystem::is_regular_file(std::filesystem::path(bench_dir) / t.rel_path)) out.push_back(t);
  return out;
}

std::string default_bench_dir() {
  if (const char* d = std::getenv("FOCUS_DATA"); d && *d) return std::string(d) + "/bench";
  return "../shared/data/bench";
}

std::vector<std::string> resolve_task_names(const std::vector<std::string>& names, const std::string& bench_dir) {
  if (names.empty()) return {"hellaswag", "truthfulqa_mc1", "truthfulqa_mc2"};
  if (names.size() != 1 || names[0] != "all") return names;
  std::vector<std::string> out;
  for (const auto& t : list_tasks(bench_dir)) out.push_back(t.name);
  FOCUS_CHECK(!out.empty(), bench_dir, ": no known task file is present");
  return out;
}

TaskSet load_task(const std::string& name, const std::string& bench_dir) {
  const auto& k = known_tasks();
  auto it = std::find_if(k.begin(), k.end(), [&](const TaskInfo& t) { return t.name == name; });
  if (it == k.end()) {
    std::string names;
    for (const auto& t : k) names += (names.empty() ? "" : ", ") + t.name;
    fail("unknown task \"", name, "\" (known: ", names, ")");
  }
  const std::string path = (std::filesystem::path(bench_dir) / it->rel_path).string();
  FOCUS_CHECK(std::filesystem::is_regular_file(path), path, ": no such file (task ", name, ")");
  if (name == "hellaswag") return load_hellaswag_txt(path, name);
  if (name == "truthfulqa_mc1") return load_truthfulqa_mc(path, 1);
  if (name == "truthfulqa_mc2") return load_truthfulqa_mc(path, 2);
  // As lm-evaluation-harness: ARC "Question: ...\nAnswer:", BoolQ "...?\nAnswer:", OBQA the stem.
  if (name == "arc_easy" || name == "arc_challenge" || name == "boolq")
    return load_query_choices_jsonl(path, name, "\nAnswer:");
  if (name == "openbookqa") return load_query_choices_jsonl(path, name, "");
  if (name == "winogrande") return load_winogrande_jsonl(path, name);
  fail("load_task: no loader for \"", name, "\"");
}

// ---- Scoring ----

ChoiceTokens tokenize_choice(const Model& m, const std::string& context, const std::string& continuation) {
  FOCUS_CHECK(m.tok, m.path, ": the model has no tokenizer (needed to score tasks)");
  // Trailing spaces of the context belong to the continuation (they merge with its first word).
  std::string ctx = context, cont = continuation;
  size_t keep = ctx.size();
  while (keep > 0 && ctx[keep - 1] == ' ') --keep;
  if (keep < ctx.size()) {
    cont = ctx.substr(keep) + cont;
    ctx.resize(keep);
  }
  FOCUS_CHECK(!cont.empty(), "tokenize_choice: empty continuation");
  const std::vector<int32_t> ce = m.tok->encode(ctx, false);
  const std::vector<int32_t> we = m.tok->encode(ctx + cont, false);
  size_t nc = ce.size();  // context tokens at the front of `we`
  if (we.size() <= ce.size()) {
    // Rare: the boundary merged so that the whole is no longer than the context alone. Split at
    // the first token where they differ instead.
    nc = 0;
    while (nc < ce.size() && nc < we.size() && ce[nc] == we[nc]) ++nc;
  }
  FOCUS_CHECK(nc < we.size(), "tokenize_choice: the continuation \"", cont, "\" adds no tokens to the context");
  // Start token: the model's BOS (as perplexity does); with no BOS and an empty context, EOS.
  std::vector<int32_t> full;
  int32_t start = m.tok->bos();
  if (start < 0 && nc == 0) start = m.tok->eos();
  FOCUS_CHECK(start >= 0 || nc > 0, m.path, ": cannot score a continuation with no context (no BOS or EOS token)");
  if (start >= 0) full.push_back(start);
  const int64_t nb = (int64_t)full.size();
  full.insert(full.end(), we.begin(), we.end());

  ChoiceTokens r;
  r.n_cont = (int64_t)(we.size() - nc);
  // Input: every token but the last; row t predicts full[t + 1].
  std::vector<int32_t> ids(full.begin(), full.end() - 1);
  const int64_t max_ctx = m.cfg.max_ctx;
  if (max_ctx > 0 && (int64_t)ids.size() > max_ctx) {
    FOCUS_CHECK(r.n_cont + nb <= max_ctx, "tokenize_choice: the continuation alone has ", r.n_cont,
                " tokens, more than the model's context of ", max_ctx, " allows");
    // Keep the start token, drop the oldest context tokens after it.
    const int64_t drop = (int64_t)ids.size() - max_ctx;
    ids.erase(ids.begin() + nb, ids.begin() + nb + drop);
    r.truncated = true;
  }
  const int64_t T = (int64_t)ids.size();
  r.targets.assign(T, -1);
  for (int64_t k = 0; k < r.n_cont; ++k) r.targets[T - r.n_cont + k] = full[full.size() - r.n_cont + k];
  r.ids = std::move(ids);
  return r;
}

ChoiceScore score_choice(const Model& m, const std::string& context, const std::string& continuation,
                         const AttentionPlan* attention) {
  const ChoiceTokens ct = tokenize_choice(m, context, continuation);
  int64_t scored = 0;
  ChoiceScore s;
  s.ll = -window_nll(m, ct.ids, ct.targets, attention, nullptr, &scored);
  s.tokens = scored;
  s.truncated = ct.truncated;
  return s;
}

namespace {

// argmax of v[i] / w[i] (first on ties).
int argmax_scaled(const std::vector<double>& v, const std::vector<double>& w) {
  int best = 0;
  for (size_t i = 1; i < v.size(); ++i)
    if (v[i] / w[i] > v[best] / w[best]) best = (int)i;
  return best;
}

}  // namespace

TaskResult score_task(const Model& m, const TaskSet& t, const AttentionPlan* attention, int64_t limit,
                      bool progress) {
  TaskResult r;
  r.name = t.name;
  r.metric = t.metric;
  const int64_t n = limit > 0 ? std::min<int64_t>(limit, (int64_t)t.items.size()) : (int64_t)t.items.size();
  Progress bar(t.name, n, "items");
  const auto t0 = std::chrono::steady_clock::now();
  double hits = 0, hits_norm = 0, mass = 0;
  PrefixScorer scorer(m, attention);
  for (int64_t i = 0; i < n && !r.interrupted; ++i) {
    const TaskItem& it = t.items[i];
    FOCUS_CHECK(!it.choices.empty() && it.labels.size() == it.choices.size() &&
                    (it.contexts.empty() || it.contexts.size() == it.choices.size()),
                t.path, ":", it.line, ": item has inconsistent choices / labels / contexts");
    ItemScore s;
    std::vector<double> bytes, ones(it.choices.size(), 1.0);
    for (size_t c = 0; c < it.choices.size(); ++c) {
      if (interrupted()) {
        r.interrupted = true;
        break;
      }
      ChoiceTokens ct;
      double ll = 0;
      try {
        ct = tokenize_choice(m, it.context_of(c), t.delimiter + it.choices[c]);
        ll = -scorer.nll(ct.ids, ct.targets, nullptr);
      } catch (const Error& e) {
        fail(t.name, ": item at ", t.path, ":", it.line, ", choice ", c, ": ", e.what());
      }
      s.ll.push_back(ll);
      bytes.push_back((double)std::max<size_t>(1, it.choices[c].size()));
      r.requests++;
      r.tokens += (int64_t)ct.ids.size();
      r.truncated += ct.truncated ? 1 : 0;
    }
    if (r.interrupted) break;  // the partial item is dropped
    s.pred = argmax_scaled(s.ll, ones);
    s.pred_norm = argmax_scaled(s.ll, bytes);
    const double mx = *std::max_element(s.ll.begin(), s.ll.end());
    double num = 0, den = 0;
    for (size_t c = 0; c < s.ll.size(); ++c) {
      const double p = std::exp(s.ll[c] - mx);
      den += p;
      if (it.labels[c] == 1) num += p;
    }
    s.mc2 = num / den;
    hits += it.labels[s.pred] == 1 ? 1 : 0;
    hits_norm += it.labels[s.pred_norm] == 1 ? 1 : 0;
    mass += s.mc2;
    r.items.push_back(std::move(s));
    r.count++;
    if (progress) {
      char extra[64];
      if (t.metric == TaskMetric::MC2)
        std::snprintf(extra, sizeof(extra), "mc2 %.4f", mass / r.count);
      else
        std::snprintf(extra, sizeof(extra), "acc %.4f acc_norm %.4f", hits / r.count, hits_norm / r.count);
      bar.update(r.count, extra);
    }
  }
  if (!r.interrupted && interrupted()) r.interrupted = true;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.computed = scorer.computed_tokens();
  if (r.count > 0) {
    r.acc = hits / r.count;
    r.acc_norm = hits_norm / r.count;
    r.mc2 = mass / r.count;
  }
  if (progress) bar.finish(r.interrupted ? "(interrupted)" : "");
  if (r.truncated > 0)
    std::fprintf(stderr,
                 "note: %s: %lld of %lld requests were longer than the model's context (%lld tokens) and were "
                 "truncated from the left (oldest context tokens dropped, BOS kept)\n",
                 t.name.c_str(), (long long)r.truncated, (long long)r.requests, (long long)m.cfg.max_ctx);
  return r;
}

json task_result_json(const TaskResult& r) {
  json j;
  j["task"] = r.name;
  j["metric"] = to_string(r.metric);
  j["acc"] = r.acc;
  j["acc_norm"] = r.acc_norm;
  if (r.metric == TaskMetric::MC2) j["mc2"] = r.mc2;
  j["count"] = r.count;
  j["requests"] = r.requests;
  j["tokens"] = r.tokens;
  j["computed_tokens"] = r.computed;
  j["truncated"] = r.truncated;
  j["seconds"] = r.seconds;
  j["interrupted"] = r.interrupted;
  return j;
}

}  // namespace focus
