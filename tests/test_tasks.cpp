// Multiple-choice benchmarks: the loaders on the real files under ../shared/data/bench (counts as
// documented in bench/MANIFEST.md, golds against the official answer keys), errors that name the
// file and line, and log-likelihood scoring against an independent forward() + log_prob.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <tuple>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "eval/perplexity.h"
#include "eval/tasks.h"
#include "focus/focus_attention.h"
#include "focus/focus_model.h"
#include "kernels/cpu/ops.h"
#include "model/model.h"
#include "test_util.h"

using namespace focus;
using focus::test::book;
using focus::test::stories;
using focus::test::tok512;

namespace {

std::string bench(const std::string& rel = "") { return test::data_path("bench/" + rel); }

// A file in a fresh temp folder, removed with the object.
struct TempFile {
  std::string path;
  TempFile(const std::string& name, const std::string& text) {
    const auto dir = std::filesystem::temp_directory_path() /
                     ("focus_tasks_" + std::to_string(::getpid()) + "_" + std::to_string(counter()++));
    std::filesystem::create_directories(dir);
    path = (dir / name).string();
    std::ofstream(path, std::ios::binary) << text;
  }
  ~TempFile() { std::filesystem::remove_all(std::filesystem::path(path).parent_path()); }
  static int& counter() {
    static int c = 0;
    return c;
  }
};

using focus::test::error_of;

void expect_one_true(const TaskSet& t) {
  for (const auto& it : t.items) {
    ASSERT_EQ(it.labels.size(), it.choices.size());
    int n = 0;
    for (int l : it.labels) n += l;
    ASSERT_EQ(n, 1) << t.path << ":" << it.line;
  }
}

// Answer keys "A".."E" or "1".."5" -> 0-based index.
int key_index(const std::string& k) {
  if (k.size() == 1 && k[0] >= 'A' && k[0] <= 'E') return k[0] - 'A';
  if (k.size() == 1 && k[0] >= '1' && k[0] <= '5') return k[0] - '1';
  return -1;
}

std::map<std::string, int> answer_keys(const std::string& path) {
  std::map<std::string, int> keys;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line))
    if (!line.empty()) {
      auto j = nlohmann::json::parse(line);
      keys[j["id"].get<std::string>()] = key_index(j["answerKey"].get<std::string>());
    }
  return keys;
}

// Independent log-likelihood of `cont` after `ctx` (no trailing spaces in ctx): BOS + tokens of
// ctx + cont, the continuation = the tokens beyond encode(ctx); a plain forward() over all but the
// last token, compute_logits on every row, log_prob summed over the continuation rows. Inputs
// longer than the model's context keep BOS and their newest tokens.
struct Ref {
  double ll = 0;
  int64_t n_cont = 0;
  bool truncated = false;
};
Ref reference_ll(const Model& m, const std::string& ctx, const std::string& cont) {
  const auto ce = m.tok->encode(ctx, false);
  const auto we = m.tok->encode(ctx + cont, false);
  EXPECT_GT(we.size(), ce.size());
  EXPECT_TRUE(std::equal(ce.begin(), ce.end(), we.begin())) << "context tokens are not a prefix: " << ctx;
  std::vector<int32_t> full = {m.tok->bos()};
  full.insert(full.end(), we.begin(), we.end());
  Ref r;
  r.n_cont = (int64_t)(we.size() - ce.size());
  std::vector<int32_t> in(full.begin(), full.end() - 1);
  if ((int64_t)in.size() > m.cfg.max_ctx) {
    std::vector<int32_t> cut = {in[0]};
    cut.insert(cut.end(), in.end() - (m.cfg.max_ctx - 1), in.end());
    in = cut;
    r.truncated = true;
  }
  const int64_t T = (int64_t)in.size(), V = m.cfg.vocab;
  KVCache cache;
  cache.init(m.cfg, T);
  std::vector<float> hidden(T * m.cfg.dim), logits(T * V);
  forward(m, in.data(), T, cache, hidden.data());
  compute_logits(m, hidden.data(), T, logits.data());
  for (int64_t k = 0; k < r.n_cont; ++k)
    r.ll += cpu::log_prob(logits.data() + (T - r.n_cont + k) * V, V, full[full.size() - r.n_cont + k]);
  return r;
}

TaskSet head(const TaskSet& t, size_t n) {
  TaskSet h = t;
  h.items.resize(std::min(n, h.items.size()));
  return h;
}

// score_task on t agrees with the independent computation for every item and choice, and its
// acc / acc_norm / mc2 follow from the independent log-likelihoods.
void expect_scores_match(const Model& m, const TaskSet& t) {
  const TaskResult r = score_task(m, t, nullptr, 0, false);
  ASSERT_EQ(r.count, (int64_t)t.items.size());
  ASSERT_EQ(r.items.size(), t.items.size());
  EXPECT_FALSE(r.interrupted);
  double hits = 0, hits_norm = 0, mass = 0;
  int64_t requests = 0;
  for (size_t i = 0; i < t.items.size(); ++i) {
    const TaskItem& it = t.items[i];
    ASSERT_EQ(r.items[i].ll.size(), it.choices.size());
    std::vector<double> ref;
    for (size_t c = 0; c < it.choices.size(); ++c) {
      const Ref x = reference_ll(m, it.context_of(c), t.delimiter + it.choices[c]);
      EXPECT_NEAR(r.items[i].ll[c], x.ll, 1e-4 * std::max(1.0, std::fabs(x.ll)))
          << t.name << " item " << i << " choice " << c;
      EXPECT_LT(x.ll, 0);
      ref.push_back(x.ll);
      requests++;
    }
    int pred = 0, pred_norm = 0;
    double mx = ref[0];
    for (size_t c = 1; c < ref.size(); ++c) {
      if (ref[c] > ref[pred]) pred = (int)c;
      if (ref[c] / it.choices[c].size() > ref[pred_norm] / it.choices[pred_norm].size()) pred_norm = (int)c;
      mx = std::max(mx, ref[c]);
    }
    EXPECT_EQ(r.items[i].pred, pred) << t.name << " item " << i;
    EXPECT_EQ(r.items[i].pred_norm, pred_norm) << t.name << " item " << i;
    double num = 0, den = 0;
    for (size_t c = 0; c < ref.size(); ++c) {
      den += std::exp(ref[c] - mx);
      if (it.labels[c]) num += std::exp(ref[c] - mx);
    }
    EXPECT_NEAR(r.items[i].mc2, num / den, 1e-4);  // the lls agree to ~1e-5
    hits += it.labels[pred];
    hits_norm += it.labels[pred_norm];
    mass += num / den;
  }
  const double n = (double)t.items.size();
  EXPECT_DOUBLE_EQ(r.acc, hits / n) << t.name;
  EXPECT_DOUBLE_EQ(r.acc_norm, hits_norm / n) << t.name;
  EXPECT_NEAR(r.mc2, mass / n, 1e-4) << t.name;
  EXPECT_EQ(r.requests, requests);
  EXPECT_GT(r.tokens, 0);
  EXPECT_GE(r.seconds, 0);
}

}  // namespace

// ---- Loaders on the real files ----

TEST(TasksLoad, ListsEveryTaskUnderTheBenchDir) {
  FOCUS_NEED_FILE(bench("MANIFEST.md"));
  const auto tasks = list_tasks(bench());
  std::vector<std::string> names;
  for (const auto& t : tasks) names.push_back(t.name);
  for (const char* want : {"hellaswag", "truthfulqa_mc1", "truthfulqa_mc2", "arc_easy", "arc_challenge",
                           "openbookqa", "winogrande", "boolq"})
    EXPECT_NE(std::find(names.begin(), names.end(), want), names.end()) << want;
  EXPECT_EQ(tasks.size(), known_tasks().size());
  EXPECT_TRUE(list_tasks("/nonexistent/bench").empty());
  EXPECT_NE(error_of([] { load_task("no_such_task", bench()); }).find("unknown task"), std::string::npos);
  EXPECT_NE(error_of([] { load_task("hellaswag", "/nonexistent/bench"); }).find("/nonexistent/bench"),
            std::string::npos);
}

TEST(TasksLoad, HellaSwagValidation) {
  FOCUS_NEED_FILE(bench("hellaswag/hellaswag_val_full.txt"));
  const TaskSet t = load_task("hellaswag", bench());
  ASSERT_EQ(t.items.size(), 10042u);  // MANIFEST: 10042 tasks (60252 lines)
  EXPECT_EQ(t.metric, TaskMetric::Accuracy);
  expect_one_true(t);
  for (const auto& it : t.items) ASSERT_EQ(it.choices.size(), 4u);
  EXPECT_EQ(t.items[0].context, "Roof shingle removal: A man is sitting on a roof. he");
  EXPECT_EQ(t.items[0].gold(), 3);
  EXPECT_EQ(t.items[0].choices[3], "starts pulling up roofing on a roof.");
  EXPECT_EQ(t.items[1].line, 7);
  EXPECT_EQ(t.items.back().line, 60252 - 5);
}

TEST(TasksLoad, TruthfulQAMC1AndMC2) {
  FOCUS_NEED_FILE(bench("truthfulqa/mc_task.json"));
  const TaskSet mc1 = load_task("truthfulqa_mc1", bench());
  const TaskSet mc2 = load_task("truthfulqa_mc2", bench());
  ASSERT_EQ(mc1.items.size(), 817u);  // MANIFEST: 817 questions
  ASSERT_EQ(mc2.items.size(), 817u);
  EXPECT_EQ(mc1.metric, TaskMetric::Accuracy);
  EXPECT_EQ(mc2.metric, TaskMetric::MC2);
  expect_one_true(mc1);
  size_t max1 = 0, max2 = 0, min1 = 99, min2 = 99;
  for (const auto& it : mc1.items) max1 = std::max(max1, it.choices.size()), min1 = std::min(min1, it.choices.size());
  for (const auto& it : mc2.items) {
    max2 = std::max(max2, it.choices.size()), min2 = std::min(min2, it.choices.size());
    EXPECT_GE(it.gold(), 0);
  }
  EXPECT_EQ(min1, 2u);  // MANIFEST: 2-13 choices (mc1), 2-24 answers (mc2)
  EXPECT_EQ(max1, 13u);
  EXPECT_GE(min2, 2u);
  EXPECT_EQ(max2, 24u);
  // The file's answer order is kept (the true MC1 answer is listed first in every question).
  const TaskItem& q0 = mc2.items[0];
  ASSERT_EQ(q0.choices.size(), 6u);
  EXPECT_EQ(q0.choices[0], "Nothing in particular happens when you eat a pomegranate.");
  EXPECT_EQ(q0.choices[5], "You will die.");
  EXPECT_EQ(q0.labels, (std::vector<int>{1, 1, 1, 0, 0, 0}));
  for (const auto& it : mc1.items) EXPECT_EQ(it.gold(), 0);
  const std::string tail = "\n\nQ: What happens if you eat a pomegranate?\nA:";
  EXPECT_EQ(q0.context, truthfulqa_qa_prompt() + tail);
  EXPECT_EQ(truthfulqa_qa_prompt().rfind("Q: What is human life expectancy", 0), 0u);
}

TEST(TasksLoad, ArcGoldsAgreeWithTheOfficialAnswerKeys) {
  for (const char* f : {"llm-foundry/derived/arc_easy.fixed.jsonl", "llm-foundry/derived/arc_challenge.fixed.jsonl",
                        "arc/ARC-Easy-Test.question-answers.jsonl", "arc/ARC-Challenge-Test.question-answers.jsonl"})
    FOCUS_NEED_FILE(bench(f));
  for (auto [name, file, keys_file, count] :
       {std::tuple<const char*, const char*, const char*, size_t>{"arc_easy", "llm-foundry/derived/arc_easy.fixed.jsonl",
                                                                  "arc/ARC-Easy-Test.question-answers.jsonl", 2368},
        {"arc_challenge", "llm-foundry/derived/arc_challenge.fixed.jsonl",
         "arc/ARC-Challenge-Test.question-answers.jsonl", 1168}}) {
    const TaskSet t = load_task(name, bench());
    ASSERT_EQ(t.items.size(), count) << name;  // MANIFEST: 2368 / 1168 after dropping garbled items
    expect_one_true(t);
    const auto keys = answer_keys(bench(keys_file));
    std::ifstream f(bench(file));
    std::string line;
    size_t i = 0;
    while (std::getline(f, line)) {
      const std::string id = nlohmann::json::parse(line)["id"].get<std::string>();
      ASSERT_TRUE(keys.count(id)) << id;
      EXPECT_EQ(t.items[i].gold(), keys.at(id)) << name << " " << id;
      EXPECT_EQ(t.items[i].choices.size(), 4u);
      EXPECT_EQ(t.items[i].context.rfind("Question: ", 0), 0u);
      EXPECT_EQ(t.items[i].context.substr(t.items[i].context.size() - 8), "\nAnswer:");
      ++i;
    }
    EXPECT_EQ(i, count);
  }
}

TEST(TasksLoad, OpenBookQAWinoGrandeBoolQ) {
  for (const char* f : {"llm-foundry/openbook_qa.jsonl", "llm-foundry/winogrande.jsonl", "llm-foundry/boolq.jsonl",
                        "winogrande/dev-labels.lst", "openbookqa/OpenBookQA-Main-Test.question-answers.jsonl"})
    FOCUS_NEED_FILE(bench(f));
  const TaskSet obqa = load_task("openbookqa", bench());
  ASSERT_EQ(obqa.items.size(), 500u);
  expect_one_true(obqa);
  {  // Golds against the AI2 answer keys, in file order (MANIFEST: 500/500).
    std::ifstream f(bench("openbookqa/OpenBookQA-Main-Test.question-answers.jsonl"));
    std::string line;
    size_t i = 0;
    while (std::getline(f, line) && i < obqa.items.size())
      EXPECT_EQ(obqa.items[i++].gold(), key_index(nlohmann::json::parse(line)["answerKey"].get<std::string>()))
          << "openbookqa item " << i;
  }
  const TaskSet wg = load_task("winogrande", bench());
  ASSERT_EQ(wg.items.size(), 1267u);
  expect_one_true(wg);
  {  // Golds against dev-labels.lst (1/2 per line).
    std::ifstream f(bench("winogrande/dev-labels.lst"));
    int label = 0;
    size_t i = 0;
    while (f >> label && i < wg.items.size()) EXPECT_EQ(wg.items[i++].gold(), label - 1) << "winogrande item " << i;
    EXPECT_EQ(i, 1267u);
  }
  EXPECT_EQ(wg.items[0].contexts.size(), 2u);
  EXPECT_EQ(wg.items[0].context_of(1), "Sarah was a much better surgeon than Maria so Maria");
  EXPECT_EQ(wg.items[0].choices[0], "always got the easier cases.");
  const TaskSet bq = load_task("boolq", bench());
  ASSERT_EQ(bq.items.size(), 3270u);
  expect_one_true(bq);
  int yes = 0;
  for (const auto& it : bq.items) yes += it.gold() == 1;
  EXPECT_EQ(yes, 2033);  // MANIFEST: 2033 yes, 1237 no
}

// ---- Errors name the file and the line ----

TEST(TasksLoad, MalformedJsonlLinesNameFileAndLine) {
  const std::string good = R"({"query": "Q", "choices": ["a", "b"], "gold": 1})";
  struct Case {
    std::string line3, want;
  } cases[] = {
      {R"({"query": "Q", "choices": ["a", "b"], "gold": 1)", "malformed JSON"},
      {R"({"choices": ["a", "b"], "gold": 0})", "missing field \"query\""},
      {R"({"query": "Q", "choices": ["a", "b"], "gold": 2})", "out of range"},
      {R"({"query": "Q", "choices": ["a", 3], "gold": 0})", "must hold strings"},
      {R"({"query": "Q", "choices": ["a", "b"], "gold": "1"})", "must be an integer"},
      {R"(["not", "an", "object"])", "expected a JSON object"},
  };
  for (const auto& c : cases) {
    TempFile f("bad.jsonl", good + "\n\n" + c.line3 + "\n" + good + "\n");
    const std::string e = error_of([&] { load_query_choices_jsonl(f.path, "t"); });
    EXPECT_NE(e.find(f.path + ":3:"), std::string::npos) << e;
    EXPECT_NE(e.find(c.want), std::string::npos) << e;
  }
  {
    TempFile f("ok.jsonl", good + "\r\n" + good + "\r\n");  // CRLF is fine
    EXPECT_EQ(load_query_choices_jsonl(f.path, "t", "\nAnswer:").items.size(), 2u);
  }
  {
    TempFile f("wg.jsonl", R"({"context_options": ["a b"], "continuation": "c", "gold": 0})"
                           "\n");
    const std::string e = error_of([&] { load_winogrande_jsonl(f.path); });
    EXPECT_NE(e.find(f.path + ":1:"), std::string::npos) << e;
  }
  {
    TempFile f("wg.jsonl", R"({"context_options": ["a", "b"], "continuation": "c", "gold": 0})"
                           "\n{\"context_options\": [\"a\", \"b\"], \"gold\": 0}\n");
    const std::string e = error_of([&] { load_winogrande_jsonl(f.path); });
    EXPECT_NE(e.find(f.path + ":2: missing field \"continuation\""), std::string::npos) << e;
  }
  {
    TempFile f("empty.jsonl", "\n\n");
    EXPECT_NE(error_of([&] { load_query_choices_jsonl(f.path, "t"); }).find("no items"), std::string::npos);
  }
  const std::string missing = "/nonexistent/dir/file.jsonl";
  EXPECT_NE(error_of([&] { load_query_choices_jsonl(missing, "t"); }).find(missing + ": cannot open"),
            std::string::npos);
}

TEST(TasksLoad, MalformedHellaSwagAndTruthfulQANameFileAndLine) {
  const std::string task = "ctx\n1\ne0\ne1\ne2\ne3\n";
  {
    TempFile f("hs.txt", task + "ctx\n4\ne0\ne1\ne2\ne3\n");
    const std::string e = error_of([&] { load_hellaswag_txt(f.path); });
    EXPECT_NE(e.find(f.path + ":8: gold label must be 0-3"), std::string::npos) << e;
  }
  {
    TempFile f("hs.txt", task + "ctx\n2\ne0\n");
    const std::string e = error_of([&] { load_hellaswag_txt(f.path); });
    EXPECT_NE(e.find(f.path + ":9: incomplete task"), std::string::npos) << e;
  }
  {
    TempFile f("hs.txt", task + task);
    const TaskSet t = load_hellaswag_txt(f.path);
    ASSERT_EQ(t.items.size(), 2u);
    EXPECT_EQ(t.items[1].gold(), 1);
    EXPECT_EQ(t.items[1].line, 7);
  }
  {
    TempFile f("mc.json", "[\n  {\"question\": \"q\",\n   \"mc1_targets\": {\"a\": 1, \"b\": 0,}\n  }\n]\n");
    const std::string e = error_of([&] { load_truthfulqa_mc(f.path, 1); });
    EXPECT_NE(e.find(f.path + ":3:"), std::string::npos) << e;
  }
  {
    TempFile f("mc.json", R"([{"question": "q", "mc1_targets": {"a": 1, "b": 1}, "mc2_targets": {"a": 1}}])");
    const std::string e = error_of([&] { load_truthfulqa_mc(f.path, 1); });
    EXPECT_NE(e.find(f.path + ": question 1: mc1_targets must have exactly one true answer"), std::string::npos)
        << e;
    EXPECT_EQ(load_truthfulqa_mc(f.path, 2).items.size(), 1u);
  }
}

// ---- Scoring on stories260K ----

TEST(TasksScore, ChoiceTokensSplitContextAndContinuation) {
  FOCUS_NEED_FILE(stories());
  FOCUS_NEED_FILE(tok512());
  auto m = load_model(stories(), LoadOptions{tok512()});
  const int32_t bos = m->tok->bos();
  ASSERT_GE(bos, 0);
  const ChoiceTokens a = tokenize_choice(*m, "Once upon a time", " there was a cat.");
  const auto whole = m->tok->encode("Once upon a time there was a cat.", false);
  const auto ctx = m->tok->encode("Once upon a time", false);
  ASSERT_EQ(a.ids.size(), whole.size());  // BOS + whole - last
  EXPECT_EQ(a.ids[0], bos);
  EXPECT_EQ(a.n_cont, (int64_t)(whole.size() - ctx.size()));
  EXPECT_FALSE(a.truncated);
  int64_t scored = 0;
  for (size_t t = 0; t < a.ids.size(); ++t) {
    if (t > 0) {
      EXPECT_EQ(a.ids[t], whole[t - 1]);
    }
    if (a.targets[t] >= 0) {
      EXPECT_EQ(a.targets[t], whole[t]);
      EXPECT_GE((int64_t)t, (int64_t)ctx.size());
      ++scored;
    }
  }
  EXPECT_EQ(scored, a.n_cont);
  // A trailing space of the context moves to the continuation.
  const ChoiceTokens b = tokenize_choice(*m, "Once upon a time ", "there was a cat.");
  EXPECT_EQ(b.ids, a.ids);
  EXPECT_EQ(b.targets, a.targets);
}

TEST(TasksScore, RealTasksMatchAnIndependentForward) {
  FOCUS_NEED_FILE(stories());
  FOCUS_NEED_FILE(tok512());
  FOCUS_NEED_FILE(bench("MANIFEST.md"));
  auto m = load_model(stories(), LoadOptions{tok512()});
  for (const auto& info : list_tasks(bench())) {
    // A handful of items each (TruthfulQA and BoolQ inputs are a few hundred tokens).
    const bool long_inputs = info.name.rfind("truthfulqa", 0) == 0 || info.name == "boolq";
    const TaskSet t = head(load_task(info.name, bench()), long_inputs ? 2 : 3);
    SCOPED_TRACE(info.name);
    expect_scores_match(*m, t);
  }
}

TEST(TasksScore, LimitAndTruncation) {
  FOCUS_NEED_FILE(stories());
  FOCUS_NEED_FILE(tok512());
  auto m = load_model(stories(), LoadOptions{tok512()});
  ASSERT_GT(m->cfg.max_ctx, 0);
  TaskSet t;
  t.name = "synthetic";
  t.metric = TaskMetric::MC2;
  std::string story;
  while ((int64_t)m->tok->encode(story, false).size() < m->cfg.max_ctx + 40)
    story += "Lily went to the park with her mom. They saw a big dog. ";
  story.pop_back();
  t.items.push_back({story, {}, {"The dog was happy.", "The sky was green.", "Lily ran home."}, {1, 0, 1}, 1});
  t.items.push_back({"Tom had a red ball.", {}, {"He liked to play with it.", "It was a car."}, {1, 0}, 2});
  t.items.push_back({"The cat sat on the mat.", {}, {"It was warm.", "It was a fish."}, {1, 0}, 3});
  const TaskResult r = score_task(*m, t, nullptr, 2, false);
  EXPECT_EQ(r.count, 2);
  EXPECT_EQ(r.requests, 5);
  EXPECT_EQ(r.truncated, 3);  // every choice of the long item
  const Ref x = reference_ll(*m, story, " The dog was happy.");
  EXPECT_TRUE(x.truncated);
  EXPECT_NEAR(r.items[0].ll[0], x.ll, 1e-4 * std::max(1.0, std::fabs(x.ll)));
  expect_scores_match(*m, t);  // all three items, the long one truncated
  const ChoiceTokens ct = tokenize_choice(*m, story, " Lily ran home.");
  EXPECT_EQ((int64_t)ct.ids.size(), m->cfg.max_ctx);
  EXPECT_EQ(ct.ids[0], m->tok->bos());
  EXPECT_TRUE(ct.truncated);
  nlohmann::json j = task_result_json(r);
  EXPECT_EQ(j["task"], "synthetic");
  EXPECT_EQ(j["metric"], "mc2");
  EXPECT_EQ(j["count"], 2);
  EXPECT_TRUE(j.contains("mc2"));
}

TEST(TasksScore, FocusRoutersAreUsed) {
  FOCUS_NEED_FILE(stories());
  FOCUS_NEED_FILE(tok512());
  auto m = load_model(stories(), LoadOptions{tok512()});
  std::string ctx;
  for (int i = 0; i < 6; ++i) ctx += "Lily went to the park with her mom and they saw a big dog there. ";
  ctx.pop_back();
  const std::string cont = " The dog was happy.";
  const ChoiceScore plain = score_choice(*m, ctx, cont);
  FocusSettings s;
  s.mode = FocusMode::Hard;
  s.groups = 4;
  s.tau = 0.5f;
  s.local_window = 4096;  // longer than the input: the plain kernel runs, bit for bit
  FocusRouters wide = focus_init(m->cfg, s, 42);
  const AttentionPlan wide_plan = focus_plan(m->cfg, wide);
  EXPECT_EQ(score_choice(*m, ctx, cont, &wide_plan).ll, plain.ll);
  s.local_window = 8;
  FocusRouters narrow = focus_init(m->cfg, s, 42);
  const AttentionPlan narrow_plan = focus_plan(m->cfg, narrow);
  const ChoiceScore sparse = score_choice(*m, ctx, cont, &narrow_plan);
  EXPECT_TRUE(std::isfinite(sparse.ll));
  EXPECT_NE(sparse.ll, plain.ll);
  EXPECT_EQ(sparse.tokens, plain.tokens);
}

TEST(TasksScore, PrefixReuseEqualsFreshForwards) {
  FOCUS_NEED_FILE(stories());
  FOCUS_NEED_FILE(tok512());
  auto m = load_model(stories(), LoadOptions{tok512()});
  // Requests that share a long prefix, one that shares nothing, then the first one again.
  const std::string ctx = "Once upon a time, there was a little girl named Lily. She loved to play";
  const std::vector<std::string> conts = {" outside in the park.", " with her dog.", " outside with her friends."};
  std::vector<ChoiceTokens> reqs;
  for (const auto& c : conts) reqs.push_back(tokenize_choice(*m, ctx, c));
  reqs.push_back(tokenize_choice(*m, "Tom had a red ball.", " He threw it far."));
  reqs.push_back(reqs[0]);
  PrefixScorer scorer(*m, nullptr);
  int64_t total = 0;
  for (const auto& r : reqs) {
    int64_t s1 = 0, s2 = 0;
    const double a = scorer.nll(r.ids, r.targets, &s1);
    const double b = window_nll(*m, r.ids, r.targets, nullptr, nullptr, &s2);
    EXPECT_EQ(s1, s2);
    EXPECT_NEAR(a, b, 1e-5 * std::max(1.0, std::fabs(b)));
    total += (int64_t)r.ids.size();
  }
  EXPECT_EQ(scorer.reused_tokens() + scorer.computed_tokens(), total);
  EXPECT_GT(scorer.reused_tokens(), 30);  // the shared context ran once, not three times
  // With Focus routers (window 4, so the pattern matters) the cache keeps the prefix's routing and
  // the reused prefix gives the numbers of a fresh run, in soft and hard mode.
  for (FocusMode mode : {FocusMode::Soft, FocusMode::Hard}) {
    FocusSettings fs;
    fs.local_window = 4;
    fs.mode = mode;
    const FocusRouters f = focus_init(m->cfg, fs, 3);
    const AttentionPlan plan = focus_plan(m->cfg, f);
    PrefixScorer fscorer(*m, &plan);
    for (const auto& r : reqs) {
      int64_t s = 0;
      const double b = window_nll(*m, r.ids, r.targets, &plan, nullptr, nullptr);
      EXPECT_NEAR(fscorer.nll(r.ids, r.targets, &s), b, 1e-5 * std::max(1.0, std::fabs(b))) << to_string(mode);
    }
    EXPECT_EQ(fscorer.reused_tokens(), scorer.reused_tokens()) << to_string(mode);
  }
}
