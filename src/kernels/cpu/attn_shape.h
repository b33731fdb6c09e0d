// The shape of one attention call, shared by every attention kernel (dense, Focus hard, Focus
// soft, cached decoding). Rows of q, k, v and o are q_stride, kv_stride, kv_stride and o_stride
// floats apart; row t of q holds heads * head_dim floats, row j of k and v kv_heads * head_dim.
#pragma once
#include <cstdint>

namespace focus::cpu {

struct AttnShape {
  int64_t n_q = 0;            // query rows
  int64_t n_kv = 0;           // key/value rows (positions 0 .. n_kv-1)
  int64_t q_pos0 = 0;         // position of query row 0 (self-attention kernels: n_q == n_kv, q_pos0 == 0)
  int64_t heads = 1, kv_heads = 1, head_dim = 0;   // heads % kv_heads == 0 (MHA, GQA, MQA)
  int64_t q_stride = 0, kv_stride = 0, o_stride = 0;
  float scale = 1.f;          // multiplies q.k
  int64_t sliding_window = 0; // hard visibility limit: 0 full causal; w > 0: key j visible to query i iff i - w < j <= i
  int64_t local_window = 1;   // Focus local window: pairs with i - j < local_window always visible (hard) / unbiased (soft)
  int64_t sinks = 0;          // Focus: keys j < sinks visible to every query (hard) / unbiased (soft)
  int64_t groups = 0;         // soft mode: columns of p
  float eps = 1e-6f;          // soft mode: bias = log(sum_g p_ig p_jg + eps)
};

}  // namespace focus::cpu
