// Dense causal attention on the CPU, computed flash-style: tiles of queries against tiles of
// keys with an online softmax, so no N x N buffer ever exists.
#pragma once
#include <cstdint>

#include "kernels/cpu/attn_shape.h"
#include "kernels/cpu/kv_types.h"

namespace focus::cpu {

// Uses n_q, n_kv, q_pos0, heads, kv_heads, head_dim, the strides, scale and sliding_window.
// o[t, h, :] = softmax_j(scale * q[t, h, :] . k[j, h/g, :]) v[j, h/g, :] over visible j.
// lse (optional, [heads, n_q]) receives the natural-log sum-exp of the scaled scores of each
// row (-inf for a row with no visible key, whose output is 0).
void flash_attention(const float* q, const float* k, const float* v, float* o, float* lse, const AttnShape& s);
// Keys and values from a cache of any element type (kv_stride in elements). The elements are
// widened to float as the tiles are packed, so the result is bit for bit the float version's on
// the widened values, whatever the type.
void flash_attention(const float* q, KvView k, KvView v, float* o, float* lse, const AttnShape& s);

// The same rows for decoding (a few rows over a long cache): every row's visible keys are cut
// into fixed slices of 256, the (slice, kv head) pieces spread over the threads (flash-decoding)
// and merged in slice order, so the result does not depend on the thread count. Equal to
// flash_attention up to summation order. Uses the fields flash_attention uses.
void decode_attention(const float* q, KvView k, KvView v, float* o, const AttnShape& s);

// The obviously-correct version (full score row per query), for tests.
void attention_reference(const float* q, const float* k, const float* v, float* o, float* lse, const AttnShape& s);

}  // namespace focus::cpu
