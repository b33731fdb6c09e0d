// Shared helpers for tests: where the data and the cached models are, and how to skip.
#pragma once
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/mapped_file.h"

namespace focus::test {

// Built with AddressSanitizer or ThreadSanitizer, where the code runs 10-30x slower: the slowest
// tests (whole real models, long references, long resumes) check smaller shapes there (small_shapes()
// below), so that CI runs every test sanitized. The plain build runs the full shapes.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif
#else
inline constexpr bool kSanitized = false;
#endif
// The smaller shapes: sanitized, or FOCUS_TEST_SMALL_SHAPES=1 (to check them in a plain build).
inline bool small_shapes() {
  static const bool small = kSanitized || [] {
    const char* e = std::getenv("FOCUS_TEST_SMALL_SHAPES");
    return e && std::string(e) == "1";
  }();
  return small;
}

// ../shared/data beside the checkout, or $FOCUS_DATA.
inline std::string data_dir() {
  if (const char* e = std::getenv("FOCUS_DATA")) return e;
  return std::string(FOCUS_SOURCE_DIR) + "/../shared/data";
}
inline std::string data_path(const std::string& rel) { return data_dir() + "/" + rel; }

// The real stories260K model, its tokenizer, and the texts of ../shared/data.
inline std::string stories() { return data_path("models/stories260K/stories260K.bin"); }
inline std::string tok512() { return data_path("models/stories260K/tok512.bin"); }
inline std::string book(const std::string& name) { return data_path("text/" + name); }

// The small stories260K training run the trainer tests share (retrofit and LoRA options alike):
// two books to train on, a third to validate, 24 steps of 3 windows of 192 tokens, output in
// `out` (emptied first). With the smaller shapes one book to train on (tokenizing the two was most
// of a sanitized run) and windows of 96 tokens.
template <class Options>
Options small_training_run(const std::string& out) {
  Options o;
  o.train = {book("pg-1661-the-adventures-of-sherlock-holmes.txt")};
  if (!small_shapes()) o.train.push_back(book("pg-345-dracula.txt"));
  o.valid = {book("pg-1342-pride-and-prejudice.txt")};
  o.ctx = small_shapes() ? 96 : 192;
  o.steps = 24;
  o.batch = 3;
  o.warmup = 3;
  o.eval_every = 0;
  o.valid_windows = 6;
  o.out = out;
  o.progress = false;
  std::filesystem::remove_all(out);
  return o;
}

// Cached models ($FOCUS_CACHE/models, default ~/.cache/focus/models).
inline std::string model_cache() {
  if (const char* e = std::getenv("FOCUS_CACHE")) return std::string(e) + "/models";
  const char* home = std::getenv("HOME");
  return std::string(home ? home : ".") + "/.cache/focus/models";
}
inline std::string smollm2_path() { return model_cache() + "/SmolLM2-135M-Instruct.Q4_1.gguf"; }
inline std::string gemma3_path() { return model_cache() + "/gemma-3-270m-q4_k_m.gguf"; }

// With FOCUS_REQUIRE_DATA=1 (set by CI) a missing input fails the test instead of skipping it.
inline bool require_data() {
  const char* e = std::getenv("FOCUS_REQUIRE_DATA");
  return e && std::string(e) == "1";
}

// The focus binary under test: $FOCUS_BIN (set by CTest), or build/focus of the checkout.
inline std::string focus_bin() {
  if (const char* e = std::getenv("FOCUS_BIN")) return e;
  return std::string(FOCUS_SOURCE_DIR) + "/build/focus";
}

struct BinRun {
  int code;              // exit status (128 + signal when killed)
  std::string out, err;  // what it printed
};

// Runs `focus ARGS`. Its output goes to files named after the running test (and `tag`), since
// CTest runs tests in parallel processes.
inline BinRun run_focus(const std::string& args, const std::string& tag = "") {
  const std::string base = ::testing::TempDir() + "/focus_run_" +
                           ::testing::UnitTest::GetInstance()->current_test_info()->name() + tag;
  const std::string cmd = focus_bin() + " " + args + " >" + base + ".out 2>" + base + ".err";
  const int st = std::system(cmd.c_str());
  return {WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st), focus::read_file(base + ".out"),
          focus::read_file(base + ".err")};
}

// Largest absolute difference relative to the largest reference magnitude.
inline std::vector<double> to_d(const std::vector<float>& x) { return {x.begin(), x.end()}; }
inline double rel_err(const std::vector<double>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num = std::max(num, std::fabs(got[i] - want[i]));
    den = std::max(den, std::fabs(want[i]));
  }
  return den > 0 ? num / den : num;
}
inline double rel_err(const std::vector<float>& got, const std::vector<double>& want) {
  return rel_err(to_d(got), want);
}

// With FOCUS_BAD_INPUT_LOG set, an error message a test provoked is appended to that file as a
// JSON line {"test", "input", "message"}: scripts/bad_inputs.py turns the log into the list of bad
// inputs and their messages in docs/RESULTS.md.
inline void record_error(const std::string& message, const std::string& input = "") {
  const char* log = std::getenv("FOCUS_BAD_INPUT_LOG");
  if (!log || !*log || message.empty()) return;
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  nlohmann::json j = {{"test", info ? std::string(info->test_suite_name()) + "." + info->name() : ""},
                      {"input", input},
                      {"message", message}};
  std::ofstream(log, std::ios::app) << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
}

// The message of the focus::Error fn throws (recorded as above), or "" when it throws none.
template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    record_error(e.what());
    return e.what();
  }
  return "";
}

}  // namespace focus::test

#define FOCUS_NEED_FILE(path)                                                          \
  do {                                                                                 \
    if (!std::filesystem::exists(path)) {                                              \
      if (::focus::test::require_data()) FAIL() << "required input missing: " << (path); \
      GTEST_SKIP() << "input missing (run scripts/setup.sh / place ../shared): " << (path); \
    }                                                                                  \
  } while (0)
