// Focus router folders: the input is split at a "\n=====\n" line into focus.json and
// router.safetensors; the first byte picks the model the folder is checked against (even: the
// tiny Llama, odd: the tiny Gemma 3). Both readers run: load_focus_settings and load_focus.
#include <cstddef>
#include <cstdint>
#include <string>

#include "focus/focus_model.h"
#include "fuzz/fuzz_model_config.h"
#include "fuzz/fuzz_util.h"

using namespace focus;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const ModelConfig c = fuzz::tiny_config(data[0] & 1);
  const auto parts = fuzz::split_parts(data + 1, size - 1, 2);
  const std::string dir = fuzz::fresh_dir("router");
  fuzz::write_bytes(dir + "/focus.json", parts[0]);
  fuzz::write_bytes(dir + "/router.safetensors", parts[1]);
  fuzz::guarded([&] { (void)load_focus_settings(dir, c); });
  fuzz::guarded([&] {
    const FocusRouters f = load_focus(dir, c);
    (void)f.n_params();
    for (size_t r = 0; r < f.routers.size(); r += (size_t)f.routers_per_layer) {
      (void)f.window_only((int64_t)r);
      (void)f.layer_topk((int64_t)r);
      (void)f.stays_dense((int64_t)r);
    }
  });
  return 0;
}
