// Retrofit: train only the Focus routers of a frozen pretrained model on a user's text.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "focus/focus_model.h"
#include "model/model.h"
#include "train/adamw.h"

namespace focus {

enum class Balance { None, Swav, Bias };
Balance parse_balance(const std::string& s);  // "none" | "swav" | "bias"

struct RetrofitOptions {
  std::vector<std::string> train, valid;  // text files; a file is a document (split by document)
  int64_t ctx = 1024;
  int64_t steps = 100;
  int64_t batch = 4;                      // windows per step
  int64_t warmup = 10;
  AdamWConfig adam;
  FocusSettings focus;                    // window, sinks, groups, dg, topk (hard validation), tau
  Balance balance = Balance::None;
  float balance_weight = 0.1f;            // SwAV loss weight, or the bias update rate
  int64_t eval_every = 50;                // validation every N steps (and at the end)
  int64_t valid_windows = 16;
  double checkpoint_seconds = 300;        // atomic checkpoint at least this often (and at the end)
  std::string out;                        // output folder
  bool resume = false;
  int64_t stop_after = 0;                 // end this run after N steps (0: run to --steps), as
                                          // an interruption: checkpoint written, --resume goes on
  uint64_t seed = 1;
  bool progress = true;
};

struct ValidResult {
  double ppl_pretrained = 0, ppl_window = 0, ppl_soft = 0, ppl_hard = 0, ppl_hard_k2 = 0;
  double density_hard = 0, load_max_over_mean = 0;
  int64_t tokens = 0;
};

struct RetrofitResult {
  ValidResult before, after;  // before: the initial (random) routers; after: the trained ones
  int64_t steps = 0, train_tokens = 0;
  double seconds = 0, tokens_per_s = 0;
  bool interrupted = false;
  int64_t router_params = 0;
};

// Validation perplexities of the pretrained model, the sliding-window baseline (with_pretrained)
// and of the routers (soft, hard top-k) on the same windows.
ValidResult validate(const Model& m, const FocusRouters& f, const std::vector<std::vector<int32_t>>& ids,
                     const std::vector<std::vector<int32_t>>& targets, bool with_pretrained);

RetrofitResult run_retrofit(const Model& m, const RetrofitOptions& o);

}  // namespace focus
