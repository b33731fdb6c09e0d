// Attention of new rows over a filled KV cache under the Focus pattern (spec section 5,
// decoding): a row reads its window, the sinks and, in hard mode, the cached members of its own
// groups (O(w + S + k N / G) keys per row instead of O(N)). Chunked prefill uses the same path.
// The visible pairs are those of the one-call kernels for the same routing, so a sequence run
// as a prefix and then token by token gives the outputs of one call, up to summation order.
#pragma once
#include <cstdint>

#include "focus/focus_cache.h"
#include "focus/focus_model.h"
#include "kernels/cpu/kv_types.h"
#include "kernels/cpu/sparse_attention.h"

namespace focus::cpu {

// Queries at positions pos0 .. pos0+t-1 against keys 0 .. pos0+t-1 under the Focus pattern of
// `mode` (Hard: the cached groups; Soft: the log(sum_g p_ig p_jg + s.eps) bias beyond the window;
// Window: window and sinks only; Off: every key, dense causal attention, limited to
// s.sliding_window when it is set: the dense decoding kernel). q, o [t, heads,
// head_dim] rows s.q_stride / s.o_stride apart; k, v [pos0 + t, kv_heads, head_dim] rows
// s.kv_stride apart (s.n_q, s.n_kv and s.q_pos0 are ignored: pos0 and t say it; the window is
// s.local_window, the soft bias takes s.eps). The cache must hold the routing of all pos0 + t positions
// (Window and Off need none). A single row (t = 1) is split over its keys across threads
// (flash-decoding); its result does not depend on the thread count. Returns the visible pairs of
// one head, summed over the t rows.
int64_t focus_cached_attention(const float* q, const float* k, const float* v, float* o, const AttnShape& s,
                               int64_t pos0, int64_t t, FocusMode mode, const FocusLayerCache& fc);
// The same over a cache of any element type (widened to float as each row is read).
int64_t focus_cached_attention(const float* q, KvView k, KvView v, float* o, const AttnShape& s, int64_t pos0,
                               int64_t t, FocusMode mode, const FocusLayerCache& fc);

}  // namespace focus::cpu
