// What the routers learned: per Focus layer, how many tokens each group holds and which tokens
// land there most often, over a text run in hard mode (`focus groups`).
#pragma once
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "focus/focus_model.h"
#include "model/model.h"

namespace focus {

struct GroupsReport {
  struct Group {
    int64_t size = 0;                                  // memberships (a top-2 token counts in both)
    std::vector<std::pair<int32_t, int64_t>> top;      // most frequent token ids and their counts
  };
  struct Layer {
    int64_t layer = 0;
    std::vector<Group> groups;
    double max_over_mean = 0;  // largest group / mean group size
    int64_t empty = 0;         // groups nobody joined
  };
  std::vector<Layer> layers;
  int64_t tokens = 0;    // tokens routed (per layer)
  int64_t windows = 0;
};

// Runs ids in windows of ctx tokens (BOS first when the model has one) with f in hard mode and
// gathers the memberships; max_tokens > 0 limits the text. top_n tokens are kept per group.
GroupsReport groups_report(const Model& m, const FocusRouters& f, const std::vector<int32_t>& ids, int64_t ctx,
                           int64_t max_tokens, int top_n, bool progress);

// Text table (token pieces quoted) and JSON.
std::string groups_report_text(const Model& m, const GroupsReport& r);
nlohmann::json groups_report_json(const Model& m, const GroupsReport& r);

}  // namespace focus
