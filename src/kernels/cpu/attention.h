// Dense causal attention on the CPU, computed flash-style: tiles of queries against tiles of
// keys with an online softmax, so no N x N buffer ever exists.
#pragma once
#include <cstdint>

namespace focus::cpu {

struct AttnShape {
  int64_t n_q;        // query rows
  int64_t n_kv;       // key/value rows available (positions 0 .. n_kv-1)
  int64_t q_pos0;     // position of query row 0 (query t sits at q_pos0 + t)
  int64_t heads;      // query heads
  int64_t kv_heads;   // key/value heads (heads % kv_heads == 0: MHA, GQA, MQA)
  int64_t head_dim;
  int64_t q_stride;   // floats between consecutive query rows (usually heads * head_dim)
  int64_t kv_stride;  // floats between consecutive key/value rows (usually kv_heads * head_dim)
  int64_t o_stride;   // floats between consecutive output rows
  float scale;        // multiplies q.k
  int64_t window;     // 0: full causal; w > 0: key j visible to query i iff i - w < j <= i
};

// o[t, h, :] = softmax_j(scale * q[t, h, :] . k[j, h/g, :]) v[j, h/g, :] over visible j.
// lse (optional, [heads, n_q]) receives the natural-log sum-exp of the scaled scores of each
// row (-inf for a row with no visible key, whose output is 0).
void flash_attention(const float* q, const float* k, const float* v, float* o, float* lse, const AttnShape& s);

// The obviously-correct version (full score row per query), for tests.
void attention_reference(const float* q, const float* k, const float* v, float* o, float* lse, const AttnShape& s);

}  // namespace focus::cpu
