#include "train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>

#include "core/error.h"
#include "core/progress.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace focus {

nlohmann::json train_options_identity(const Model& m, const TrainOptions& o) {
  return {{"model", m.path},
          {"train", o.train},
          {"valid", o.valid},
          {"valid_windows", o.valid_windows},
          {"ctx", o.ctx},
          {"steps", o.steps},
          {"batch", o.batch},
          {"warmup", o.warmup},
          {"lr", o.adam.lr},
          {"weight_decay", o.adam.weight_decay},
          {"betas", {o.adam.beta1, o.adam.beta2}},
          {"adam_eps", o.adam.eps},
          {"grad_clip", o.adam.grad_clip},
          {"seed", o.seed}};
}

TrainData prepare_train_data(const Model& m, const TrainOptions& o, const std::string& name) {
  FOCUS_CHECK(m.tok, name, ": the model has no tokenizer");
  FOCUS_CHECK(!o.train.empty(), name, ": give at least one --train file");
  FOCUS_CHECK(!o.valid.empty(), name, ": give at least one --valid file");
  FOCUS_CHECK(!o.out.empty(), name, ": give --out DIR");
  FOCUS_CHECK(o.steps >= 0 && o.batch >= 1 && o.ctx >= 8, name, ": need steps >= 0, batch >= 1, ctx >= 8");
  {
    std::set<std::string> tr;
    for (const auto& t : o.train) tr.insert(fs::weakly_canonical(t).string());
    for (const auto& v : o.valid)
      FOCUS_CHECK(!tr.count(fs::weakly_canonical(v).string()), v,
                  ": a document cannot be both training and validation text (split by document)");
  }
  if (m.cfg.learned_pos)
    FOCUS_CHECK(o.ctx <= m.cfg.max_ctx, name, ": ctx ", o.ctx, " exceeds the model's ", m.cfg.max_ctx,
                " positions");
  std::error_code ec;
  fs::create_directories(o.out, ec);
  FOCUS_CHECK(!ec, o.out, ": cannot create the output folder: ", ec.message());

  TrainData d;
  d.bos = m.tok->bos();
  d.train_docs = tokenize_docs(*m.tok, o.train);
  d.valid_docs = tokenize_docs(*m.tok, o.valid);
  for (const auto& r : validation_windows(d.valid_docs, o.ctx, d.bos, o.valid_windows)) {
    Window w = make_window(d.valid_docs, r, o.ctx, d.bos);
    d.valid_ids.push_back(std::move(w.ids));
    d.valid_targets.push_back(std::move(w.targets));
  }
  std::fprintf(stderr, "[%s] train %lld tokens in %zu docs, valid %zu windows of %lld from %zu docs\n", name.c_str(),
               (long long)total_tokens(d.train_docs), d.train_docs.size(), d.valid_ids.size(), (long long)o.ctx,
               d.valid_docs.size());
  return d;
}

namespace {

struct Checkpoint {
  int64_t step = 0;
  int64_t train_tokens = 0;
  double seconds = 0;
  json before;
};

void save_checkpoint(const std::string& path, const TrainTask& task, const AdamWState& st, const Checkpoint& c) {
  std::map<std::string, io::F32Tensor> t;
  for (size_t b = 0; b < task.params.size(); ++b) {
    const std::string& p = task.block_names[b];
    const std::vector<float>& v = *task.params[b];
    t[p + "params"] = {{(int64_t)v.size()}, v};
    if (st.m.size() == task.params.size()) {
      t[p + "adam_m"] = {{(int64_t)st.m[b].size()}, st.m[b]};
      t[p + "adam_v"] = {{(int64_t)st.v[b].size()}, st.v[b]};
    }
  }
  json meta = {{"step", c.step},       {"adam_t", st.t},      {"train_tokens", c.train_tokens},
               {"seconds", c.seconds}, {"before", c.before}, {"identity", task.identity}};
  if (task.save_state) task.save_state(t, meta);
  io::save_safetensors(path, t, {{"focus_checkpoint", meta.dump()}});
}

// The settings in which a checkpoint's identity and this run's differ, e.g.
// "weight_decay: checkpoint 0, this run 0.1".
std::string identity_diff(const json& saved, const json& now) {
  if (!saved.is_object()) return "checkpoint identity: " + saved.dump();
  std::string d;
  auto add = [&](const std::string& key, const std::string& a, const std::string& b) {
    d += (d.empty() ? "" : "; ") + key + ": checkpoint " + a + ", this run " + b;
  };
  for (const auto& [key, v] : now.items()) {
    if (!saved.contains(key)) add(key, "(not recorded)", v.dump());
    else if (saved[key] != v) add(key, saved[key].dump(), v.dump());
  }
  for (const auto& [key, v] : saved.items())
    if (!now.contains(key)) add(key, v.dump(), "(not a setting)");
  return d;
}

Checkpoint load_checkpoint(const std::string& path, TrainTask& task, AdamWState& st) {
  io::SafetensorsFile file(path);
  const json& md = file.metadata();
  FOCUS_CHECK(md.contains("focus_checkpoint"), path, ": not a focus ", task.name, " checkpoint");
  json meta;
  try {
    meta = json::parse(md["focus_checkpoint"].get<std::string>());
  } catch (const json::exception& e) {
    fail(path, ": malformed checkpoint metadata: ", e.what());
  }
  FOCUS_CHECK(meta.is_object(), path, ": malformed checkpoint metadata: not a JSON object");
  if (meta["identity"] != task.identity)
    fail(path, ": the checkpoint was made with other settings (", identity_diff(meta["identity"], task.identity),
         "); resume with the same flags");
  Checkpoint c;
  try {
    c.step = meta.at("step").get<int64_t>();
    c.train_tokens = meta.value("train_tokens", int64_t(0));
    c.seconds = meta.value("seconds", 0.0);
    c.before = meta.at("before");
    st.t = meta.at("adam_t").get<int64_t>();
  } catch (const json::exception& e) {
    fail(path, ": malformed checkpoint metadata: ", e.what());
  }
  FOCUS_CHECK(c.step >= 0 && st.t >= 0 && c.train_tokens >= 0, path, ": malformed checkpoint metadata: step ", c.step,
              ", adam_t ", st.t, ", train_tokens ", c.train_tokens, " (must not be negative)");
  const size_t nb = task.params.size();
  st.m.assign(nb, {});
  st.v.assign(nb, {});
  for (size_t b = 0; b < nb; ++b) {
    const std::string& p = task.block_names[b];
    auto get = [&](const std::string& n, size_t size) {
      std::vector<float> v = file.to_float(file.tensor(p + n));
      FOCUS_CHECK(v.size() == size, path, ": tensor '", p + n, "' has ", v.size(), " values, expected ", size);
      return v;
    };
    const size_t n = task.params[b]->size();
    // Into the block's own buffer: a task may hold views of it (a model's weights).
    const std::vector<float> v = get("params", n);
    std::copy(v.begin(), v.end(), task.params[b]->begin());
    if (st.t > 0) {
      st.m[b] = get("adam_m", n);
      st.v[b] = get("adam_v", n);
    } else {
      st.m[b].assign(n, 0.f);
      st.v[b].assign(n, 0.f);
    }
  }
  if (task.load_state) {
    try {
      task.load_state(file, meta);
    } catch (const json::exception& e) {
      fail(path, ": malformed checkpoint metadata: ", e.what());
    }
  }
  return c;
}

// Keeps the metrics lines of steps <= step (a resumed run rewrites what came after).
void trim_metrics(const std::string& path, int64_t step) {
  if (!fs::exists(path)) return;
  std::ifstream in(path);
  std::string line, kept;
  while (std::getline(in, line)) {
    try {
      if (json::parse(line).value("step", int64_t(0)) <= step) kept += line + "\n";
    } catch (const json::exception&) {
      // a torn last line from an interrupted write: dropped
    }
  }
  io::write_file_atomic(path, kept);
}

}  // namespace

TrainLoopResult run_train_loop(const TrainOptions& o, const TrainData& d, TrainTask& task) {
  FOCUS_CHECK(task.block_names.size() == task.params.size(), task.name, ": ", task.params.size(),
              " parameter blocks but ", task.block_names.size(), " block names");
  FOCUS_CHECK(task.loss_and_grad && task.validate && task.save_outputs, task.name, ": incomplete training task");
  const char* name = task.name.c_str();
  AdamWState st;
  Checkpoint ck;
  const std::string ckpt_path = (fs::path(o.out) / "checkpoint.safetensors").string();
  const std::string metrics_path = (fs::path(o.out) / "metrics.jsonl").string();
  bool have_before = false;
  if (o.resume && fs::exists(ckpt_path)) {
    ck = load_checkpoint(ckpt_path, task, st);
    have_before = true;
    trim_metrics(metrics_path, ck.step);
    std::fprintf(stderr, "[%s] resuming from %s at step %lld\n", name, ckpt_path.c_str(), (long long)ck.step);
  } else {
    FOCUS_CHECK(!o.resume || !fs::exists(metrics_path), ckpt_path,
                ": --resume given but no checkpoint exists (start without --resume)");
    io::write_file_atomic(metrics_path, "");
  }
  std::ofstream metrics(metrics_path, std::ios::app);
  FOCUS_CHECK(metrics.good(), metrics_path, ": cannot open for writing");
  auto log = [&](const json& j) {
    metrics << j.dump() << "\n";
    metrics.flush();
  };

  TrainLoopResult res;
  if (!have_before) {
    ck.before = task.validate(ValidPhase::Initial, 0, json());
    log({{"step", 0}, {"valid", ck.before}});
  }
  res.before = ck.before;

  std::vector<std::vector<float>> grads(task.params.size());
  Progress bar(task.name, o.steps, "step");
  const auto t0 = std::chrono::steady_clock::now();
  const double seconds_before = ck.seconds;  // time spent by the runs this one resumes
  auto elapsed = [&] {
    return seconds_before + std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  auto last_ckpt = std::chrono::steady_clock::now();
  const int64_t tokens_per_step = o.batch * (o.ctx - 1);
  int64_t step = ck.step;
  const int64_t first_step = ck.step;
  double run_tokens = 0;
  const auto run_start = std::chrono::steady_clock::now();
  while (step < o.steps) {
    if (interrupted() || (o.stop_after > 0 && step - first_step >= o.stop_after)) {
      res.interrupted = true;
      break;
    }
    for (size_t b = 0; b < grads.size(); ++b) grads[b].assign(task.params[b]->size(), 0.f);
    const float loss_scale = 1.0f / (float)tokens_per_step;
    double loss = 0;
    for (int64_t b = 0; b < o.batch; ++b) {
      const Window w =
          make_window(d.train_docs, sample_window(d.train_docs, o.ctx, d.bos, o.seed, step, b), o.ctx, d.bos);
      const TrainWindow tw{w.ids.data(), (int64_t)w.ids.size(), w.targets.data()};
      loss += task.loss_and_grad(tw, loss_scale, grads);
    }
    const float lr = lr_schedule(o.adam.lr, step, o.steps, o.warmup);
    const double gnorm = adamw_step(o.adam, lr, task.params, grads, st, &task.decay);
    if (task.after_step) task.after_step();
    ++step;
    ck.step = step;
    ck.train_tokens += tokens_per_step;
    run_tokens += tokens_per_step;
    const double run_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
    const double train_nll = loss / tokens_per_step;
    json line = {{"step", step},
                 {"loss", train_nll},
                 {"lr", lr},
                 {"grad_norm", gnorm},
                 {"train_tokens", ck.train_tokens},
                 {"seconds", elapsed()},
                 {"tokens_per_s", run_tokens / std::max(run_s, 1e-9)}};
    if (task.step_metrics) task.step_metrics(line);
    log(line);
    if (o.progress) {
      char extra[128];
      std::snprintf(extra, sizeof(extra), "loss %.4f lr %.2e  %.0f tok/s", train_nll, lr,
                    run_tokens / std::max(run_s, 1e-9));
      bar.update(step, extra);
    }
    const bool last = step == o.steps;
    if (!last && o.eval_every > 0 && step % o.eval_every == 0)
      log({{"step", step}, {"valid", task.validate(ValidPhase::Periodic, step, ck.before)}});
    if (!last && std::chrono::duration<double>(std::chrono::steady_clock::now() - last_ckpt).count() >=
                     o.checkpoint_seconds) {
      ck.seconds = elapsed();
      save_checkpoint(ckpt_path, task, st, ck);
      last_ckpt = std::chrono::steady_clock::now();
    }
  }
  if (o.progress) bar.finish();
  res.steps = step;
  res.train_tokens = ck.train_tokens;
  res.seconds = elapsed();
  const double run_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
  res.tokens_per_s = run_tokens > 0 ? run_tokens / run_s : 0;
  ck.seconds = res.seconds;
  save_checkpoint(ckpt_path, task, st, ck);
  task.save_outputs();
  if (res.interrupted) {
    std::fprintf(stderr, "[%s] interrupted at step %lld; checkpoint saved, continue with --resume\n", name,
                 (long long)step);
    return res;
  }
  res.after = task.validate(ValidPhase::Final, step, ck.before);
  log({{"step", step}, {"valid", res.after}, {"final", true}});
  return res;
}

}  // namespace focus
