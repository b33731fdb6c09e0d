// Hard routing of one layer and the group-sorted token layout built from it.
//
// Each token i has `topk` sorted, distinct group ids in [0, n_groups). The layout lists, for
// every group g, its member tokens in increasing original position (a stable counting sort),
// so a group's members form a packed sequence (like FlashAttention's cu_seqlens): segment g is
// members[offsets[g] .. offsets[g + 1]). With topk = 2 a token appears in both of its groups.
// The load metric of a routing (largest over mean group size) is group_load_stats in balancing.h.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

namespace focus {

// Group ids of n tokens: ids[i * topk + t], t < topk, sorted and distinct per token.
struct Routing {
  const int32_t* ids = nullptr;
  int64_t n_groups = 0;
  int topk = 1;
};

struct GroupLayout {
  int64_t n_tokens = 0;
  int64_t n_groups = 0;
  int topk = 1;
  std::vector<int64_t> offsets;  // [n_groups + 1]
  std::vector<int32_t> members;  // [n_tokens * topk] token indices, by group, then by position

  int64_t size(int64_t g) const { return offsets[g + 1] - offsets[g]; }
  std::span<const int32_t> group(int64_t g) const {
    return {members.data() + offsets[g], (size_t)size(g)};
  }
};

// Checks the routing (ids in range, sorted, distinct; topk 1 or 2) and builds the layout in
// O(n topk + n_groups). Throws focus::Error on bad input.
GroupLayout build_group_layout(const Routing& routing, int64_t n_tokens);

// Throws focus::Error unless every token's ids are sorted, distinct and in [0, n_groups).
void check_routing(const Routing& routing, int64_t n_tokens);

}  // namespace focus
