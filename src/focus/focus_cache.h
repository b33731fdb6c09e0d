// Focus attention over a filled KV cache (spec section 5, decoding): the routing of every cached
// position is kept beside its keys and values, indexed by group, so that a new token reads its
// window, the sinks and the members of its own groups, O(w + S + k N / G) keys per token in hard
// mode instead of O(N). Chunked prefill (several new tokens at once) uses the same path.
//
// The visible pairs are those of the one-call kernels (focus_attention_fused, soft_attention_forward,
// focus_window_attention) for the same routing, so a sequence run as a prefix and then token by
// token gives the outputs of one call over the whole sequence, up to float summation order.
#pragma once
#include <cstdint>
#include <vector>

#include "focus/focus_model.h"
#include "focus/sparse_attention.h"

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

// Queries at positions pos0 .. pos0+t-1 against keys 0 .. pos0+t-1 under the Focus pattern of
// `mode` (Hard: the cached groups; Soft: the log(sum_g p_ig p_jg + eps) bias beyond the window;
// Window: window and sinks only; Off: every key, dense causal attention). q, o [t, heads,
// head_dim] rows s.q_stride / s.o_stride apart; k, v [pos0 + t, kv_heads, head_dim] rows
// s.kv_stride apart (s.n is ignored). The cache must hold the routing of all pos0 + t positions
// (Window and Off need none). A single row (t = 1) is split over its keys across threads
// (flash-decoding); its result does not depend on the thread count. Returns the visible pairs of
// one head, summed over the t rows.
int64_t focus_cached_attention(const float* q, const float* k, const float* v, float* o, const FocusAttnShape& s,
                               int64_t pos0, int64_t t, FocusMode mode, const FocusLayerCache& fc, float eps);

}  // namespace focus
