// safetensors files: the header parser, the tensor table and every small tensor's to_float.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz/fuzz_util.h"
#include "io/safetensors.h"

using namespace focus;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::write_input("input.safetensors", data, size);
  fuzz::guarded([&] {
    io::SafetensorsFile f(path);
    (void)f.metadata().dump();
    for (const io::STTensor& t : f.tensors()) {
      (void)f.find(t.name);
      if (t.n_elements() <= (int64_t(1) << 20)) fuzz::guarded([&] { (void)f.to_float(t); });
    }
    fuzz::guarded([&] { (void)f.tensor("no such tensor"); });
  });
  return 0;
}
