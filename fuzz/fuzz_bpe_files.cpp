// GPT-2 style tokenizer files. The first byte picks the form: even, vocab.json and merges.txt
// (the rest split at a "\n=====\n" line); odd, a Hugging Face tokenizer.json. The tokenizer is
// built through load_tokenizer (as the CLI does) and runs an encode/decode round trip.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz/fuzz_util.h"
#include "io/tokenizer.h"

using namespace focus;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const bool hf_json = data[0] & 1;
  std::string path;
  if (hf_json) {
    const std::string dir = fuzz::fresh_dir("hf");
    path = dir + "/tokenizer.json";
    fuzz::write_bytes(path, std::string_view(reinterpret_cast<const char*>(data + 1), size - 1));
  } else {
    const auto parts = fuzz::split_parts(data + 1, size - 1, 2);
    path = fuzz::fresh_dir("gpt2");
    fuzz::write_bytes(path + "/vocab.json", parts[0]);
    fuzz::write_bytes(path + "/merges.txt", parts[1]);
  }
  fuzz::guarded([&] {
    auto tok = io::load_tokenizer(path);
    const std::string text = "Hello world, it's   a test\n\t\xc3\xa9\xf0\x9f\x98\x80 123456 <|endoftext|>";
    const auto ids = tok->encode(text, true);
    (void)tok->decode(ids);
    for (size_t i = 0; i < ids.size(); ++i) (void)tok->piece(ids[i], i ? ids[i - 1] : -1);
    (void)tok->encode("", false);
  });
  return 0;
}
