#include "focus/focus_cache.h"

#include "core/error.h"
#include "kernels/cpu/sparse_attention.h"
#include "kernels/cpu/simd.h"

namespace focus {

void FocusLayerCache::reset(int64_t g, int k) {
  FOCUS_CHECK(g >= 1 && k >= 1 && k <= g, "FocusLayerCache: bad shape (", g, " groups, top-", k, ")");
  groups = g;
  topk = k;
  top.clear();
  p.clear();
  members.assign(g, {});
  len = 0;
}

void FocusLayerCache::append(const int32_t* top_rows, const float* p_rows, int64_t n) {
  FOCUS_CHECK(groups > 0, "FocusLayerCache: append before reset");
  FOCUS_CHECK(p_rows || p.empty() || len == 0, "FocusLayerCache: soft assignments missing for new positions");
  for (int64_t r = 0; r < n; ++r)
    for (int c = 0; c < topk; ++c) {
      const int32_t g = top_rows[r * topk + c];
      FOCUS_CHECK(g >= 0 && g < groups, "FocusLayerCache: group ", g, " out of range (", groups, " groups)");
      members[g].push_back((int32_t)(len + r));
    }
  top.insert(top.end(), top_rows, top_rows + n * topk);
  if (p_rows) p.insert(p.end(), p_rows, p_rows + n * groups);
  len += n;
}

void FocusLayerCache::truncate(int64_t n) {
  FOCUS_CHECK(n >= 0 && n <= len, "FocusLayerCache: cannot keep ", n, " of ", len, " positions");
  top.resize(n * topk);
  if (!p.empty()) p.resize(n * groups);
  for (auto& m : members)
    while (!m.empty() && m.back() >= n) m.pop_back();
  len = n;
}

}  // namespace focus
