#include "train/lora_train.h"

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "eval/perplexity.h"
#include "train/backward.h"

using json = nlohmann::json;

namespace focus {

namespace {

double ppl_of(double nll, int64_t n) { return n > 0 ? std::exp(nll / n) : 0; }

json valid_json(const LoraValid& v) {
  return {{"ppl_pretrained", v.ppl_pretrained}, {"ppl_lora", v.ppl_lora}, {"tokens", v.tokens}};
}

LoraValid valid_from_json(const json& j) {
  LoraValid v;
  v.ppl_pretrained = j.value("ppl_pretrained", 0.0);
  v.ppl_lora = j.value("ppl_lora", 0.0);
  v.tokens = j.value("tokens", int64_t(0));
  return v;
}

bool all_b_zero(const LoraAdapters& a) {
  for (const auto& m : a.mats)
    for (int64_t i = 0; i < m.out * m.rank; ++i)
      if (m.b()[i] != 0.f) return false;
  return true;
}

// The settings a checkpoint must share with the run that resumes it: everything that shapes the
// trained adapters (data, optimizer, schedule, adapter shape) or the recorded validation (files,
// windows).
json run_identity(const Model& m, const LoraOptions& o, const LoraSettings& s) {
  json j = train_options_identity(m, o);
  j.update({{"trainer", "lora"}, {"rank", s.rank}, {"alpha", s.alpha}, {"targets", s.targets}});
  return j;
}

}  // namespace

LoraValid validate_lora(const Model& m, const LoraAdapters& a, const std::vector<std::vector<int32_t>>& ids,
                        const std::vector<std::vector<int32_t>>& targets, bool with_pretrained) {
  FOCUS_CHECK(ids.size() == targets.size(), "validate_lora: ", ids.size(), " windows but ", targets.size(),
              " target rows");
  const Model merged = lora_merged_view(m, a);
  LoraValid v;
  double nll_pre = 0, nll_lora = 0;
  for (size_t w = 0; w < ids.size(); ++w) {
    int64_t n = 0;
    if (with_pretrained) nll_pre += window_nll(m, ids[w], targets[w], nullptr, nullptr, &n);
    nll_lora += window_nll(merged, ids[w], targets[w], nullptr, nullptr, &n);
    v.tokens += n;
  }
  v.ppl_pretrained = with_pretrained ? ppl_of(nll_pre, v.tokens) : 0;
  v.ppl_lora = ppl_of(nll_lora, v.tokens);
  return v;
}

LoraResult run_lora(const Model& m, const LoraOptions& o) {
  LoraSettings s = o.lora;
  s.targets = parse_lora_targets(s.targets);
  s.alpha = s.alpha_or_default();
  const TrainData d = prepare_train_data(m, o, "lora");
  check_memory("lora at ctx " + std::to_string(o.ctx), training_memory(m.cfg, o.ctx, 0, s.rank * (int64_t)s.targets.size()),
               "lower --ctx");
  LoraAdapters a = lora_init(m.cfg, s, o.seed);
  FOCUS_CHECK(!a.mats.empty(), "lora: no projection to adapt");

  TrainTask task;
  task.name = "lora";
  task.identity = run_identity(m, o, s);
  for (auto& mat : a.mats) {
    task.params.push_back(&mat.params);
    task.block_names.push_back("layers." + std::to_string(mat.layer) + "." + lora_target_name(mat.target) + ".");
  }
  task.loss_and_grad = [&](const TrainWindow& w, float loss_scale, std::vector<std::vector<float>>& grads) {
    TrainableSet ts;
    ts.lora = &a;
    ts.lora_grads = &grads;
    return train_loss_and_grad(m, ts, w, loss_scale).loss_sum;
  };
  task.validate = [&](ValidPhase phase, int64_t step, const json& before) {
    if (phase == ValidPhase::Initial) {
      std::fprintf(stderr, "[lora] validating the pretrained model...\n");
      if (all_b_zero(a)) {
        // Untrained adapters (B = 0) merge to the pretrained weights exactly.
        LoraValid v;
        double nll = 0;
        for (size_t w = 0; w < d.valid_ids.size(); ++w) {
          int64_t n = 0;
          nll += window_nll(m, d.valid_ids[w], d.valid_targets[w], nullptr, nullptr, &n);
          v.tokens += n;
        }
        v.ppl_pretrained = v.ppl_lora = ppl_of(nll, v.tokens);
        return valid_json(v);
      }
      return valid_json(validate_lora(m, a, d.valid_ids, d.valid_targets, true));
    }
    LoraValid v = validate_lora(m, a, d.valid_ids, d.valid_targets, false);
    v.ppl_pretrained = valid_from_json(before).ppl_pretrained;
    if (phase == ValidPhase::Periodic)
      std::fprintf(stderr, "\n[lora] step %lld: valid ppl LoRA %.3f (pretrained %.3f)\n", (long long)step, v.ppl_lora,
                   v.ppl_pretrained);
    return valid_json(v);
  };
  task.save_outputs = [&] { save_lora(a, o.out, m.cfg, m.path); };

  const TrainLoopResult lr = run_train_loop(o, d, task);
  LoraResult res;
  res.settings = s;
  res.params = a.n_params();
  res.before = valid_from_json(lr.before);
  if (!lr.interrupted) res.after = valid_from_json(lr.after);
  static_cast<TrainStats&>(res) = lr;
  return res;
}

}  // namespace focus
