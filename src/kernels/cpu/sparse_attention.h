// Focus attention in hard (inference) mode: a query sees its local window, the sink tokens and,
// beyond the window, only the keys that share one of its groups. All heads of a layer share the
// routing. Three paths compute the same thing:
//   focus_attention_reference  dense scores with the Focus mask, double accumulation (tests only)
//   focus_attention_fused      one flash-style pass over group query tiles (per head; tiles at the
//                              same place in a few groups share their window key tiles): window,
//                              sinks and same-group keys in one online softmax; masked pairs never
//                              computed
//   focus_attention_two_call   the paper's decomposition: sliding-window call + same-group call
//                              over group-sorted tokens, merged exactly by log-sum-exp
#pragma once
#include <cstdint>

#include "focus/group_layout.h"
#include "kernels/cpu/attn_shape.h"

namespace focus::cpu {

// Self-attention over n = s.n_q tokens at positions 0 .. n-1 (queries and keys are the same
// tokens: s.n_kv == n, s.q_pos0 == 0). q [n, heads, head_dim] rows q_stride apart; k, v
// [n, kv_heads, head_dim] rows kv_stride apart; o [n, heads, head_dim] rows o_stride apart; lse
// (optional) [heads, n]. The pattern uses local_window (w >= 1) and sinks (S >= 0);
// sliding_window must be 0.

// The pattern: (i, j) is visible iff j <= i and (i - j < w or j < S or groups(i) and groups(j)
// intersect). Every row sees at least itself. o = softmax of the scaled scores over visible keys
// times v; lse[h, i] = natural log-sum-exp of row i's visible scaled scores.

// Exact number of visible (i, j) pairs for one head, in O(n topk) (plus a hash map for topk 2).
int64_t focus_pair_count(const Routing& routing, int64_t n, int64_t local_window, int64_t sinks);

void focus_attention_reference(const float* q, const float* k, const float* v, float* o, float* lse,
                               const AttnShape& s, const Routing& routing);

// One row of the reference: query token i, head h; writes head_dim floats to o, returns the lse.
float focus_attention_reference_row(const float* q, const float* k, const float* v, float* o,
                                    const AttnShape& s, const Routing& routing, int64_t i, int64_t h);

void focus_attention_fused(const float* q, const float* k, const float* v, float* o, float* lse,
                           const AttnShape& s, const Routing& routing);

void focus_attention_two_call(const float* q, const float* k, const float* v, float* o, float* lse,
                              const AttnShape& s, const Routing& routing);

// The two calls on their own. Call 1: pairs with i - j < w, plus sinks j < S outside the window.
void focus_window_attention(const float* q, const float* k, const float* v, float* o, float* lse,
                            const AttnShape& s);
// Call 2: same-group pairs with S <= j <= i - w, over group-sorted tokens; a pair sharing two
// groups counts once (in the smaller shared group). Rows with no such key get lse -inf, o = 0.
void focus_group_attention(const float* q, const float* k, const float* v, float* o, float* lse,
                           const AttnShape& s, const Routing& routing);

// The fused, window, group and two-call kernels keep their key tiles and partial states in
// buffers of the calling thread that only grow, so the calls after the first (every layer of a
// forward pass) fault in no new pages. Bytes held by the calling thread; trim frees them all when
// they exceed max_bytes (the model's forward pass trims after each call, see model.h).
size_t focus_attention_scratch_bytes();
void focus_attention_trim_scratch(size_t max_bytes = 0);

// Exact merge of two partial attentions over disjoint key sets, in place into (o, lse):
// o = (e^lse o + e^lse2 o2) / (e^lse + e^lse2), lse = log(e^lse + e^lse2). Both -inf gives o = 0.
// o and o2 are [n, heads, head_dim] with row strides o_stride and o2_stride; lse, lse2 [heads, n].
void merge_attention_states(float* o, float* lse, int64_t o_stride, const float* o2, const float* lse2,
                            int64_t o2_stride, int64_t n, int64_t heads, int64_t head_dim);

}  // namespace focus::cpu
