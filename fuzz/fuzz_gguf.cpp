// GGUF files: the parser (header, metadata, tensor table), every metadata value through the typed
// getters, every small tensor dequantised, the tokenizer built from the metadata (with an
// encode/decode of a short string), and the model loader on the same file.
#include <cstddef>
#include <cstdint>
#include <string>
#include <variant>

#include "fuzz/fuzz_util.h"
#include "io/gguf.h"
#include "io/tokenizer.h"
#include "model/model.h"

using namespace focus;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::write_input("input.gguf", data, size);
  bool parsed = false;
  fuzz::guarded([&] {
    io::GGUFFile f(path);
    parsed = true;
    for (const auto& kv : f.metadata()) {
      const std::string& key = kv.first;
      fuzz::guarded([&] { (void)f.get_int(key); });
      fuzz::guarded([&] { (void)f.get_float(key); });
      fuzz::guarded([&] { (void)f.get_string(key); });
      fuzz::guarded([&] { (void)f.get_string_array(key); });
      fuzz::guarded([&] { (void)f.get_float_array(key); });
      fuzz::guarded([&] { (void)f.get_int_array(key); });
    }
    for (const io::GGUFTensor& t : f.tensors())
      if (t.n_elements() <= (int64_t(1) << 20)) fuzz::guarded([&] { (void)f.to_float(t); });
    fuzz::guarded([&] {
      auto tok = io::make_tokenizer(io::vocab_from_gguf(f));
      const auto ids = tok->encode("Hello, world! 123 \xc3\xa9t\xc3\xa9", true);
      (void)tok->decode(ids);
      for (size_t i = 0; i < ids.size(); ++i) (void)tok->piece(ids[i], i ? ids[i - 1] : -1);
    });
  });
  if (parsed) {
    fuzz::guarded([&] {
      LoadOptions o;
      o.weights = WeightsMode::Native;
      (void)load_model(path, o);
    });
  }
  return 0;
}
