#include "eval/perplexity.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/error.h"
#include "core/progress.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/quant_matvec.h"

namespace focus {

double PplResult::ppl() const { return std::exp(nll()); }

namespace {

// Sum of -log p(targets[t]) over the rows t >= row0 with a target; hidden holds rows row0 ..
// (final-normed states), in chunks of 4096 rows, by a kernel that never holds all the logits: the
// integer GEMM's (quant_gemm_log_softmax) for a quantised output matrix under the integer prefill
// GEMM, else linear_log_prob (each tile of the matrix dequantised once, multiplied through sgemm).
double score_rows(const Model& m, const float* hidden, int64_t row0, const std::vector<int32_t>& targets,
                  int64_t* scored) {
  const int64_t T = (int64_t)targets.size(), D = m.cfg.dim;
  std::vector<int64_t> rows;
  for (int64_t t = row0; t < T; ++t)
    if (targets[t] >= 0) rows.push_back(t);
  double nll = 0;
  auto add = [&](double lp, int64_t row) {
    FOCUS_CHECK(std::isfinite(lp), m.path, ": non-finite log-probability at window row ", row,
                " (NaN or Inf in the weights or activations)");
    nll -= lp;
  };
  if (scored) *scored = (int64_t)rows.size();
  const bool int8 = cpu::prefill_gemm() == cpu::PrefillGemm::Int8 && cpu::quant_gemm_supported(m.w.lm_head);
  const int64_t big = 4096;
  std::vector<float> h;
  std::vector<int32_t> tg;
  std::vector<double> lp;
  for (size_t r0 = 0; r0 < rows.size(); r0 += big) {
    const int64_t n = std::min<int64_t>(big, (int64_t)rows.size() - (int64_t)r0);
    h.resize(n * D);
    tg.resize(n);
    lp.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      std::copy_n(hidden + (rows[r0 + i] - row0) * D, D, h.data() + i * D);
      tg[i] = targets[rows[r0 + i]];
    }
    if (int8) cpu::quant_gemm_log_softmax(h.data(), m.w.lm_head, n, tg.data(), lp.data());
    else cpu::linear_log_prob(h.data(), m.w.lm_head, n, tg.data(), lp.data());
    for (int64_t i = 0; i < n; ++i) add(lp[i], rows[r0 + i]);
  }
  return nll;
}

}  // namespace

double window_nll(const Model& m, const std::vector<int32_t>& ids, const std::vector<int32_t>& targets,
                  const AttentionPlan* attention, AttentionStats* stats, int64_t* scored, cpu::KvType kv) {
  const int64_t T = (int64_t)ids.size();
  FOCUS_CHECK(targets.size() == ids.size(), "window_nll: ", ids.size(), " ids but ", targets.size(), " targets");
  KVCache cache;  // one forward of the whole window: no later call reads its rows
  cache.init(m.cfg, T, kv, /*keep_rows=*/false);
  std::vector<float> hidden(T * m.cfg.dim);
  forward(m, ids.data(), T, cache, hidden.data(), attention, stats);
  return score_rows(m, hidden.data(), 0, targets, scored);
}

double window_nll_decode(const Model& m, const std::vector<int32_t>& ids, const std::vector<int32_t>& targets,
                         const AttentionPlan* attention, AttentionStats* stats, int64_t* scored, cpu::KvType kv) {
  const int64_t T = (int64_t)ids.size(), V = m.cfg.vocab;
  FOCUS_CHECK(targets.size() == ids.size(), "window_nll: ", ids.size(), " ids but ", targets.size(), " targets");
  KVCache cache;
  cache.init(m.cfg, T, kv);
  std::vector<float> hidden(m.cfg.dim), logits(V);
  double nll = 0;
  int64_t n = 0;
  for (int64_t t = 0; t < T; ++t) {
    forward(m, &ids[t], 1, cache, hidden.data(), attention, stats);
    if (targets[t] < 0) continue;
    compute_logits(m, hidden.data(), 1, logits.data());
    const double lp = cpu::log_prob(logits.data(), V, targets[t]);
    FOCUS_CHECK(std::isfinite(lp), m.path, ": non-finite log-probability at window row ", t);
    nll -= lp;
    ++n;
  }
  if (scored) *scored = n;
  return nll;
}

PrefixScorer::PrefixScorer(const Model& m, const AttentionPlan* attention, cpu::KvType kv)
    : m_(m), attention_(attention), kv_(kv) {}

double PrefixScorer::nll(const std::vector<int32_t>& ids, const std::vector<int32_t>& targets, int64_t* scored) {
  const int64_t T = (int64_t)ids.size();
  FOCUS_CHECK(T > 0 && targets.size() == ids.size(), "PrefixScorer: ", ids.size(), " ids but ", targets.size(),
              " targets");
  // Rows before the first scored one need no hidden state, so their keys and values may come
  // from the previous request where the tokens agree.
  int64_t first = 0;
  while (first < T && targets[first] < 0) ++first;
  int64_t start = 0;
  const int64_t lim = std::min<int64_t>({first, (int64_t)prev_.size(), cache_.len});
  while (start < lim && prev_[start] == ids[start]) ++start;
  if (cache_.capacity < T) {
    cache_.init(m_.cfg, std::max<int64_t>(T, 2 * cache_.capacity), kv_);
    start = 0;
  }
  cache_.truncate(start);
  hidden_.resize((T - start) * m_.cfg.dim);
  forward(m_, ids.data() + start, T - start, cache_, hidden_.data(), attention_, nullptr);
  prev_ = ids;
  reused_ += start;
  computed_ += T - start;
  return score_rows(m_, hidden_.data(), start, targets, scored);
}

PplResult perplexity(const Model& m, const std::vector<int32_t>& ids, const PplOptions& o) {
  const int32_t bos_id = (o.bos && m.tok) ? m.tok->bos() : -1;
  const int64_t nb = bos_id >= 0 ? 1 : 0;
  FOCUS_CHECK(o.ctx >= 2 + nb, "perplexity: ctx must be at least ", 2 + nb);
  if (m.cfg.learned_pos)
    FOCUS_CHECK(o.ctx <= m.cfg.max_ctx, "perplexity: ctx ", o.ctx, " exceeds the model's ", m.cfg.max_ctx,
                " positions");
  const int64_t span = o.ctx - nb;  // text tokens per window
  const int64_t stride = o.stride > 0 ? std::min(o.stride, span) : span;
  const int64_t n = (int64_t)ids.size();
  FOCUS_CHECK(n >= 2 - nb, "perplexity: the text has too few tokens (", n, ")");
  {
    const int64_t T = std::min(o.ctx, n + nb);  // the longest window
    // The cache of a window scored in one forward (window_nll) is made without kept rows.
    const int64_t kv_rows = KVCache::keeps_rows_for(m.cfg, o.decode) ? T : 0;
    check_inference_memory("eval at ctx " + std::to_string(o.ctx), m.cfg, kv_rows, o.decode ? 1 : T, o.kv_type,
                           o.decode ? 1 : 64,
                           kv_rows > 0 ? "lower --ctx (the KV cache and activations grow with it)"
                                       : "lower --ctx (the activations grow with it)");
  }

  PplResult r;
  std::vector<int32_t> win, tgt;
  const int64_t n_windows = 1 + (n > span ? (n - span + stride - 1) / stride : 0);
  Progress bar("eval", n_windows, "win");
  const auto t0 = std::chrono::steady_clock::now();
  int64_t scored_to = 0;  // ids[0, scored_to) have been scored (or cannot be)
  for (int64_t a = 0;; a += stride) {
    if (interrupted()) {
      r.interrupted = true;
      break;
    }
    const int64_t b = std::min(a + span, n);
    win.clear();
    if (nb) win.push_back(bos_id);
    win.insert(win.end(), ids.begin() + a, ids.begin() + b);
    // Row i holds win[i] and predicts win[i + 1] = ids[a + i + 1 - nb]; score each id once.
    const int64_t first_target = std::max(scored_to, nb ? a : a + 1);
    tgt.assign(win.size(), -1);
    for (int64_t t = first_target; t < b; ++t) tgt[t - a + nb - 1] = ids[t];
    int64_t scored = 0;
    r.nll_sum += o.decode ? window_nll_decode(m, win, tgt, o.attention, &r.attention, &scored, o.kv_type)
                          : window_nll(m, win, tgt, o.attention, &r.attention, &scored, o.kv_type);
    r.tokens += scored;
    scored_to = b;
    r.processed += (int64_t)win.size();
    r.windows++;
    if (o.progress) {
      const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      char extra[96];
      std::snprintf(extra, sizeof(extra), "ppl %.3f  %.0f tok/s", r.ppl(), r.processed / std::max(el, 1e-9));
      bar.update(r.windows, extra);
    }
    if (b >= n) break;
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (o.progress) bar.finish();
  return r;
}

}  // namespace focus
