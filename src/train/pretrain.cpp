#include "train/pretrain.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/mapped_file.h"
#include "core/memory.h"
#include "eval/perplexity.h"
#include "focus/focus_attention.h"
#include "io/tokenizer.h"
#include "kernels/cpu/ops.h"
#include "train/backward.h"
#include "train/retrofit.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace focus {
namespace {

double ppl_of(double nll, int64_t n) { return n > 0 ? std::exp(nll / n) : 0; }

// Forward + backward FLOPs per trained token: 6 per weight of every matrix (the output head
// included, the embedding lookup not) and, per layer, causal attention over a window of ctx
// (q.k and p.v: 2 * 2 * q_dim per visible key, ctx / 2 keys on average, times 3). Latent
// attention counts its standard form: the query (and q latent) projections, the kv latent, the
// up-projection of every token's keys and values, and q.k over nope + rope, p.v over v dims per head.
double flops_per_token(const ModelConfig& c, int64_t ctx) {
  const double D = (double)c.dim;
  double attn_matrices, attn_per_key;
  if (c.mla()) {
    const double qp = (double)c.q_proj_dim(), qr = (double)c.mla_q_rank;
    attn_matrices = (qr > 0 ? D * qr + qr * qp : D * qp) + D * (double)(c.mla_kv_rank + c.mla_rope) +
                    (double)c.heads * (double)(c.mla_nope + c.mla_v) * (double)c.mla_kv_rank +
                    (double)c.o_proj_dim() * D;
    attn_per_key = 2.0 * (double)c.heads * (double)(c.mla_nope + c.mla_rope + c.mla_v);
  } else {
    attn_matrices = D * (double)(c.q_dim() + 2 * c.kv_dim()) + (double)c.q_dim() * D;
    attn_per_key = 4.0 * (double)c.q_dim();
  }
  const double per_layer = attn_matrices + D * (double)c.ffn * (c.mlp == MlpKind::GELU ? 2 : 3);
  const double matrices = per_layer * (double)c.layers + (double)c.vocab * D;
  return 6 * matrices + 3 * attn_per_key * (ctx / 2.0) * (double)c.layers;
}

}  // namespace

PretrainResult run_pretrain(const PretrainOptions& o) {
  FOCUS_CHECK(!o.tokenizer.empty(), "train: give --tokenizer FILE (a llama2.c tokenizer .bin or a tokenizer.json)");
  FOCUS_CHECK(o.attention == "dense" || o.attention == "focus", "train: --attention must be dense or focus (got '",
              o.attention, "')");
  FOCUS_CHECK(o.balance == "none" || o.balance == "swav", "train: --balance must be none or swav (got '", o.balance,
              "')");
  const bool with_focus = o.attention == "focus";
  Model m;
  m.tok = io::load_tokenizer(o.tokenizer);
  ModelConfig cfg;
  if (o.config.empty()) {
    cfg = preset_config(o.arch, m.tok->vocab_size(), o.ctx);
  } else {
    json j;
    try {
      j = json::parse(read_file(o.config));
    } catch (const json::exception& e) {
      FOCUS_CHECK(false, o.config, ": not valid JSON (", e.what(), ")");
    }
    cfg = config_from_hf_json(j, o.config);
    FOCUS_CHECK(cfg.vocab == m.tok->vocab_size(), o.config, ": vocab_size ", cfg.vocab, " but the tokenizer has ",
                m.tok->vocab_size(), " tokens");
    FOCUS_CHECK(o.ctx <= cfg.max_ctx, o.config, ": max_position_embeddings ", cfg.max_ctx, " is below --ctx ", o.ctx);
  }
  const std::string arch = o.config.empty() ? o.arch : cfg.arch_name;
  ModelParams p = init_model_params(cfg, o.seed);
  bind_model(p, m);
  m.path = "scratch:" + (o.config.empty() ? o.arch : o.config);
  m.format = "scratch";

  FocusRouters routers;
  if (with_focus) {
    FocusSettings s = o.focus;
    s.mode = FocusMode::Soft;
    FOCUS_CHECK(!s.asymmetric, "train: joint training uses symmetric routers");
    routers = focus_init(m.cfg, s, o.seed + 1);
  }
  const TrainData d = prepare_train_data(m, o, "train");
  {
    MemoryNeed need = training_memory(m.cfg, o.ctx, with_focus ? o.focus.groups : 0, 0);
    need.add("weights, gradients and AdamW moments", 16.0 * (double)p.n_params());
    check_memory("train " + arch + " at ctx " + std::to_string(o.ctx), need, "lower --ctx");
  }

  TrainTask task;
  task.name = "train";
  task.identity = train_options_identity(m, o);
  task.identity.update({{"trainer", "train"}, {"arch", arch}, {"config", o.config}, {"tokenizer", o.tokenizer},
                        {"attention", o.attention}, {"params", p.n_params()}});
  if (with_focus)
    task.identity.update({{"window", o.focus.local_window}, {"sinks", o.focus.sinks}, {"groups", o.focus.groups},
                          {"dg", o.focus.dg}, {"tau", o.focus.tau}, {"balance", o.balance},
                          {"balance_weight", o.balance_weight}});
  // Named only when set, so checkpoints written without the option still match.
  if (with_focus && o.router_detach) task.identity["router_detach"] = true;
  for (size_t i = 0; i < p.data.size(); ++i) {
    task.params.push_back(&p.data[i]);
    task.block_names.push_back(p.tensors[i].name + ".");
    task.decay.push_back(p.tensors[i].decay);
  }
  const size_t n_model = p.data.size();
  if (with_focus)
    for (size_t r = 0; r < routers.routers.size(); ++r) {
      task.params.push_back(&routers.routers[r].params);
      task.block_names.push_back("routers." + std::to_string(r) + ".");
      task.decay.push_back(false);
    }
  double swav_sum = 0;
  int64_t swav_terms = 0;
  const RouterAuxHook hook = with_focus && o.balance == "swav"
                                 ? swav_balance_hook(routers, o.balance_weight / (float)o.batch, &swav_sum, &swav_terms)
                                 : RouterAuxHook(nullptr);
  if (hook)
    task.step_metrics = [&](json& line) {
      line["swav_loss"] = swav_terms > 0 ? swav_sum / (double)swav_terms : 0.0;
      swav_sum = 0;
      swav_terms = 0;
    };
  task.loss_and_grad = [&](const TrainWindow& w, float loss_scale, std::vector<std::vector<float>>& grads) {
    const ModelGrads mg = grad_views(p, grads);
    TrainableSet ts;
    ts.model_grads = &mg;
    // The routers' gradients: the blocks after the model's (moved out and back, no copy).
    std::vector<std::vector<float>> router_part;
    for (size_t i = n_model; i < grads.size(); ++i) router_part.push_back(std::move(grads[i]));
    if (with_focus) {
      ts.routers = &routers;
      ts.router_grads = &router_part;
      ts.router_hook = hook;
      ts.router_detach_input = o.router_detach;
    }
    const double loss = train_loss_and_grad(m, ts, w, loss_scale).loss_sum;
    for (size_t i = 0; i < router_part.size(); ++i) grads[n_model + i] = std::move(router_part[i]);
    return loss;
  };
  task.validate = [&](ValidPhase phase, int64_t step, const json&) {
    json v;
    if (with_focus) {
      const ValidResult r = validate(m, routers, d.valid_ids, d.valid_targets, false);
      v = {{"ppl", r.ppl_soft}, {"ppl_hard", r.ppl_hard}, {"density_hard", r.density_hard}, {"tokens", r.tokens}};
    } else {
      double nll = 0;
      int64_t tokens = 0;
      for (size_t i = 0; i < d.valid_ids.size(); ++i) {
        int64_t n = 0;
        nll += window_nll(m, d.valid_ids[i], d.valid_targets[i], nullptr, nullptr, &n);
        tokens += n;
      }
      v = {{"ppl", ppl_of(nll, tokens)}, {"tokens", tokens}};
    }
    if (phase == ValidPhase::Periodic)
      std::fprintf(stderr, "\n[train] step %lld: valid ppl %.3f%s\n", (long long)step, v["ppl"].get<double>(),
                   with_focus ? (", hard " + std::to_string(v["ppl_hard"].get<double>())).c_str() : "");
    return v;
  };
  const std::string model_dir = (fs::path(o.out) / "model").string();
  const std::string routers_dir = (fs::path(o.out) / "routers").string();
  task.save_outputs = [&] {
    save_model_params(p, model_dir, o.tokenizer);
    // The routers name their model relative to their own folder: the output folder can move, and
    // a resumed run writes the same bytes as one never interrupted.
    if (with_focus) save_focus(routers, routers_dir, m.cfg, "../model");
  };

  const TrainLoopResult lr = run_train_loop(o, d, task);
  PretrainResult res;
  static_cast<TrainStats&>(res) = lr;
  const json& after = lr.after;
  res.valid_ppl_initial = lr.before.value("ppl", 0.0);
  if (!lr.interrupted) {
    res.valid_ppl = after.value("ppl", 0.0);
    res.valid_ppl_hard = after.value("ppl_hard", 0.0);
    res.valid_density_hard = after.value("density_hard", 0.0);
    res.valid_tokens = after.value("tokens", int64_t(0));
  }
  res.params = p.n_params();
  for (const auto& r : routers.routers) res.router_params += (int64_t)r.params.size();
  res.flops_per_token = flops_per_token(m.cfg, o.ctx);
  res.model_gflops = res.flops_per_token * res.tokens_per_s / 1e9;
  if (o.measure_peak && res.steps > 0 && !lr.interrupted) {
    res.sgemm_gflops = cpu::sgemm_gflops(2048, 2048, 2048, 3);
    res.mfu = res.model_gflops / res.sgemm_gflops;
  }
  res.model_dir = model_dir;
  res.arch = arch;
  res.routers_dir = with_focus ? routers_dir : "";
  return res;
}

}  // namespace focus
