#include "eval/perplexity.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/error.h"
#include "core/progress.h"
#include "kernels/cpu/ops.h"

namespace focus {

double PplResult::ppl() const { return std::exp(nll()); }

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

  PplResult r;
  KVCache cache;
  cache.init(m.cfg, o.ctx);
  std::vector<float> hidden(o.ctx * m.cfg.dim);
  const int64_t chunk = 64;
  std::vector<float> logits(chunk * m.cfg.vocab);
  std::vector<int32_t> win;
  int64_t n_windows = 1 + (n > span ? (n - span + stride - 1) / stride : 0);
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
    const int64_t T = (int64_t)win.size();
    cache.clear();
    forward(m, win.data(), T, cache, hidden.data(), o.focus, &r.focus);
    // Window row i predicts win[i + 1]; id index of win[i] is a + i - nb.
    const int64_t first_target = std::max(scored_to, nb ? a : a + 1);
    std::vector<double> row_nll;
    for (int64_t t0r = first_target; t0r < b; t0r += chunk) {
      const int64_t rows = std::min(chunk, b - t0r);
      const int64_t row0 = t0r - a + nb - 1;  // hidden row predicting ids[t0r]
      compute_logits(m, hidden.data() + row0 * m.cfg.dim, rows, logits.data());
      std::vector<double> lp(rows);
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < rows; ++i)
        lp[i] = cpu::log_prob(logits.data() + i * m.cfg.vocab, m.cfg.vocab, ids[t0r + i]);
      for (int64_t i = 0; i < rows; ++i) {
        FOCUS_CHECK(std::isfinite(lp[i]), m.path, ": non-finite log-probability at token ", t0r + i,
                    " (NaN or Inf in the weights or activations)");
        r.nll_sum -= lp[i];
      }
      r.tokens += rows;
    }
    scored_to = b;
    r.processed += T;
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
