// Perplexity over token streams in windows of ctx tokens, each token scored once.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/model.h"

namespace focus {

struct PplOptions {
  int64_t ctx = 512;
  int64_t stride = 0;      // 0: ctx (minus the BOS slot) = non-overlapping windows
  bool bos = true;         // put the model's BOS at the start of every window (if it has one)
  bool progress = true;
  const AttentionPlan* attention = nullptr;  // per-layer attention (e.g. focus_plan), or the model's own
  // Score through the decoding path: each window's tokens run one at a time over the cache (what
  // generation computes: with native weights, the int8 matrix-vector kernels), not as one prefill.
  bool decode = false;
  cpu::KvType kv_type = cpu::KvType::F32;  // the KV cache's element type
};

struct PplResult {
  double nll_sum = 0;      // nats
  int64_t tokens = 0;      // scored
  int64_t windows = 0;
  double seconds = 0;      // forward time
  int64_t processed = 0;   // tokens run through the model (incl. overlap and BOS)
  bool interrupted = false;
  AttentionStats attention;  // sparse policies: pattern density and group balance
  double nll() const { return tokens ? nll_sum / tokens : 0; }
  double ppl() const;
};

// One window run from position 0: the sum of -log p(targets[t] | ids[0..t]) over the rows with
// targets[t] >= 0, and their count in *scored. Logits are made in row chunks (no [T, vocab]).
// kv: the KV cache's element type.
double window_nll(const Model& m, const std::vector<int32_t>& ids, const std::vector<int32_t>& targets,
                  const AttentionPlan* attention, AttentionStats* stats, int64_t* scored,
                  cpu::KvType kv = cpu::KvType::F32);

// The same, running the tokens one at a time over the cache (the decoding path).
double window_nll_decode(const Model& m, const std::vector<int32_t>& ids, const std::vector<int32_t>& targets,
                         const AttentionPlan* attention, AttentionStats* stats, int64_t* scored,
                         cpu::KvType kv = cpu::KvType::F32);

// Scores requests one after another (multiple-choice tasks), reusing the keys and values of the
// longest prefix a request shares with the previous one: the choices of an item share their
// context, and the items of a few-shot task share the prompt. The plain forward pass gives the
// same numbers from a filled cache as from position 0; with a Focus plan the cache keeps the
// routing of the shared prefix too, so the pattern (and the numbers, up to summation order) are
// those of a run from position 0.
class PrefixScorer {
 public:
  PrefixScorer(const Model& m, const AttentionPlan* attention, cpu::KvType kv = cpu::KvType::F32);
  // As window_nll for ids[0..T) (run from position 0), given the previous requests.
  double nll(const std::vector<int32_t>& ids, const std::vector<int32_t>& targets, int64_t* scored);
  int64_t reused_tokens() const { return reused_; }      // rows taken from the cache
  int64_t computed_tokens() const { return computed_; }  // rows run through the model

 private:
  const Model& m_;
  const AttentionPlan* attention_;
  cpu::KvType kv_;
  KVCache cache_;
  std::vector<int32_t> prev_;
  std::vector<float> hidden_;
  int64_t reused_ = 0, computed_ = 0;
};

// Scores ids (text tokens, no BOS). Window w covers ids[a, b) with a = w * stride; a token is
// scored in the first window that predicts it from inside that window.
PplResult perplexity(const Model& m, const std::vector<int32_t>& ids, const PplOptions& o);

}  // namespace focus
