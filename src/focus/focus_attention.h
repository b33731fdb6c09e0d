// Focus as attention policies (model/attention.h): on a layer with a router, soft mode (the
// training form: dense attention with the log-bias of spec section 2), hard mode (top-k groups,
// sparse kernels that skip every masked pair) and the window + sinks baseline. The routing of the
// cached positions is the policies' state in the KV cache, so decoding reads the members of a
// token's own groups only. A context no longer than the local window runs the model's own dense
// kernel: the logits equal the frozen model's bit for bit.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "focus/focus_model.h"
#include "focus/router.h"
#include "model/attention.h"

namespace focus {

// Called once per router layer during the backward pass with the router's forward cache; it
// may add an auxiliary gradient dL/ds [T, G] into ds_extra (zeroed before the call), e.g. a
// balancing loss, or just observe the assignment.
using RouterAuxHook = std::function<void(int64_t router, const RouterCache& cache, float* ds_extra)>;

// What router r (of `route_heads` on the layer) reads for the T new rows of a: the block's normed
// input xn, or with fs.route_on_qk the mean rotated key vector of its kv heads (side Key) / the
// mean query vector of its query heads (side Query), [T, head_dim] in buf.
const float* router_input(const AttentionCall& a, const FocusSettings& fs, int64_t r, int64_t route_heads,
                          RouterSide side, std::vector<float>& buf);

// The plan of f.settings.mode: soft, hard or window policies on the layers that have a router,
// the model's dense attention elsewhere (mode off: dense everywhere).
AttentionPlan focus_plan(const ModelConfig& c, const FocusRouters& f);

// Training: soft mode on the router layers. When grads is not null, each router's gradient is
// accumulated into (*grads)[router] (sized like its params); the hook (may be null) sees each
// router's assignment and may add a gradient on its scores. With detach_input the routers' input
// gradient (the LM loss and the hook's, through the router) is not passed back to the layer's
// input: the routers learn, but do not shape the hidden states they read (a stop-gradient).
AttentionPlan focus_train_plan(const ModelConfig& c, const FocusRouters& f, std::vector<std::vector<float>>* grads,
                               RouterAuxHook hook = nullptr, bool detach_input = false);

}  // namespace focus
