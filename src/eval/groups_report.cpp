#include "eval/groups_report.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "core/error.h"
#include "core/progress.h"
#include "focus/focus_attention.h"

namespace focus {

GroupsReport groups_report(const Model& m, const FocusRouters& f, const std::vector<int32_t>& ids, int64_t ctx,
                           int64_t max_tokens, int top_n, bool progress) {
  FOCUS_CHECK(ctx >= 2, "groups: ctx must be at least 2");
  FOCUS_CHECK(!ids.empty(), "groups: the text has no tokens");
  FOCUS_CHECK(!f.routers.empty(), "groups: the routers cover no layer of this model");
  const int64_t n = max_tokens > 0 ? std::min<int64_t>(max_tokens, (int64_t)ids.size()) : (int64_t)ids.size();
  const int32_t bos = m.tok ? m.tok->bos() : -1;
  const int64_t body = bos >= 0 ? ctx - 1 : ctx;
  const int64_t G = f.settings.groups, K = f.settings.topk;
  FocusRouters hard = f;
  hard.settings.mode = FocusMode::Hard;
  const AttentionPlan plan = focus_plan(m.cfg, hard);

  const int64_t L = m.cfg.layers;
  std::vector<std::vector<std::unordered_map<int32_t, int64_t>>> counts(L);
  std::vector<std::vector<int64_t>> sizes(L);
  for (int64_t l = 0; l < L; ++l)
    if (f.router_of_layer[l] >= 0) {
      counts[l].resize(G);
      sizes[l].assign(G, 0);
    }

  GroupsReport r;
  const int64_t nwin = (n + body - 1) / body;
  std::unique_ptr<Progress> bar;
  if (progress) bar = std::make_unique<Progress>("groups", nwin, "win");
  std::vector<std::vector<int32_t>> groups;
  for (int64_t w = 0; w < nwin && !interrupted(); ++w) {
    const int64_t a = w * body, b = std::min(n, a + body);
    std::vector<int32_t> win;
    if (bos >= 0) win.push_back(bos);
    win.insert(win.end(), ids.begin() + a, ids.begin() + b);
    const int64_t T = (int64_t)win.size(), off = bos >= 0 ? 1 : 0;
    KVCache cache;
    cache.init(m.cfg, T);
    std::vector<float> hidden(T * m.cfg.dim);
    AttentionStats st;
    st.groups = &groups;
    groups.clear();
    forward(m, win.data(), T, cache, hidden.data(), &plan, &st);
    for (int64_t l = 0; l < L && l < (int64_t)groups.size(); ++l) {
      if (groups[l].empty()) continue;  // short window: the layer ran plain attention
      for (int64_t t = off; t < T; ++t)
        for (int64_t k = 0; k < K; ++k) {
          const int32_t g = groups[l][t * K + k];
          ++sizes[l][g];
          ++counts[l][g][win[t]];
        }
    }
    r.tokens += T - off;
    ++r.windows;
    if (bar) bar->update(w + 1);
  }
  if (bar) bar->finish();

  for (int64_t l = 0; l < L; ++l) {
    if (sizes[l].empty()) continue;
    GroupsReport::Layer lr;
    lr.layer = l;
    int64_t total = 0, mx = 0;
    for (int64_t g = 0; g < G; ++g) {
      GroupsReport::Group gr;
      gr.size = sizes[l][g];
      total += gr.size;
      mx = std::max(mx, gr.size);
      if (gr.size == 0) ++lr.empty;
      std::vector<std::pair<int32_t, int64_t>> v(counts[l][g].begin(), counts[l][g].end());
      std::sort(v.begin(), v.end(), [](const auto& x, const auto& y) {
        return x.second != y.second ? x.second > y.second : x.first < y.first;
      });
      if ((int)v.size() > top_n) v.resize(top_n);
      gr.top = std::move(v);
      lr.groups.push_back(std::move(gr));
    }
    lr.max_over_mean = total > 0 ? (double)mx * G / (double)total : 0;
    r.layers.push_back(std::move(lr));
  }
  return r;
}

namespace {
std::string piece_of(const Model& m, int32_t id) {
  if (!m.tok) return std::string(1, '#').append(std::to_string(id));
  // As inside a text (a previous token that is not BOS), so leading spaces show.
  std::string s = m.tok->piece(id, std::numeric_limits<int32_t>::max());
  std::string out;
  for (unsigned char ch : s) {
    if (ch == '\n')
      out += "\\n";
    else if (ch == '\t')
      out += "\\t";
    else if (ch < 0x20)
      out += "?";
    else
      out += (char)ch;
  }
  return out;
}
}  // namespace

std::string groups_report_text(const Model& m, const GroupsReport& r) {
  std::string s;
  char buf[256];
  std::snprintf(buf, sizeof(buf), "%lld tokens in %lld windows, per Focus layer:\n", (long long)r.tokens,
                (long long)r.windows);
  s += buf;
  for (const auto& l : r.layers) {
    std::snprintf(buf, sizeof(buf), "layer %lld: load max/mean %.2f, %lld empty groups\n", (long long)l.layer,
                  l.max_over_mean, (long long)l.empty);
    s += buf;
    for (size_t g = 0; g < l.groups.size(); ++g) {
      const auto& gr = l.groups[g];
      std::snprintf(buf, sizeof(buf), "  g%-3zu %8lld  ", g, (long long)gr.size);
      s += buf;
      for (size_t i = 0; i < gr.top.size(); ++i) {
        if (i) s += ' ';
        s += '\'';
        s += piece_of(m, gr.top[i].first);
        s += '\'';
        std::snprintf(buf, sizeof(buf), "x%lld", (long long)gr.top[i].second);
        s += buf;
      }
      s += "\n";
    }
  }
  return s;
}

nlohmann::json groups_report_json(const Model& m, const GroupsReport& r) {
  nlohmann::json layers = nlohmann::json::array();
  for (const auto& l : r.layers) {
    nlohmann::json groups = nlohmann::json::array();
    for (const auto& g : l.groups) {
      nlohmann::json top = nlohmann::json::array();
      for (const auto& [id, c] : g.top) top.push_back({{"id", id}, {"piece", piece_of(m, id)}, {"count", c}});
      groups.push_back({{"size", g.size}, {"top", top}});
    }
    layers.push_back({{"layer", l.layer}, {"max_over_mean", l.max_over_mean}, {"empty", l.empty}, {"groups", groups}});
  }
  return {{"tokens", r.tokens}, {"windows", r.windows}, {"layers", layers}};
}

}  // namespace focus
