#include "train/lora.h"

#include <cblas.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/mapped_file.h"
#include "io/safetensors.h"
#include "io/safetensors_writer.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace focus {

const char* lora_target_name(int t) {
  static const char* names[kLoraTargets] = {"q", "k", "v", "o"};
  return t >= 0 && t < kLoraTargets ? names[t] : "?";
}

bool LoraSettings::adapts(int t) const { return targets.find(lora_target_name(t)[0]) != std::string::npos; }

std::string parse_lora_targets(const std::string& s) {
  bool on[kLoraTargets] = {false, false, false, false};
  for (char ch : s) {
    if (ch == ',' || ch == ' ') continue;
    bool known = false;
    for (int t = 0; t < kLoraTargets; ++t)
      if (ch == lora_target_name(t)[0]) on[t] = known = true;
    FOCUS_CHECK(known, "LoRA targets '", s, "': unknown projection '", ch, "' (expected letters of qkvo)");
  }
  std::string out;
  for (int t = 0; t < kLoraTargets; ++t)
    if (on[t]) out += lora_target_name(t);
  FOCUS_CHECK(!out.empty(), "LoRA targets '", s, "': no projection named (expected letters of qkvo)");
  return out;
}

int64_t LoraAdapters::n_params() const {
  int64_t n = 0;
  for (const auto& m : mats) n += m.size();
  return n;
}

int64_t lora_in_dim(const ModelConfig& c, int target) { return target == kLoraO ? c.q_dim() : c.dim; }

int64_t lora_out_dim(const ModelConfig& c, int target) {
  switch (target) {
    case kLoraQ: return c.q_dim();
    case kLoraK:
    case kLoraV: return c.kv_dim();
    default: return c.dim;
  }
}

namespace {

uint64_t mix64(uint64_t x) {  // splitmix64 finaliser
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

void check_settings(const LoraSettings& s, const std::string& where) {
  FOCUS_CHECK(s.rank >= 1 && s.rank <= 4096, where, ": LoRA rank must be in [1, 4096] (got ", s.rank, ")");
  FOCUS_CHECK(std::isfinite(s.alpha) && s.alpha >= 0.f, where, ": LoRA alpha must be positive (got ", s.alpha, ")");
  FOCUS_CHECK(s.targets == parse_lora_targets(s.targets), where, ": LoRA targets '", s.targets,
              "' are not in canonical qkvo order");
}

LoraMatrix make_matrix(const ModelConfig& c, int64_t layer, int target, int64_t rank) {
  LoraMatrix m;
  m.layer = layer;
  m.target = target;
  m.rank = rank;
  m.in = lora_in_dim(c, target);
  m.out = lora_out_dim(c, target);
  m.params.assign(m.size(), 0.f);
  return m;
}

Weight* proj_ptr(LayerWeights& L, int target) {
  switch (target) {
    case kLoraQ: return &L.wq;
    case kLoraK: return &L.wk;
    case kLoraV: return &L.wv;
    default: return &L.wo;
  }
}

void check_fits(const ModelConfig& c, const LoraAdapters& a) {
  FOCUS_CHECK((int64_t)a.index.size() == c.layers, "LoRA adapters made for ", a.index.size(),
              " layers; the model has ", c.layers);
  for (const auto& m : a.mats)
    FOCUS_CHECK(m.layer >= 0 && m.layer < c.layers && m.in == lora_in_dim(c, m.target) &&
                    m.out == lora_out_dim(c, m.target) && m.rank == a.settings.rank &&
                    (int64_t)m.params.size() == m.size(),
                "LoRA adapter layers.", m.layer, ".", lora_target_name(m.target), " does not fit the model (",
                m.out, " x ", m.in, " at rank ", m.rank, ")");
}

}  // namespace

LoraAdapters lora_init(const ModelConfig& c, const LoraSettings& s, uint64_t seed) {
  check_settings(s, "lora");
  FOCUS_CHECK(!c.mla(), "lora: adapters on latent attention (DeepSeek-V2) projections are not supported");
  LoraAdapters a;
  a.settings = s;
  a.index.assign(c.layers, {-1, -1, -1, -1});
  for (int64_t l = 0; l < c.layers; ++l)
    for (int t = 0; t < kLoraTargets; ++t) {
      if (!s.adapts(t)) continue;
      LoraMatrix m = make_matrix(c, l, t, s.rank);
      // A ~ U(-1/sqrt(in), 1/sqrt(in)) from a counter-based stream per (seed, layer, target).
      const double bound = 1.0 / std::sqrt((double)m.in);
      const uint64_t base = mix64(mix64(seed) ^ mix64((uint64_t)l * 8 + (uint64_t)t));
      float* A = m.a();
      for (int64_t i = 0; i < m.rank * m.in; ++i) {
        const double u = (double)(mix64(base + (uint64_t)i) >> 11) * (1.0 / 9007199254740992.0);  // [0, 1)
        A[i] = (float)((2.0 * u - 1.0) * bound);
      }
      a.index[l][t] = (int64_t)a.mats.size();
      a.mats.push_back(std::move(m));
    }
  return a;
}

void save_lora(const LoraAdapters& a, const std::string& dir, const ModelConfig& c, const std::string& model_path) {
  check_fits(c, a);
  std::error_code ec;
  fs::create_directories(dir, ec);
  FOCUS_CHECK(!ec, dir, ": cannot create folder: ", ec.message());
  std::map<std::string, io::F32Tensor> t;
  json layers = json::array();
  for (int64_t l = 0; l < c.layers; ++l) {
    bool any = false;
    for (int tg = 0; tg < kLoraTargets; ++tg) {
      const LoraMatrix* m = a.find(l, tg);
      if (!m) continue;
      any = true;
      const std::string p = "layers." + std::to_string(l) + "." + lora_target_name(tg) + ".";
      t[p + "lora_a"] = {{m->rank, m->in}, std::vector<float>(m->a(), m->a() + m->rank * m->in)};
      t[p + "lora_b"] = {{m->out, m->rank}, std::vector<float>(m->b(), m->b() + m->out * m->rank)};
    }
    if (any) layers.push_back(l);
  }
  io::save_safetensors((fs::path(dir) / "lora.safetensors").string(), t, {{"format", "focus-lora"}});
  const LoraSettings& s = a.settings;
  json j = {{"format", "focus-lora"},
            {"version", 1},
            {"model", model_path},
            {"model_dim", c.dim},
            {"model_layers", c.layers},
            {"model_q_dim", c.q_dim()},
            {"model_kv_dim", c.kv_dim()},
            {"rank", s.rank},
            {"alpha", s.alpha_or_default()},
            {"scale", s.scale()},
            {"targets", s.targets},
            {"layers", layers}};
  io::write_file_atomic((fs::path(dir) / "lora.json").string(), j.dump(2) + "\n");
}

namespace {
// An integer of lora.json (a float there would be converted without a range check).
int64_t int_value(const json& v, const char* key, const std::string& path) {
  FOCUS_CHECK(v.is_number_integer(), path, ": '", key, "' must be an integer (got ", v.dump(), ")");
  return v.get<int64_t>();
}
}  // namespace

LoraAdapters load_lora(const std::string& dir, const ModelConfig& c) {
  const std::string jp = (fs::path(dir) / "lora.json").string();
  const std::string sp = (fs::path(dir) / "lora.safetensors").string();
  FOCUS_CHECK(fs::is_directory(dir), dir, ": not a LoRA folder (expected lora.json and lora.safetensors)");
  FOCUS_CHECK(!c.mla(), dir, ": adapters on latent attention (DeepSeek-V2) projections are not supported");
  json j;
  try {
    j = json::parse(read_file(jp));
  } catch (const json::exception& e) {
    fail(jp, ": invalid JSON: ", e.what());
  }
  FOCUS_CHECK(j.is_object() && j.contains("format") && j["format"] == "focus-lora", jp, ": not a focus LoRA config");
  LoraSettings s;
  std::vector<int64_t> layers;
  try {
    s.rank = int_value(j.at("rank"), "rank", jp);
    s.alpha = j.at("alpha").get<float>();
    const std::string tg = j.at("targets").get<std::string>();
    try {
      s.targets = parse_lora_targets(tg);
    } catch (const Error& e) {
      fail(jp, ": ", e.what());
    }
    const int64_t dim = int_value(j.at("model_dim"), "model_dim", jp), nl = int_value(j.at("model_layers"), "model_layers", jp);
    const int64_t qd = j.contains("model_q_dim") ? int_value(j["model_q_dim"], "model_q_dim", jp) : c.q_dim();
    const int64_t kd = j.contains("model_kv_dim") ? int_value(j["model_kv_dim"], "model_kv_dim", jp) : c.kv_dim();
    FOCUS_CHECK(dim == c.dim && nl == c.layers && qd == c.q_dim() && kd == c.kv_dim(), jp,
                ": adapters were made for a model with dim ", dim, ", ", nl, " layers, q width ", qd,
                ", kv width ", kd, "; this model has dim ", c.dim, ", ", c.layers, " layers, q width ", c.q_dim(),
                ", kv width ", c.kv_dim());
    FOCUS_CHECK(j.at("layers").is_array(), jp, ": 'layers' must be an array of layer ids");
    for (const json& l : j["layers"]) layers.push_back(int_value(l, "layers", jp));
  } catch (const json::exception& e) {
    fail(jp, ": missing or malformed field: ", e.what());
  }
  FOCUS_CHECK(s.alpha > 0.f, jp, ": LoRA alpha must be positive (got ", s.alpha, ")");
  check_settings(s, jp);
  io::SafetensorsFile st(sp);
  LoraAdapters a;
  a.settings = s;
  a.index.assign(c.layers, {-1, -1, -1, -1});
  for (int64_t l : layers) {
    FOCUS_CHECK(l >= 0 && l < c.layers, jp, ": layer ", l, " out of range (the model has ", c.layers, ")");
    FOCUS_CHECK(a.index[l][0] < 0 && a.index[l][1] < 0 && a.index[l][2] < 0 && a.index[l][3] < 0, jp, ": layer ", l,
                " listed twice");
    for (int tg = 0; tg < kLoraTargets; ++tg) {
      if (!s.adapts(tg)) continue;
      LoraMatrix m = make_matrix(c, l, tg, s.rank);
      const std::string p = "layers." + std::to_string(l) + "." + lora_target_name(tg) + ".";
      auto take = [&](const std::string& name, const std::vector<int64_t>& shape, float* dst) {
        const io::STTensor* t = st.find(p + name);
        FOCUS_CHECK(t, sp, ": tensor '", p + name, "' is missing");
        FOCUS_CHECK(t->shape == shape, sp, ": tensor '", p + name, "' has shape ", json(t->shape).dump(),
                    ", expected ", json(shape).dump(), " for this model at rank ", s.rank);
        const std::vector<float> v = st.to_float(*t);
        for (float x : v) FOCUS_CHECK(std::isfinite(x), sp, ": tensor '", p + name, "' holds NaN or Inf");
        std::copy(v.begin(), v.end(), dst);
      };
      take("lora_a", {m.rank, m.in}, m.a());
      take("lora_b", {m.out, m.rank}, m.b());
      a.index[l][tg] = (int64_t)a.mats.size();
      a.mats.push_back(std::move(m));
    }
  }
  return a;
}

std::vector<float> lora_merged(const float* W, const LoraMatrix& a, float scale) {
  std::vector<float> out(W, W + a.out * a.in);
  // out [out, in] += scale * B [out, r] A [r, in]
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)a.out, (int)a.in, (int)a.rank, scale, a.b(),
              (int)a.rank, a.a(), (int)a.in, 1.0f, out.data(), (int)a.in);
  return out;
}

void apply_lora(Model& m, const LoraAdapters& a) {
  check_fits(m.cfg, a);
  const float s = a.settings.scale();
  for (const auto& mat : a.mats) {
    Weight* w = proj_ptr(m.w.layers[mat.layer], mat.target);
    FOCUS_CHECK(*w, m.path, ": layer ", mat.layer, " has no ", lora_target_name(mat.target), " projection to adapt");
    // Merged in float32 (whatever the weight's type): the adapter's update is not quantised.
    const std::vector<float> base = dequantize_all(*w);
    *w = Weight::f32(m.w.keep(lora_merged(base.data(), mat, s)), w->rows, w->cols);
  }
}

Model lora_merged_view(const Model& m, const LoraAdapters& a) {
  Model v;
  v.cfg = m.cfg;
  v.path = m.path;
  v.format = m.format;
  v.w.tok_emb = m.w.tok_emb;
  v.w.pos_emb = m.w.pos_emb;
  v.w.out_norm = m.w.out_norm;
  v.w.out_norm_b = m.w.out_norm_b;
  v.w.lm_head = m.w.lm_head;
  v.w.layers = m.w.layers;
  v.w.n_params = m.w.n_params;
  v.w.tensor_types = m.w.tensor_types;
  v.w.weights_mode = m.w.weights_mode;
  v.w.owners = m.w.owners;
  apply_lora(v, a);
  return v;
}

void load_and_apply_lora(Model& m, const std::string& dir) { apply_lora(m, load_lora(dir, m.cfg)); }

}  // namespace focus
