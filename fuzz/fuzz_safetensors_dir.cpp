// Hugging Face model folders: the input is split at "\n=====\n" lines into config.json, the shard
// index (model.safetensors.index.json; an empty part means no index) and the safetensors files
// (with no index, the third part is model.safetensors; with one, parts 3, 4, ... are
// model-00001-of-0000N.safetensors, ...). The folder goes through load_safetensors_dir and the
// model loader.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include "fuzz/fuzz_util.h"
#include "io/safetensors.h"
#include "model/model.h"

using namespace focus;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto parts = fuzz::split_parts(data, size, 3);
  if (parts.size() > 8) return 0;  // a handful of shards is enough
  const std::string dir = fuzz::fresh_dir("model");
  fuzz::write_bytes(dir + "/config.json", parts[0]);
  const bool indexed = !parts[1].empty();
  if (indexed) {
    fuzz::write_bytes(dir + "/model.safetensors.index.json", parts[1]);
    const size_t n = parts.size() - 2;
    for (size_t i = 2; i < parts.size(); ++i) {
      char name[64];
      std::snprintf(name, sizeof(name), "/model-%05zu-of-%05zu.safetensors", i - 1, n);
      fuzz::write_bytes(dir + name, parts[i]);
    }
  } else {
    fuzz::write_bytes(dir + "/model.safetensors", parts[2]);
  }
  bool loaded = false;
  fuzz::guarded([&] {
    io::SafetensorsModel m = io::load_safetensors_dir(dir);
    loaded = true;
    for (const auto& entry : m.index) {
      const std::string& name = entry.first;
      (void)m.owner(name);
      const io::STTensor& t = m.tensor(name);
      if (t.n_elements() <= (int64_t(1) << 20)) fuzz::guarded([&] { (void)m.to_float(name); });
    }
  });
  if (loaded) {
    fuzz::guarded([&] {
      LoadOptions o;
      o.need_tokenizer = false;
      (void)load_model(dir, o);
    });
  }
  return 0;
}
