// LoRA adapter folders: the input is split at a "\n=====\n" line into lora.json and
// lora.safetensors; the first byte picks the model the folder is checked against (even: the tiny
// Llama, odd: the tiny Gemma 3). Loaded adapters are merged into one projection each.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz/fuzz_model_config.h"
#include "fuzz/fuzz_util.h"
#include "train/lora.h"

using namespace focus;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const ModelConfig c = fuzz::tiny_config(data[0] & 1);
  const auto parts = fuzz::split_parts(data + 1, size - 1, 2);
  const std::string dir = fuzz::fresh_dir("lora");
  fuzz::write_bytes(dir + "/lora.json", parts[0]);
  fuzz::write_bytes(dir + "/lora.safetensors", parts[1]);
  fuzz::guarded([&] {
    const LoraAdapters a = load_lora(dir, c);
    (void)a.n_params();
    for (int64_t l = 0; l < c.layers; ++l)
      for (int t = 0; t < kLoraTargets; ++t)
        if (const LoraMatrix* m = a.find(l, t)) {
          const std::vector<float> w((size_t)(m->in * m->out), 0.5f);
          (void)lora_merged(w.data(), *m, a.settings.scale());
        }
  });
  return 0;
}
