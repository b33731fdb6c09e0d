// llama2.c files. The first byte picks the reader: even, a model checkpoint (.bin) through
// load_model (its tokenizer is not looked for); odd, a tokenizer.bin through vocab_from_llama2c
// (the second byte, if any, chooses the vocabulary size to read: 0 reads all) and make_tokenizer,
// with an encode/decode round trip.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz/fuzz_util.h"
#include "io/tokenizer.h"
#include "model/model.h"

using namespace focus;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const bool tokenizer = data[0] & 1;
  const int32_t vocab = data[1] < 128 ? 0 : data[1] - 128;
  const std::string path = fuzz::write_input(tokenizer ? "tokenizer.bin" : "model.bin", data + 2, size - 2);
  if (!tokenizer) {
    fuzz::guarded([&] {
      LoadOptions o;
      o.need_tokenizer = false;
      (void)load_model(path, o);
    });
    return 0;
  }
  fuzz::guarded([&] {
    auto tok = io::make_tokenizer(io::vocab_from_llama2c(path, vocab));
    const auto ids = tok->encode("Once upon a time, \xe2\x80\x9cthere\xe2\x80\x9d was 42.", true);
    (void)tok->decode(ids);
    for (size_t i = 0; i < ids.size(); ++i) (void)tok->piece(ids[i], i ? ids[i - 1] : -1);
    (void)tok->decode({0, 1, 2, tok->vocab_size() - 1});
  });
  return 0;
}
