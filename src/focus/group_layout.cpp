#include "focus/group_layout.h"

#include "core/error.h"

namespace focus {

void check_routing(const Routing& r, int64_t n) {
  FOCUS_CHECK(r.topk == 1 || r.topk == 2, "routing: topk must be 1 or 2, got ", r.topk);
  FOCUS_CHECK(r.n_groups >= 1, "routing: need at least one group, got ", r.n_groups);
  FOCUS_CHECK(n == 0 || r.ids, "routing: no group ids given for ", n, " tokens");
  for (int64_t i = 0; i < n; ++i) {
    const int32_t* g = r.ids + i * r.topk;
    for (int t = 0; t < r.topk; ++t) {
      FOCUS_CHECK(g[t] >= 0 && g[t] < r.n_groups, "routing: token ", i, " has group id ", g[t],
                  " outside [0, ", r.n_groups, ")");
      FOCUS_CHECK(t == 0 || g[t - 1] < g[t], "routing: token ", i, " has unsorted or repeated group ids");
    }
  }
}

GroupLayout build_group_layout(const Routing& r, int64_t n) {
  check_routing(r, n);
  GroupLayout L;
  L.n_tokens = n;
  L.n_groups = r.n_groups;
  L.topk = r.topk;
  L.offsets.assign(r.n_groups + 1, 0);
  const int64_t total = n * r.topk;
  for (int64_t e = 0; e < total; ++e) ++L.offsets[r.ids[e] + 1];
  for (int64_t g = 0; g < r.n_groups; ++g) L.offsets[g + 1] += L.offsets[g];
  // Scatter in increasing token order: stable, so each segment is sorted by position.
  std::vector<int64_t> next(L.offsets.begin(), L.offsets.end() - 1);
  L.members.resize(total);
  for (int64_t e = 0; e < total; ++e) L.members[next[r.ids[e]]++] = (int32_t)(e / r.topk);
  return L;
}

}  // namespace focus
