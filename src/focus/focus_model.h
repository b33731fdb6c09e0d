// Focus on a whole model: one router per attention layer that sees the full context, the
// settings that shape the pattern, and how they are saved (safetensors + focus.json) and loaded.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "focus/router.h"
#include "model/config.h"

namespace focus {

struct BlockMassCurves;

// Off: plain attention. Soft: the training form (log-bias). Hard: top-k sparse (inference).
// Window: local window and sinks only, no groups (the sliding-window baseline; routers unused).
enum class FocusMode { Off, Soft, Hard, Window };
FocusMode parse_focus_mode(const std::string& s);  // "off" | "soft" | "hard" | "window"
std::string to_string(FocusMode m);

struct FocusSettings {
  FocusMode mode = FocusMode::Soft;
  int64_t local_window = 64;  // w: pairs with i - j < w always attend (focus.json: "window")
  int64_t sinks = 1;       // the first S positions are visible to every token
  int64_t groups = 16;     // G
  int64_t dg = 16;         // routing dimension d_g
  int topk = 1;            // hard mode: groups kept per token
  float tau = 0.1f;        // router temperature (the initial value when learned)
  bool learn_tau = false;  // train each router's temperature (log tau) with its other parameters
  float eps = 1e-6f;       // soft mode: bias = log(sum_g p_ig p_jg + eps)
  // Asymmetric routing (focus.json "routing": "asymmetric"): each key belongs to one group (its
  // best group by W_k with room left: at most key_capacity times the mean load of the keys before
  // it, a causal balance), each query reads its top-k groups by W_r (k in [1, G]). Hard mode only;
  // trained by distillation (train/retrofit.h). Symmetric routing is the paper's same-group rule.
  bool asymmetric = false;
  float key_capacity = 1.5f;
  // Asymmetric routing per kv head (focus.json "per_kv_head"): each layer has one router per kv
  // head, which routes that head's keys and the queries of its query heads.
  bool per_kv_head = false;
  // Asymmetric routing per query head (focus.json "per_head"): one router per query head, which
  // routes the keys of that head's kv head (a kv head shared by several query heads is routed once
  // per router) and that head's queries.
  bool per_head = false;
  // Asymmetric routers that read the attention's own vectors (focus.json "input": "qk") instead of
  // the block's normed input: keys are routed from their rotated key vector (of the router's kv
  // head, or the mean over kv heads), queries from the mean of the rotated query vectors of the
  // router's query heads. Router width: head_dim.
  bool route_on_qk = false;
  // Per-layer choice: a router layer whose measured far attention mass (FocusRouters::far_mass)
  // is below this runs the window + sinks pattern alone in hard mode (0: every layer routes).
  float window_only_below = 0.f;
  // ... and one whose far mass is above this keeps the model's dense attention (1: none does).
  float dense_above = 1.f;
  // Asymmetric hard mode: spread the queries' groups over the layers by measured far mass,
  // k_l = round(topk * far_l / mean far) in [1, G] (the mean over the layers that route), so
  // layers that attend far read more groups and the others fewer, at about the same mean k.
  bool topk_by_mass = false;
  // Asymmetric hard mode, adaptive: a query reads its best groups (by the router's softmax) until
  // they hold this share of its softmax mass, at most topk of them (0: exactly topk). A query whose
  // router is sure reads one group, an unsure one several (focus.json "topp").
  float topp = 0.f;
  // Asymmetric hard mode with group weights (focus.json "group_bias"): a far pair (i, j) that the
  // pattern keeps, key j in group g read by query i, gets the additive logit bias
  // log(p_i(g) / max p_i) + log(pk_j(g) / max pk_j), with p_i and pk_j the softmax of the query's and
  // the key's router scores (plus the balancing bias): the soft mode's kind of bias restricted to
  // the pairs the hard pattern reads, zero for a query's best group and a key in its best group.
  // The set of pairs read is the hard pattern's; it runs on whole windows from position 0 (the
  // grouped kernels have no per-group weights). Trained by retrofit --objective sparse --group-bias.
  bool group_bias = false;
  // Asymmetric hard mode with far-pair terms (focus.json "far_bias"): a far pair (i, j) that the
  // pattern keeps gets the additive logit term e_q(i) + e_k(j), each linear in the router's input
  // (router_far_bias): a learned per-query and per-key weighting of the far keys read, zero at
  // initialisation (training starts from the unweighted pattern). Same pairs as without it; whole
  // windows from position 0, like group_bias. Trained by retrofit --objective sparse --far-bias.
  bool far_bias = false;
  // Asymmetric hard mode, the hybrid pattern (focus.json "blocks", "block_size"): besides its
  // groups, each query head reads positional blocks of block_size keys beyond its window, as block
  // top-k does (baselines: focus/block_topk.h): the block of its last far key and the `blocks`
  // complete blocks with the largest Quest bound of q.k. Groups catch content far back, blocks
  // the recent-but-not-local attention that content groups miss. 0: groups only.
  int64_t blocks = 0;
  int64_t block_size = 64;
  // The blocks chosen once every this many rows, by each tile's first row (focus.json
  // "block_select_every", BlockTopKSettings::select_every); 1: every row chooses its own.
  int64_t block_select_every = 1;
  // Per query head of one layer, its own number of blocks in place of `blocks` (set per layer
  // from FocusRouters::block_budget when the plan is made; empty: every head reads `blocks`).
  std::vector<int64_t> block_head_k;
  // Per query head of one layer, the near blocks it reads besides those (BlockTopKSettings::
  // head_near; from FocusRouters::block_near); empty: none.
  std::vector<int64_t> block_head_near;
  // Per query head of one layer, whether it reads its groups (the group switch: 0 = blocks, window
  // and sinks only; from FocusRouters::block_group); empty: every head reads them.
  std::vector<int64_t> block_head_group;
  // Calibrating the hybrid's block budgets (`focus budget --focus`): when set, a hard asymmetric
  // layer routes as usual, adds to these curves the attention its groups leave unread
  // (focus/block_budget.h), and computes dense attention, so the forward stays the model's own.
  BlockMassCurves* block_calibration = nullptr;
};

struct FocusRouters {
  FocusSettings settings;
  std::vector<int64_t> router_of_layer;  // per model layer: index into routers, or -1 (no Focus)
  int64_t routers_per_layer = 1;         // kv heads with per_kv_head, heads with per_head, else 1: routers
                                         // router_of_layer[l] .. + routers_per_layer - 1 serve layer l
  std::vector<RouterParams> routers;
  // Per router: the frozen model's mean attention mass beyond the local window (measured while
  // training by distillation; empty when unknown).
  std::vector<float> far_mass;
  // The hybrid pattern with per-head block budgets (focus/block_budget.h; focus.json
  // "block_budget"): [model layer][query head], empty for layers without; settings.blocks is then
  // the largest.
  std::vector<std::vector<int64_t>> block_budget;
  // Per head, the near blocks read besides its budget (focus.json "block_near", as block_budget;
  // empty: none).
  std::vector<std::vector<int64_t>> block_near;
  // Per head, 1 where it reads its groups, 0 where it reads blocks alone (focus.json "block_group",
  // as block_budget; empty: every head reads them).
  std::vector<std::vector<int64_t>> block_group;
  int64_t n_params() const;
  // The mean far mass of the routers of the layer whose first router is r (-1: not measured).
  float layer_far_mass(int64_t r) const;
  // Whether that layer runs window + sinks alone (settings.window_only_below against its far mass).
  bool window_only(int64_t r) const {
    const float m = layer_far_mass(r);
    return settings.window_only_below > 0 && m >= 0 && m < settings.window_only_below;
  }
  // The groups a query of that layer reads: settings.topk, or its share by far mass.
  int layer_topk(int64_t r) const;
  // Whether that layer keeps dense attention (settings.dense_above against its far mass).
  bool stays_dense(int64_t r) const {
    const float m = layer_far_mass(r);
    return settings.dense_above < 1 && m >= 0 && m > settings.dense_above;
  }
};

// Gives f the hybrid pattern's per-head block budgets k ([model layer][query head], empty for a
// layer without; every routed global layer needs one), near blocks per head and the group switch
// per head (each empty, or shaped as k; switches 0 or 1), and sets settings.blocks to the largest
// k + near. Errors name `where` (a file) and the problem.
void set_block_budget(FocusRouters& f, const ModelConfig& c, std::vector<std::vector<int64_t>> k,
                      const std::string& where, std::vector<std::vector<int64_t>> near = {},
                      std::vector<std::vector<int64_t>> group = {});

// The width of the vectors a router of these settings reads (model dim, or head_dim with qk input).
int64_t router_input_dim(const ModelConfig& c, const FocusSettings& s);

// Routers for every global attention layer (sliding-window layers are already local), seeded.
FocusRouters focus_init(const ModelConfig& c, const FocusSettings& s, uint64_t seed);

// DIR/router.safetensors (layers.L.w_r [d_g, D], layers.L.centroids [G, d_g], layers.L.bias [G],
// layers.L.log_tau [1]; asymmetric: layers.L.w_k [d_g, D]; far_bias: layers.L.far_q and far_k
// [D + 1], weights then offset) and DIR/focus.json (settings, model shape). Writes are atomic.
void save_focus(const FocusRouters& f, const std::string& dir, const ModelConfig& c, const std::string& model_path);
// Loads and checks against the model (dimensions, layer count); errors name the file.
FocusRouters load_focus(const std::string& dir, const ModelConfig& c);
// Only the settings of DIR/focus.json, checked the same way (no tensors read).
FocusSettings load_focus_settings(const std::string& dir, const ModelConfig& c);

}  // namespace focus
