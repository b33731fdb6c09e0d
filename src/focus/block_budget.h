// Per-head block budgets for block top-k attention (block_topk.h): instead of every query head of
// every layer reading the same K far blocks, each (layer, query head) reads its own K_h, with the
// mean of K_h over the routed heads fixed. Heads whose attention stays in the local window get
// few blocks; heads whose far attention is spread out get many.
//
// The budgets come from a calibration pass over text the evaluation does not use: the model runs
// dense attention, and for every row beyond the window and every query head the calibration
// ranks the far blocks as block top-k would (the forced block of the last far key first, then the
// complete blocks by their Quest bound) and records how much of the row's attention probability
// the first K of them miss, for K = 0 .. k_max. Summed over rows, missed_h(K) is what head h
// loses with K blocks; the budgets minimise the sum over heads of missed_h(K_h) given the mean:
// one block at a time goes to the head whose missed mass falls most by it (greedy; each head's
// curve is convex where its blocks are ranked well, which is where it matters).
//
// Near blocks (near_max > 0): a head may also widen its window, reading the N_h complete blocks
// just before the block of its last far key whatever their bound, besides its K_h ranked ones
// (per-head window widths, in whole blocks). The curves are then missed_h(N, K) for N = 0 ..
// near_max, K ranked among the blocks the N leave, and the budgets fix the mean of N_h + K_h:
// each head's best split of c blocks, min over N + K = c of missed_h(N, K), is what the blocks are
// allocated against (greedy on the steps of best gain per block, as those curves need not be
// convex). Heads whose attention is near get wide windows, heads whose far attention is found by
// the bounds get ranked blocks.
//
// The group switch (around a hybrid's groups, `focus budget --group-switch`): the calibration also
// measures each head's curves as if its groups were not read (missed_plain), and a head may then
// read no group at all: the budgets fix the mean of N_h + K_h plus, for the heads that keep their
// group, the keys it reads in blocks' worth, and each head takes what costs least for the mass it
// leaves (a Lagrangian choice between the two curves, the blocks topped up greedily; never worse
// than all groups on or all off at the same mean). Heads whose group holds mass the bounds miss
// keep it; heads whose group costs more than the blocks it replaces drop it.
//
// What the curves count (`focus budget --metric`): mass, the attention probability a selection
// leaves unread (the default); output, how far the head's output moves: with U the unread keys,
// m their probability and u = sum over U of p_j v_j, the selection's output is (o - u) / (1 - m)
// against the dense o, and the curve sums ||m o - u|| / (1 - m) over rows. Unread mass on keys
// whose values are near the head's output (sink-like keys) costs little there; mass on keys that
// move the output costs in proportion. Both curves are allocated alike.
//
// The budget file (JSON, "format": "focus-block-budget") holds the settings it was measured with
// (block, window, sinks, ctx) and K_h for every layer (an empty list for layers not routed);
// `--attention blocktopk:budget=FILE` reads it.
#pragma once
#include <cstdint>
#include <string>
#include <nlohmann/json.hpp>
#include <vector>

#include "model/model.h"

namespace focus {

enum class BlockMetric { Mass, Output };
const char* block_metric_name(BlockMetric m);
// "mass" or "output"; errors name source.
BlockMetric parse_block_metric(const std::string& name, const std::string& source);

struct BlockMassCurves {
  int64_t block = 8, window = 64, sinks = 1, k_max = 0;
  BlockMetric metric = BlockMetric::Mass;  // what missed counts (far is the far probability either way)
  int64_t near_max = 0;  // most near blocks a head may read (0: none, the window alone)
  int64_t layers = 0, heads = 0;
  // [layers * heads * (near_max + 1) * (k_max + 1)]: summed over rows, the attention probability
  // beyond the window and the sinks that the forced block, the N near blocks before it and the
  // first K ranked blocks of the rest do not hold (metric Output: the output error they leave).
  std::vector<double> missed;
  std::vector<double> far;        // [layers * heads] the far probability summed over rows
  std::vector<int64_t> rows;      // [layers] rows with a far key, per layer (0: layer not measured)
  // Measured around a hybrid's groups (GroupReads): [layers * heads] the far keys (beyond the window
  // and the sinks) the groups read, summed over rows: what the groups cost. Empty without groups.
  std::vector<double> group_keys;
  // Measured around groups as well: missed as if the groups were not read (as missed, the same
  // rows; the far probability of these curves is far + the mass the groups read). Empty without
  // groups.
  std::vector<double> missed_plain;
  double missed_plain_at(int64_t l, int64_t h, int64_t n, int64_t k) const {
    return missed_plain[((l * heads + h) * (near_max + 1) + n) * (k_max + 1) + k];
  }
  // missed_at when the head reads its groups (or no groups were measured), missed_plain_at when not.
  double missed_for(int64_t l, int64_t h, int64_t n, int64_t k, bool reads_groups) const {
    return reads_groups ? missed_at(l, h, n, k) : missed_plain_at(l, h, n, k);
  }
  double missed_at(int64_t l, int64_t h, int64_t k) const { return missed_at(l, h, 0, k); }
  double missed_at(int64_t l, int64_t h, int64_t n, int64_t k) const {
    return missed[((l * heads + h) * (near_max + 1) + n) * (k_max + 1) + k];
  }
};

// Runs m over ids in windows of ctx tokens (BOS first when the model has one) with dense
// attention on every global layer and measures the curves there. Stops early (returning what it
// has) after Ctrl-C; progress on stderr when asked.
BlockMassCurves measure_block_mass(const Model& m, const std::vector<int32_t>& ids, int64_t ctx, int64_t block,
                                   int64_t window, int64_t sinks, int64_t k_max, bool progress,
                                   int64_t near_max = 0, BlockMetric metric = BlockMetric::Mass);

// What a hybrid's groups read beyond the window, for calibrating its blocks: key j is read by
// query head h of row t when key_group[r][j] (r = h / heads_per_router) is one of the k groups
// query_groups[(t * heads + h) * k ..]. Keys read so are neither far mass nor block mass.
struct GroupReads {
  const int32_t* query_groups = nullptr;             // [T, heads, k] of the call's rows
  int k = 0;
  const std::vector<std::vector<int32_t>>* key_group = nullptr;  // [routers][keys 0 .. n-1]
  int64_t heads_per_router = 1;
};

// Adds the rows of one prefill call (float q and keys 0 .. a.pos0 + a.T - 1 in a.k) to cv's
// curves for layer a.layer (cv sized for the model by measure_block_mass's rules). With groups,
// only what the groups leave unread counts. Metric Output needs a.v.
void measure_block_mass_call(const AttentionCall& a, BlockMassCurves& cv, const GroupReads* groups = nullptr);

// Empty curves for a model's layers and heads.
BlockMassCurves block_mass_curves(const ModelConfig& c, int64_t block, int64_t window, int64_t sinks, int64_t k_max,
                                  int64_t near_max = 0);

// Runs m over ids in windows of ctx tokens with a float32 KV cache through plan, whose policies
// measure (BlockMassProbe, or a hybrid's policies with FocusSettings::block_calibration set).
// Errors when ctx leaves no key beyond the curves' window and sinks.
void run_block_calibration(const Model& m, const std::vector<int32_t>& ids, int64_t ctx, const AttentionPlan& plan,
                           const BlockMassCurves& cv, bool progress);

// Budgets with mean_k blocks per measured (layer, head) on average (rounded down to whole blocks
// in total): [layers][heads], empty for layers not measured. Each K_h is at most curves.k_max
// (and cap, when cap >= 0). mean_k must be finite, in [0, 2^20].
// With near blocks measured (curves.near_max > 0) mean_k is the mean of N_h + K_h, cap bounds
// N_h + K_h, and near ([layers][heads], as the result) receives each head's N_h; without, near
// (when given) is left empty.
// With group (the group switch; the curves need missed_plain): group ([layers][heads], as the
// result) receives 1 for the heads that read their groups, 0 for those that do not, and mean_k
// counts the keys the kept groups read too, in blocks of curves.block (see above).
// The weights (each > 0; 1: mass is mass, and the mass a perplexity needs need not be spread
// alike): group, what a unit of the mass a group reads is worth against a unit the blocks read
// (the allocation minimises plain - group * (plain - missed) for the heads that keep their
// groups); near, the same for the mass of the near blocks against the ranked ones' (for block
// top-k alone as well).
struct BudgetWeights {
  double group = 1.0, near = 1.0;
};
std::vector<std::vector<int64_t>> allocate_block_budget(const BlockMassCurves& curves, double mean_k,
                                                        int64_t cap = -1,
                                                        std::vector<std::vector<int64_t>>* near = nullptr,
                                                        std::vector<std::vector<int64_t>>* group = nullptr,
                                                        const BudgetWeights& weights = {});

// Summed over the heads of the measured layers, per row: the mass budgets (k, near, group as
// allocate_block_budget makes them; near and group may be empty) leave unread, and what they cost
// in blocks (N + K, plus the kept groups' keys over the block size).
struct BudgetCost {
  double missed = 0, blocks = 0;
};
BudgetCost budget_cost(const BlockMassCurves& curves, const std::vector<std::vector<int64_t>>& k,
                       const std::vector<std::vector<int64_t>>& near, const std::vector<std::vector<int64_t>>& group);

// The curves as a safetensors file (missed [layers, heads, k_max + 1] and far [layers, heads] per
// row, rows [layers], and group_keys [layers, heads] and missed_plain (as missed) per row when
// measured around groups; block,
// window, sinks and ctx in its metadata), so that budgets for other means can be made later without
// measuring again. Load errors name the file.
void save_block_curves(const std::string& path, const BlockMassCurves& cv, int64_t ctx);
BlockMassCurves load_block_curves(const std::string& path, int64_t* ctx);

struct BlockBudget {
  int64_t block = 8, window = 64, sinks = 1, ctx = 0;
  double mean_k = 0;
  std::vector<std::vector<int64_t>> k;  // [layers][heads], empty for layers not routed
  // [layers][heads] near blocks (before the block of the last far key, read whatever their
  // bound), as k; empty: none.
  std::vector<std::vector<int64_t>> near;
  // [layers][heads] the group switch: 1 where the head reads its groups, 0 where it does not
  // (hybrid routers only); empty: every head reads them.
  std::vector<std::vector<int64_t>> group;
  BudgetWeights weights;  // the allocation's (for the record)
  BlockMetric metric = BlockMetric::Mass;  // the curves' (for the record)
  // Per layer: the missed and far probability per row under these budgets at calibration (for the report).
  std::vector<double> layer_missed, layer_far;
};

void save_block_budget(const std::string& path, const BlockBudget& b);
// Errors name the file: not a budget file, malformed fields, negative budgets.
BlockBudget load_block_budget(const std::string& path);

// Budgets b fit routers of window and sinks on model c (the same window and sinks, a list per
// head of every global layer); errors name source.
void check_block_budget(const BlockBudget& b, int64_t window, int64_t sinks, const ModelConfig& c,
                        const std::string& source);

// A JSON array of per-layer lists of counts in [0, 2^20] (budget files, focus.json
// "block_budget"); errors name path and key.
std::vector<std::vector<int64_t>> per_layer_counts(const nlohmann::json& v, const std::string& path,
                                                   const std::string& key);

}  // namespace focus
