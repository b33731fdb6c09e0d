// The routing of a Focus layer's cached positions, kept beside the keys and values and indexed
// by group, so that a new token can read the members of its own groups
// (kernels/cpu/cached_attention.h).
#pragma once
#include <cstdint>
#include <vector>

namespace focus {

// The routing of one Focus layer's cached positions 0 .. len()-1.
struct FocusLayerCache {
  int64_t groups = 0;                          // G
  int topk = 0;                                // memberships kept per position (hard mode)
  std::vector<int32_t> top;                    // [len, topk] groups of each position, ascending
  std::vector<float> p;                        // [len, G] soft assignments (soft mode only)
  std::vector<std::vector<int32_t>> members;   // per group: the positions in it, ascending
  int64_t len = 0;

  // Forgets everything (a new sequence); the shape comes with the first append.
  void reset(int64_t g, int k);
  // Appends n positions: top [n, topk] (ascending groups per row) and, when keep_p, p [n, G].
  void append(const int32_t* top_rows, const float* p_rows, int64_t n);
  // Keeps positions 0 .. n-1 (n <= len).
  void truncate(int64_t n);
};

}  // namespace focus
