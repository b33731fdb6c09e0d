// The focus command itself (FOCUS_BIN): flags that shape routers are errors without --focus
// (they used to be ignored), generate prints what the library generates, bad -n is refused.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "core/mapped_file.h"
#include "focus/focus_model.h"
#include "model/generate.h"
#include "model/model.h"
#include "test_models.h"
#include "test_util.h"

using focus::test::book;
using focus::test::stories;
using focus::test::tok512;

namespace {

using CliRun = focus::test::BinRun;
CliRun run(const std::string& args, const std::string& tag = "") { return focus::test::run_focus("-t 1 " + args, tag); }

std::string model_args() { return "--model " + stories() + " --tokenizer " + tok512(); }
std::string text() { return book("pg-345-dracula.txt"); }


}  // namespace

TEST(Cli, RouterFlagsWithoutFocusAreErrorsNamingTheFlag) {
  FOCUS_NEED_FILE(stories());
  const std::vector<std::string> flags = {"--sinks 2", "--groups 4", "--dg 8",      "--tau 0.5",
                                          "--topk 1",  "--mode hard", "--window 32", "--router-seed 3",
                                          "--block-select-every 4"};
  const std::vector<std::string> commands = {
      "eval " + model_args() + " --text " + text() + " --ctx 64 --max-tokens 128",
      "generate " + model_args() + " -p Once -n 2",
      "bench-tasks " + model_args() + " --bench-dir " + ::testing::TempDir() + " --limit 1",
  };
  int i = 0;
  for (const auto& c : commands) {
    for (const auto& f : flags) {
      const CliRun r = run(c + " " + f, std::to_string(i++));
      const std::string flag = f.substr(0, f.find(' '));
      EXPECT_EQ(r.code, 1) << c << " " << f;
      EXPECT_NE(r.err.find("error: " + flag + " needs --focus DIR (or --focus random)"), std::string::npos)
          << c << " " << f << "\n" << r.err;
    }
  }
}

TEST(Cli, RandomRouterFlagsWithARouterFolderAreErrors) {
  FOCUS_NEED_FILE(stories());
  int i = 0;
  for (const std::string f : {"--groups 4", "--dg 8", "--tau 0.5", "--router-seed 3"}) {
    const CliRun r = run("eval " + model_args() + " --text " + text() + " --focus some/routers " + f, std::to_string(i++));
    const std::string flag = f.substr(0, f.find(' '));
    EXPECT_EQ(r.code, 1) << f;
    EXPECT_NE(r.err.find("error: " + flag + " applies only to --focus random (the routers in some/routers fix it)"),
              std::string::npos)
        << f << "\n" << r.err;
  }
}

TEST(Cli, RouterFlagsWithRandomRoutersStillWork) {
  FOCUS_NEED_FILE(stories());
  const CliRun r = run("eval " + model_args() + " --text " + text() +
                    " --ctx 64 --max-tokens 128 --focus random --mode hard --sinks 2 --window 16 --groups 4 --dg 8 "
                    "--tau 0.5 --topk 1 --router-seed 3 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("\"focus\":\"hard (window 16, sinks 2, groups 4, d_g 8, top-1,"), std::string::npos) << r.out;
}

// A router folder with per-head block budgets: giving its own window and sinks again is fine, a
// window of another size is refused (the budgets were measured at the folder's).
TEST(Cli, RouterFolderWithBlockBudgetsTakesItsOwnWindow) {
  FOCUS_NEED_FILE(stories());
  auto m = focus::load_model(stories(), focus::LoadOptions{tok512()});
  focus::FocusRouters f = focus::focus_init(m->cfg, focus::test::asym_settings(4, 1, 16), 3);
  std::vector<std::vector<int64_t>> k(m->cfg.layers, std::vector<int64_t>(m->cfg.heads, 2));
  f.settings.block_size = 4;
  focus::set_block_budget(f, m->cfg, k, "test");
  const std::string dir = ::testing::TempDir() + "/focus_cli_budget_routers";
  focus::save_focus(f, dir, m->cfg, "test");
  const std::string eval = "eval " + model_args() + " --text " + text() + " --ctx 64 --max-tokens 128 --focus " + dir;
  const CliRun same = run(eval + " --window 16 --sinks 1 --json", "same");
  EXPECT_EQ(same.code, 0) << same.err;
  const CliRun other = run(eval + " --window 8", "other");
  EXPECT_EQ(other.code, 1);
  EXPECT_NE(other.err.find("holds per-head block budgets measured with its window and sinks"), std::string::npos)
      << other.err;
  // The blocks chosen once every 4 rows: said in the pattern's description; 0 rows, a negative count
  // and more than 2^20 rows are refused, naming the flag.
  const CliRun tiled = run(eval + " --mode hard --block-select-every 4 --json", "tiled");
  EXPECT_EQ(tiled.code, 0) << tiled.err;
  EXPECT_NE(tiled.out.find("of 4, chosen every 4 rows"), std::string::npos) << tiled.out;
  for (const char* bad : {"0", "-5", "2000000"}) {
    const CliRun r = run(eval + " --mode hard --block-select-every " + bad, "bad");
    EXPECT_NE(r.code, 0) << bad;
    EXPECT_NE(r.err.find("--block-select-every"), std::string::npos) << bad << ": " << r.err;
  }
}

TEST(Cli, GeneratePrintsTheLibrarysTokens) {
  FOCUS_NEED_FILE(stories());
  const CliRun r = run("generate " + model_args() + " -p 'Once upon a time' -n 12 --temp 0.8 --seed 7 --ids");
  ASSERT_EQ(r.code, 0) << r.err;
  const size_t at = r.out.find("ids: ");
  ASSERT_NE(at, std::string::npos) << r.out;
  std::istringstream is(r.out.substr(at + 5));
  std::vector<int32_t> printed;
  for (int32_t t; is >> t;) printed.push_back(t);

  auto m = focus::load_model(stories());
  focus::GenerateOptions o;
  o.max_new_tokens = 12;
  o.temperature = 0.8f;
  o.seed = 7;
  const focus::GenerateResult g = focus::generate(*m, focus::encode_prompt(*m, "Once upon a time"), o);
  EXPECT_EQ(printed, g.tokens);
  std::string text;
  for (size_t i = g.prompt_tokens; i < g.tokens.size(); ++i) text += m->tok->piece(g.tokens[i], g.tokens[i - 1]);
  EXPECT_EQ(r.out.substr(0, at), "Once upon a time" + text + "\n");
}

TEST(Cli, GenerateRefusesANegativeCountOrTemperature) {
  FOCUS_NEED_FILE(stories());
  CliRun r = run("generate " + model_args() + " -p Once -n -3", "n");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("-n"), std::string::npos) << r.err;
  r = run("generate " + model_args() + " -p Once --temp -1", "temp");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("--temp"), std::string::npos) << r.err;
}

// bench model --against-dense: every test row also times the dense model, one ratio per pair of
// repetitions, the median reported; without an attention to compare it is an error.
TEST(Cli, BenchModelAgainstDenseReportsEachPair) {
  FOCUS_NEED_FILE(stories());
  const std::string bench = "bench model " + model_args() + " --prefill 48 --depth 40 --gen 3 --reps 3";
  const CliRun r = run(bench + " --focus random --mode hard --window 8 --groups 4 --against-dense --json", "pair");
  ASSERT_EQ(r.code, 0) << r.err;
  std::string out = r.out;
  while (!out.empty() && out.back() == '\n') out.pop_back();
  const std::string last = out.substr(out.rfind('\n') + 1);  // the JSON line
  const nlohmann::json j = nlohmann::json::parse(last);
  EXPECT_TRUE(j.at("against_dense").get<bool>());
  ASSERT_EQ(j.at("results").size(), 2u) << last;
  for (const auto& row : j.at("results")) {
    std::vector<double> each = row.at("speedup_each").get<std::vector<double>>();
    ASSERT_EQ(each.size(), 3u) << row.dump();
    for (double x : each) EXPECT_GT(x, 0.0) << row.dump();
    std::sort(each.begin(), each.end());
    EXPECT_DOUBLE_EQ(row.at("speedup").get<double>(), each[1]) << row.dump();
    EXPECT_GT(row.at("dense_tok_per_s").get<double>(), 0.0) << row.dump();
    EXPECT_GT(row.at("tok_per_s").get<double>(), 0.0) << row.dump();
  }
  EXPECT_NE(r.out.find("speedup"), std::string::npos) << r.out;

  const CliRun alone = run(bench + " --against-dense", "alone");
  EXPECT_EQ(alone.code, 1);
  EXPECT_NE(alone.err.find("--against-dense needs an attention to compare"), std::string::npos) << alone.err;
}

// `focus budget --group-switch` end to end: calibrated around a router folder's groups it writes
// budgets with a switch per head, `focus eval` runs them and says how many heads read their groups;
// the switch without routers, and the weight without the switch, are refused.
// `focus budget --metric output` through the binary: around a hybrid's groups with the switch, the
// budget file and the JSON line say the metric, the budgets run in `focus eval`, and the curves
// keep it (budgets made from them say it too; --metric does not apply to curves already measured).
TEST(Cli, BudgetOutputMetricRunsThroughEval) {
  FOCUS_NEED_FILE(stories());
  auto m = focus::load_model(stories(), focus::LoadOptions{tok512()});
  const std::string dir = ::testing::TempDir() + "/focus_cli_output_routers";
  focus::save_focus(focus::focus_init(m->cfg, focus::test::asym_settings(4, 1, 8), 6), dir, m->cfg, "test");
  const std::string out = ::testing::TempDir() + "/focus_cli_output_budget.json",
                    curves = ::testing::TempDir() + "/focus_cli_output_curves.safetensors";
  const std::string budget = "budget " + model_args() + " --text " + text() +
                             " --ctx 64 --max-tokens 252 --block-size 4 --window 8 --max-k 8 --near-max 2 --mean-k 3";
  const CliRun made = run(budget + " --focus " + dir + " --group-switch --metric output --curves " + curves +
                              " --out " + out + " --json",
                          "made");
  ASSERT_EQ(made.code, 0) << made.err;
  EXPECT_NE(made.out.find("output error"), std::string::npos) << made.out;
  const nlohmann::json j = nlohmann::json::parse(made.out.substr(made.out.rfind("\n{") + 1));
  EXPECT_EQ(j.at("metric").get<std::string>(), "output");
  EXPECT_EQ(nlohmann::json::parse(focus::read_file(out)).at("metric").get<std::string>(), "output");
  const CliRun ev = run("eval " + model_args() + " --text " + text() + " --ctx 64 --max-tokens 128 --focus " + dir +
                            " --mode hard --block-budget " + out + " --json",
                        "eval");
  ASSERT_EQ(ev.code, 0) << ev.err;
  const std::string again = ::testing::TempDir() + "/focus_cli_output_again.json";
  const CliRun from = run("budget --from-curves " + curves + " --group-switch --mean-k 2 --out " + again, "from");
  ASSERT_EQ(from.code, 0) << from.err;
  EXPECT_EQ(nlohmann::json::parse(focus::read_file(again)).at("metric").get<std::string>(), "output");
  const CliRun redo = run("budget --from-curves " + curves + " --metric mass --mean-k 2 --out " + again, "redo");
  EXPECT_EQ(redo.code, 1);
  EXPECT_NE(redo.err.find("--metric does not apply with --from-curves"), std::string::npos) << redo.err;
  const CliRun bad = run(budget + " --metric entropy --out " + out, "bad");
  EXPECT_EQ(bad.code, 1);
  EXPECT_NE(bad.err.find("unknown block metric 'entropy'"), std::string::npos) << bad.err;
}

TEST(Cli, BudgetGroupSwitchRunsThroughEval) {
  FOCUS_NEED_FILE(stories());
  auto m = focus::load_model(stories(), focus::LoadOptions{tok512()});
  const std::string dir = ::testing::TempDir() + "/focus_cli_switch_routers";
  focus::save_focus(focus::focus_init(m->cfg, focus::test::asym_settings(4, 1, 8), 5), dir, m->cfg, "test");
  const std::string out = ::testing::TempDir() + "/focus_cli_switch_budget.json";
  const std::string budget = "budget " + model_args() + " --text " + text() +
                             " --ctx 64 --max-tokens 252 --block-size 4 --window 8 --max-k 8 --near-max 2 --mean-k 3 --out " +
                             out;
  const CliRun made = run(budget + " --focus " + dir + " --group-switch --group-weight 2 --json", "made");
  ASSERT_EQ(made.code, 0) << made.err;
  const nlohmann::json j = nlohmann::json::parse(made.out.substr(made.out.rfind("\n{") + 1));  // the JSON line
  EXPECT_EQ(j.at("group_weight").get<double>(), 2.0);
  EXPECT_EQ(j.at("heads").get<int64_t>(), m->cfg.layers * m->cfg.heads);
  const nlohmann::json file = nlohmann::json::parse(focus::read_file(out));
  ASSERT_TRUE(file.contains("group"));
  EXPECT_EQ((int64_t)file["group"].size(), m->cfg.layers);
  const CliRun ev = run("eval " + model_args() + " --text " + text() + " --ctx 64 --max-tokens 128 --focus " + dir +
                            " --mode hard --block-budget " + out + " --json",
                        "eval");
  ASSERT_EQ(ev.code, 0) << ev.err;
  EXPECT_NE(ev.out.find(", groups read by " + std::to_string(j.at("heads_with_groups").get<int64_t>()) + " of " +
                        std::to_string(m->cfg.layers * m->cfg.heads) + " heads"),
            std::string::npos)
      << ev.out;
  // The switch budget is for the routers' evaluation: block top-k alone and training refuse it.
  const CliRun btk = run("eval " + model_args() + " --text " + text() +
                             " --ctx 64 --max-tokens 128 --attention blocktopk:budget=" + out,
                         "btk");
  EXPECT_EQ(btk.code, 1);
  EXPECT_NE(btk.err.find(out), std::string::npos) << btk.err;
  EXPECT_NE(btk.err.find("--group-switch"), std::string::npos) << btk.err;
  const CliRun alone = run(budget + " --group-switch", "alone");
  EXPECT_EQ(alone.code, 1);
  EXPECT_NE(alone.err.find("--group-switch chooses per head"), std::string::npos) << alone.err;
  const CliRun weight = run(budget + " --group-weight 2", "weight");
  EXPECT_EQ(weight.code, 1);
  EXPECT_NE(weight.err.find("--group-weight needs --group-switch"), std::string::npos) << weight.err;
}
