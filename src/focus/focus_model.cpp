#include "focus/focus_model.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/mapped_file.h"
#include "focus/block_budget.h"
#include "io/safetensors.h"
#include "io/safetensors_writer.h"

namespace fs = std::filesystem;

namespace focus {

FocusMode parse_focus_mode(const std::string& s) {
  if (s == "off") return FocusMode::Off;
  if (s == "soft") return FocusMode::Soft;
  if (s == "hard") return FocusMode::Hard;
  if (s == "window") return FocusMode::Window;
  fail("unknown Focus mode '", s, "' (expected soft, hard, window or off)");
}

std::string to_string(FocusMode m) {
  switch (m) {
    case FocusMode::Off: return "off";
    case FocusMode::Soft: return "soft";
    case FocusMode::Hard: return "hard";
    case FocusMode::Window: return "window";
  }
  return "?";
}

float FocusRouters::layer_far_mass(int64_t r) const {
  if (r < 0 || r + routers_per_layer > (int64_t)far_mass.size()) return -1.f;
  double sum = 0;
  for (int64_t i = 0; i < routers_per_layer; ++i) sum += far_mass[r + i];
  return (float)(sum / (double)routers_per_layer);
}

int FocusRouters::layer_topk(int64_t r) const {
  const float m = layer_far_mass(r);
  if (!settings.topk_by_mass || !settings.asymmetric || m < 0) return settings.topk;
  double sum = 0;
  int64_t n = 0;
  for (size_t l = 0; l < router_of_layer.size(); ++l) {
    const int64_t r0 = router_of_layer[l];
    if (r0 < 0 || window_only(r0) || stays_dense(r0)) continue;
    sum += layer_far_mass(r0);
    ++n;
  }
  if (n == 0 || sum <= 0) return settings.topk;
  const double k = std::round((double)settings.topk * m / (sum / (double)n));
  return (int)std::clamp<double>(k, 1.0, (double)settings.groups);
}

int64_t FocusRouters::n_params() const {
  int64_t n = 0;
  for (const auto& r : routers) n += r.size();
  return n;
}

namespace {
void check_settings(const FocusSettings& s, const ModelConfig& c, const std::string& where) {
  FOCUS_CHECK(s.local_window >= 1, where, ": Focus window must be >= 1 (got ", s.local_window, ")");
  FOCUS_CHECK(s.sinks >= 0, where, ": sinks must be >= 0");
  FOCUS_CHECK(s.groups >= 1 && s.groups <= 4096, where, ": groups must be in [1, 4096] (got ", s.groups, ")");
  FOCUS_CHECK(!s.route_on_qk || s.asymmetric, where, ": routing on queries and keys needs asymmetric routing");
  FOCUS_CHECK(s.dg >= 1 && s.dg <= router_input_dim(c, s), where, ": d_g must be in [1, ", router_input_dim(c, s),
              "] (got ", s.dg, ")");
  FOCUS_CHECK(s.topk >= 1 && (s.asymmetric || s.topk <= 2), where, ": top-k must be ",
              s.asymmetric ? "at least 1" : "1 or 2 (symmetric routing)", " (got ", s.topk, ")");
  FOCUS_CHECK(s.topk <= s.groups, where, ": top-k exceeds the number of groups");
  FOCUS_CHECK(s.topp == 0.f || (s.topp > 0.f && s.topp <= 1.f && s.asymmetric), where,
              ": top-p must be in (0, 1] and needs asymmetric routing (got ", s.topp, ")");
  FOCUS_CHECK(!s.asymmetric || (s.key_capacity >= 1.f && std::isfinite(s.key_capacity)), where,
              ": key_capacity must be >= 1 (got ", s.key_capacity, ")");
  FOCUS_CHECK(s.window_only_below >= 0.f && s.window_only_below <= 1.f, where,
              ": window_only_below must be in [0, 1] (got ", s.window_only_below, ")");
  FOCUS_CHECK(!s.per_kv_head || s.asymmetric, where, ": routers per kv head need asymmetric routing");
  FOCUS_CHECK(!s.per_head || s.asymmetric, where, ": routers per query head need asymmetric routing");
  FOCUS_CHECK(!(s.per_head && s.per_kv_head), where, ": routers per query head or per kv head, not both");
  FOCUS_CHECK(s.dense_above >= 0.f && s.dense_above <= 1.f, where, ": dense_above must be in [0, 1] (got ",
              s.dense_above, ")");
  FOCUS_CHECK(s.tau > 0 && std::isfinite(s.tau), where, ": temperature must be positive");
  FOCUS_CHECK(s.blocks >= 0 && s.blocks <= (1 << 20) && (s.blocks == 0 || s.asymmetric), where,
              ": blocks must be >= 0 and needs asymmetric routing (got ", s.blocks, ")");
  FOCUS_CHECK(s.block_size >= 1 && s.block_size <= (1 << 20), where, ": block_size must be in [1, 2^20] (got ",
              s.block_size, ")");
  FOCUS_CHECK(s.block_select_every >= 1 && s.block_select_every <= (1 << 20), where,
              ": block_select_every must be in [1, 2^20] (got ", s.block_select_every, ")");
  FOCUS_CHECK(!s.group_bias || (s.asymmetric && s.blocks == 0 && s.topp == 0.f && !s.route_on_qk), where,
              ": group weights need asymmetric routers reading the hidden state, with top-k groups and no blocks");
  FOCUS_CHECK(!s.far_bias || (s.asymmetric && s.topp == 0.f && !s.route_on_qk), where,
              ": far-pair terms need asymmetric routers reading the hidden state, with top-k groups");
}
}  // namespace

namespace {
// Tensor name prefix of router h of layer l: "layers.L." (one router per layer), "layers.L.kv_head.H."
// or "layers.L.head.H.".
std::string router_prefix(int64_t l, int64_t h, const FocusSettings& s) {
  std::string p = "layers." + std::to_string(l) + ".";
  if (s.per_kv_head) p += "kv_head." + std::to_string(h) + ".";
  if (s.per_head) p += "head." + std::to_string(h) + ".";
  return p;
}

int64_t routers_per_layer(const ModelConfig& c, const FocusSettings& s) {
  return s.per_head ? c.heads : s.per_kv_head ? c.kv_heads : 1;
}

// The shape of every router of a model under these settings.
RouterConfig router_config(const ModelConfig& c, const FocusSettings& s) {
  RouterConfig rc;
  rc.dim = router_input_dim(c, s);
  rc.d_g = s.dg;
  rc.groups = s.groups;
  rc.tau = s.tau;
  rc.learn_tau = s.learn_tau;
  rc.key_proj = s.asymmetric;
  rc.far_bias = s.far_bias;
  return rc;
}
}  // namespace

int64_t router_input_dim(const ModelConfig& c, const FocusSettings& s) {
  return s.route_on_qk ? c.head_dim : c.dim;
}

FocusRouters focus_init(const ModelConfig& c, const FocusSettings& s, uint64_t seed) {
  check_settings(s, c, "focus");
  FocusRouters f;
  f.settings = s;
  f.router_of_layer.assign(c.layers, -1);
  f.routers_per_layer = routers_per_layer(c, s);
  for (int64_t l = 0; l < c.layers; ++l) {
    if (c.layer_sliding_window[l] > 0) continue;  // a sliding-window layer is already local
    f.router_of_layer[l] = (int64_t)f.routers.size();
    for (int64_t h = 0; h < f.routers_per_layer; ++h)
      f.routers.push_back(router_init(router_config(c, s), seed * 1000003ull + (uint64_t)l + 7919ull * (uint64_t)h));
  }
  return f;
}

void save_focus(const FocusRouters& f, const std::string& dir, const ModelConfig& c, const std::string& model_path) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  FOCUS_CHECK(!ec, dir, ": cannot create folder: ", ec.message());
  std::map<std::string, io::F32Tensor> t;
  nlohmann::json layers = nlohmann::json::array();
  for (int64_t l = 0; l < c.layers; ++l) {
    const int64_t r0 = f.router_of_layer[l];
    if (r0 < 0) continue;
    layers.push_back(l);
    for (int64_t h = 0; h < f.routers_per_layer; ++h) {
      const RouterParams& r = f.routers[r0 + h];
      const std::string p = router_prefix(l, h, f.settings);
      const int64_t dg = r.cfg.d_g, D = r.cfg.dim, G = r.cfg.groups;
      t[p + "w_r"] = {{dg, D}, std::vector<float>(r.w_r(), r.w_r() + dg * D)};
      t[p + "centroids"] = {{G, dg}, std::vector<float>(r.centroids(), r.centroids() + G * dg)};
      t[p + "bias"] = {{G}, r.bias};
      t[p + "log_tau"] = {{1}, {std::log(r.tau())}};
      if (r.cfg.key_proj) t[p + "w_k"] = {{dg, D}, std::vector<float>(r.w_k(), r.w_k() + dg * D)};
      if (r.cfg.far_bias)
        for (RouterSide side : {RouterSide::Query, RouterSide::Key}) {
          const float* e = r.params.data() + r.far_offset(side);
          t[p + (side == RouterSide::Key ? "far_k" : "far_q")] = {{D + 1}, std::vector<float>(e, e + D + 1)};
        }
    }
  }
  io::save_safetensors((fs::path(dir) / "router.safetensors").string(), t, {{"format", "focus-router"}});
  const FocusSettings& s = f.settings;
  nlohmann::json j = {{"format", "focus-router"},
                      {"version", 1},
                      {"model", model_path},
                      {"model_dim", c.dim},
                      {"model_layers", c.layers},
                      {"window", s.local_window},
                      {"sinks", s.sinks},
                      {"groups", s.groups},
                      {"dg", s.dg},
                      {"topk", s.topk},
                      {"tau", s.tau},
                      {"learn_tau", s.learn_tau},
                      {"eps", s.eps},
                      {"mode", to_string(s.mode)},
                      {"routing", s.asymmetric ? "asymmetric" : "symmetric"},
                      {"layers", layers}};
  if (s.asymmetric) j["key_capacity"] = s.key_capacity;
  if (s.per_kv_head) j["per_kv_head"] = true;
  if (s.per_head) j["per_head"] = true;
  if (s.route_on_qk) j["input"] = "qk";
  if (s.topk_by_mass) j["topk_by_mass"] = true;
  if (s.topp > 0) j["topp"] = s.topp;
  if (s.group_bias) j["group_bias"] = true;
  if (s.far_bias) j["far_bias"] = true;
  if (s.blocks > 0) {
    j["blocks"] = s.blocks;
    j["block_size"] = s.block_size;
    if (s.block_select_every != 1) j["block_select_every"] = s.block_select_every;
  }
  if (!f.far_mass.empty()) j["far_mass"] = f.far_mass;
  if (!f.block_budget.empty()) j["block_budget"] = f.block_budget;
  if (!f.block_near.empty()) j["block_near"] = f.block_near;
  if (!f.block_group.empty()) j["block_group"] = f.block_group;
  if (s.window_only_below > 0) j["window_only_below"] = s.window_only_below;
  if (s.dense_above < 1) j["dense_above"] = s.dense_above;
  io::write_file_atomic((fs::path(dir) / "focus.json").string(), j.dump(2) + "\n");
}

namespace {

// The parsed and checked focus.json of a router folder.
struct FocusConfigFile {
  FocusSettings settings;
  nlohmann::json json;
  std::string path;  // the focus.json it came from, for error messages
};

// An integer field of focus.json (a float there would be converted without a range check).
int64_t int_field(const nlohmann::json& j, const char* key, const std::string& path) {
  const nlohmann::json& v = j.at(key);
  FOCUS_CHECK(v.is_number_integer(), path, ": '", key, "' must be an integer (got ", v.dump(), ")");
  return v.get<int64_t>();
}

FocusConfigFile read_focus_config(const std::string& dir, const ModelConfig& c) {
  const std::string jp = (fs::path(dir) / "focus.json").string();
  FOCUS_CHECK(fs::is_directory(dir), dir, ": not a router folder (expected focus.json and router.safetensors)");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(jp));
  } catch (const nlohmann::json::exception& e) {
    fail(jp, ": invalid JSON: ", e.what());
  }
  FOCUS_CHECK(j.is_object() && j.contains("format") && j["format"] == "focus-router", jp,
              ": not a focus router config");
  FocusSettings s;
  try {
    s.local_window = int_field(j, "window", jp);
    s.sinks = int_field(j, "sinks", jp);
    s.groups = int_field(j, "groups", jp);
    s.dg = int_field(j, "dg", jp);
    s.topk = j.contains("topk") ? (int)std::clamp<int64_t>(int_field(j, "topk", jp), -1, 1 << 20) : 1;
    s.tau = j.value("tau", 0.1f);
    s.eps = j.value("eps", 1e-6f);
    s.learn_tau = j.value("learn_tau", false);
    s.mode = parse_focus_mode(j.value("mode", std::string("soft")));
    const std::string routing = j.value("routing", std::string("symmetric"));
    FOCUS_CHECK(routing == "symmetric" || routing == "asymmetric", jp, ": unknown routing '", routing,
                "' (expected symmetric or asymmetric)");
    s.asymmetric = routing == "asymmetric";
    s.key_capacity = j.value("key_capacity", 1.5f);
    s.window_only_below = j.value("window_only_below", 0.f);
    s.per_kv_head = j.value("per_kv_head", false);
    s.per_head = j.value("per_head", false);
    const std::string input = j.value("input", std::string("hidden"));
    FOCUS_CHECK(input == "hidden" || input == "qk", jp, ": unknown router input '", input, "' (expected hidden or qk)");
    s.route_on_qk = input == "qk";
    s.topk_by_mass = j.value("topk_by_mass", false);
    s.topp = j.value("topp", 0.f);
    s.group_bias = j.value("group_bias", false);
    s.far_bias = j.value("far_bias", false);
    s.dense_above = j.value("dense_above", 1.f);
    if (j.contains("blocks")) s.blocks = int_field(j, "blocks", jp);
    if (j.contains("block_size")) s.block_size = int_field(j, "block_size", jp);
    if (j.contains("block_select_every")) s.block_select_every = int_field(j, "block_select_every", jp);
    FOCUS_CHECK(int_field(j, "model_dim", jp) == c.dim && int_field(j, "model_layers", jp) == c.layers, jp,
                ": routers were made for a model with dim ", j.at("model_dim"), " and ", j.at("model_layers"),
                " layers; this model has dim ", c.dim, " and ", c.layers, " layers");
  } catch (const nlohmann::json::exception& e) {
    fail(jp, ": missing or malformed field: ", e.what());
  }
  check_settings(s, c, jp);
  return {s, std::move(j), jp};
}

}  // namespace

FocusSettings load_focus_settings(const std::string& dir, const ModelConfig& c) {
  return read_focus_config(dir, c).settings;
}

FocusRouters load_focus(const std::string& dir, const ModelConfig& c) {
  const FocusConfigFile cf = read_focus_config(dir, c);
  const FocusSettings& s = cf.settings;
  const nlohmann::json& j = cf.json;
  const std::string& jp = cf.path;
  const std::string sp = (fs::path(dir) / "router.safetensors").string();
  io::SafetensorsFile st(sp);
  FocusRouters f;
  f.settings = s;
  f.router_of_layer.assign(c.layers, -1);
  f.routers_per_layer = routers_per_layer(c, s);
  FOCUS_CHECK(j.contains("layers") && j["layers"].is_array(), jp, ": 'layers' must be an array of layer ids");
  for (const auto& lv : j["layers"]) {
    FOCUS_CHECK(lv.is_number_integer(), jp, ": layer id ", lv.dump(), " is not an integer");
    const int64_t l = lv.get<int64_t>();
    FOCUS_CHECK(l >= 0 && l < c.layers, jp, ": layer ", l, " out of range");
    FOCUS_CHECK(f.router_of_layer[l] < 0, jp, ": layer ", l, " is listed twice");
    // Inference routes only global layers (forward() skips the others): a router on a
    // sliding-window layer would be trained but never used.
    FOCUS_CHECK(c.layer_sliding_window[l] == 0, jp, ": layer ", l, " is a sliding-window layer (window ",
                c.layer_sliding_window[l], "); routers belong on global attention layers only");
    f.router_of_layer[l] = (int64_t)f.routers.size();
    for (int64_t h = 0; h < f.routers_per_layer; ++h) {
      const std::string p = router_prefix(l, h, s);
      RouterParams r = router_init(router_config(c, s), 0);
      auto take = [&](const std::string& name, std::vector<int64_t> shape) {
        const io::STTensor& t = st.tensor(p + name);
        FOCUS_CHECK(t.shape == shape, sp, ": tensor '", p + name, "' has the wrong shape for this config");
        std::vector<float> v = st.to_float(t);
        for (float x : v) FOCUS_CHECK(std::isfinite(x), sp, ": tensor '", p + name, "' holds NaN or Inf");
        return v;
      };
      const int64_t in = router_input_dim(c, s);
      auto wr = take("w_r", {s.dg, in});
      auto cc = take("centroids", {s.groups, s.dg});
      std::copy(wr.begin(), wr.end(), r.w_r());
      std::copy(cc.begin(), cc.end(), r.centroids());
      if (s.asymmetric) {
        auto wk = take("w_k", {s.dg, in});
        std::copy(wk.begin(), wk.end(), r.w_k());
      }
      if (s.far_bias)
        for (RouterSide side : {RouterSide::Query, RouterSide::Key}) {
          auto e = take(side == RouterSide::Key ? "far_k" : "far_q", {in + 1});
          std::copy(e.begin(), e.end(), r.params.begin() + r.far_offset(side));
        }
      r.bias = take("bias", {s.groups});
      auto lt = take("log_tau", {1});
      if (s.learn_tau) r.params[r.log_tau_offset()] = lt[0];
      f.routers.push_back(std::move(r));
    }
  }
  if (j.contains("far_mass")) {
    try {
      f.far_mass = j["far_mass"].get<std::vector<float>>();
    } catch (const nlohmann::json::exception& e) {
      fail(jp, ": 'far_mass' must be an array of numbers: ", e.what());
    }
    FOCUS_CHECK(f.far_mass.size() == f.routers.size(), jp, ": 'far_mass' has ", f.far_mass.size(),
                " entries for ", f.routers.size(), " routers");
    for (float x : f.far_mass) FOCUS_CHECK(std::isfinite(x) && x >= 0 && x <= 1.001f, jp, ": far_mass ", x, " is not in [0, 1]");
  }
  if (j.contains("block_budget")) {
    std::vector<std::vector<int64_t>> k = per_layer_counts(j["block_budget"], jp, "block_budget");
    std::vector<std::vector<int64_t>> near;
    std::vector<std::vector<int64_t>> group;
    if (j.contains("block_near")) near = per_layer_counts(j["block_near"], jp, "block_near");
    if (j.contains("block_group")) group = per_layer_counts(j["block_group"], jp, "block_group");
    set_block_budget(f, c, std::move(k), jp, std::move(near), std::move(group));
  } else {
    FOCUS_CHECK(!j.contains("block_near"), jp, ": 'block_near' without 'block_budget'");
    FOCUS_CHECK(!j.contains("block_group"), jp, ": 'block_group' without 'block_budget'");
  }
  return f;
}

void set_block_budget(FocusRouters& f, const ModelConfig& c, std::vector<std::vector<int64_t>> k,
                      const std::string& where, std::vector<std::vector<int64_t>> near,
                      std::vector<std::vector<int64_t>> group) {
  FOCUS_CHECK(f.settings.asymmetric && !f.settings.group_bias, where,
              ": block budgets need asymmetric routers without group weights");
  FOCUS_CHECK((int64_t)k.size() == c.layers, where, ": block budgets for ", k.size(), " layers, the model has ",
              c.layers);
  int64_t top = 0;
  for (int64_t l = 0; l < c.layers; ++l) {
    const bool routed = l < (int64_t)f.router_of_layer.size() && f.router_of_layer[l] >= 0;
    FOCUS_CHECK(k[l].empty() || (int64_t)k[l].size() == c.heads, where, ": layer ", l, " has ", k[l].size(),
                " block budgets, the model has ", c.heads, " heads");
    FOCUS_CHECK(!routed || !k[l].empty(), where, ": routed layer ", l, " has no block budget");
    FOCUS_CHECK(near.empty() || near[l].size() == k[l].size(), where, ": layer ", l, " has ", near.empty() ? 0 : near[l].size(),
                " near counts and ", k[l].size(), " block budgets");
    FOCUS_CHECK(group.empty() || group[l].size() == k[l].size(), where, ": layer ", l, " has ",
                group.empty() ? 0 : group[l].size(), " group switches and ", k[l].size(), " block budgets");
    if (!group.empty())
      for (int64_t x : group[l])
        FOCUS_CHECK(x == 0 || x == 1, where, ": group switch ", x, " of layer ", l,
                    " is neither 1 (the head reads its groups) nor 0 (blocks alone)");
    for (size_t h = 0; h < k[l].size(); ++h) {
      const int64_t x = k[l][h], n = near.empty() ? 0 : near[l][h];
      FOCUS_CHECK(x >= 0 && x <= (1 << 20), where, ": block budget ", x, " of layer ", l, " is out of range");
      FOCUS_CHECK(n >= 0 && n <= (1 << 20), where, ": near count ", n, " of layer ", l, " is out of range");
      top = std::max(top, x + n);
    }
  }
  FOCUS_CHECK(near.empty() || near.size() == k.size(), where, ": near counts for ", near.size(), " layers, budgets for ",
              k.size());
  FOCUS_CHECK(group.empty() || group.size() == k.size(), where, ": group switches for ", group.size(),
              " layers, budgets for ", k.size());
  FOCUS_CHECK(near.empty() || f.settings.block_select_every == 1, where,
              ": near blocks need blocks chosen on every row (block_select_every 1)");
  f.block_budget = std::move(k);
  f.block_near = std::move(near);
  f.block_group = std::move(group);
  // The hybrid runs even when every budget is 0: each head then reads the block of its last far key.
  f.settings.blocks = std::max<int64_t>(1, top);
}

}  // namespace focus
