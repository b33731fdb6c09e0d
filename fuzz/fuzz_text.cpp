// Text preparation and tokenization of arbitrary bytes: prepare_text and the UTF-8 check on the
// raw input, load_text on it as a file, then, for valid UTF-8, an encode/decode round trip through
// the GPT-2 byte-level tokenizer and the Llama 2 SentencePiece one (from the shared data folder,
// $FOCUS_DATA or ../shared/data beside the source tree; small in-process vocabularies of each kind
// when those files are absent). A round trip that does not give the text back is a finding.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz/fuzz_util.h"
#include "io/text.h"
#include "io/tokenizer.h"

using namespace focus;
namespace fs = std::filesystem;

namespace {

std::string data_dir() {
  if (const char* e = std::getenv("FOCUS_DATA")) return e;
  return std::string(FOCUS_SOURCE_DIR) + "/../shared/data";
}

// GPT-2's byte-to-unicode table: printable Latin-1 bytes stand for themselves, the others map to
// code points from 256 up, in byte order.
std::string byte_token(int b) {
  static const std::vector<uint32_t> cp = [] {
    std::vector<uint32_t> t(256);
    uint32_t next = 256;
    for (int i = 0; i < 256; ++i) {
      const bool keep = (i >= '!' && i <= '~') || (i >= 0xA1 && i <= 0xAC) || (i >= 0xAE && i <= 0xFF);
      t[i] = keep ? (uint32_t)i : next++;
    }
    return t;
  }();
  const uint32_t c = cp[b];
  std::string s;
  if (c < 0x80) {
    s += (char)c;
  } else {
    s += (char)(0xC0 | (c >> 6));
    s += (char)(0x80 | (c & 0x3F));
  }
  return s;
}

std::unique_ptr<io::Tokenizer> builtin_byte_bpe() {
  io::VocabData v;
  v.kind = io::VocabData::Kind::ByteBPE;
  for (int b = 0; b < 256; ++b) v.tokens.push_back(byte_token(b));
  const char* merges[][2] = {{"t", "h"}, {"th", "e"}, {"\xc4\xa0", "t"}, {"\xc4\xa0t", "he"}, {"i", "n"}};
  for (auto& m : merges) {
    v.tokens.push_back(std::string(m[0]) + m[1]);
    v.merges.push_back(std::string(m[0]) + " " + m[1]);
  }
  v.tokens.push_back("<|endoftext|>");
  v.bos = v.eos = (int32_t)v.tokens.size() - 1;
  v.types.assign(v.tokens.size(), 1);
  v.types.back() = 3;
  return io::make_tokenizer(v);
}

std::unique_ptr<io::Tokenizer> builtin_sentencepiece() {
  io::VocabData v;
  v.kind = io::VocabData::Kind::SentencePiece;
  v.tokens = {"<unk>", "<s>", "</s>"};
  v.types = {2, 3, 3};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    v.tokens.push_back(name);
    v.types.push_back(6);
  }
  v.scores.assign(v.tokens.size(), 0.f);
  const char* pieces[] = {"\xe2\x96\x81", "e", "t", "h", "\xe2\x96\x81t", "he", "\xe2\x96\x81the", "a", "n", "an"};
  float score = -1.f;
  for (const char* p : pieces) {
    v.tokens.push_back(p);
    v.types.push_back(1);
    v.scores.push_back(score);
    score -= 1.f;
  }
  v.unk = 0;
  v.bos = 1;
  v.eos = 2;
  v.add_bos = true;
  v.add_space_prefix = true;
  return io::make_tokenizer(v);
}

struct Tokenizers {
  std::unique_ptr<io::Tokenizer> gpt2, llama;
};

const Tokenizers& tokenizers() {
  static const Tokenizers t = [] {
    Tokenizers r;
    const fs::path d = data_dir();
    const fs::path gpt2 = d / "tokenizers/gpt2", llama = d / "tokenizers/llama2-32k/tokenizer.bin";
    if (fs::exists(gpt2 / "encoder.json") && fs::exists(gpt2 / "vocab.bpe")) {
      r.gpt2 = io::load_tokenizer(gpt2.string());
    } else {
      std::fprintf(stderr, "fuzz_text: %s not found, using a built-in byte-level vocabulary\n", gpt2.c_str());
      r.gpt2 = builtin_byte_bpe();
    }
    if (fs::exists(llama)) {
      r.llama = io::load_tokenizer(llama.string());
    } else {
      std::fprintf(stderr, "fuzz_text: %s not found, using a built-in SentencePiece vocabulary\n", llama.c_str());
      r.llama = builtin_sentencepiece();
    }
    return r;
  }();
  return t;
}

void round_trip(const io::Tokenizer& tok, const std::string& text, const char* which) {
  const std::vector<int32_t> ids = tok.encode(text, false);
  const std::string back = tok.decode(ids);
  if (back != text) {
    std::fprintf(stderr, "%s: decode(encode(text)) differs from the text (%zu bytes in, %zu out)\n", which,
                 text.size(), back.size());
    std::abort();
  }
  std::string streamed;
  for (size_t i = 0; i < ids.size(); ++i) streamed += tok.piece(ids[i], i ? ids[i - 1] : -1);
  (void)streamed;
  (void)tok.encode(text, true);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)tokenizers();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 4096) return 0;  // tokenization is linear-ish; long inputs only slow the search
  const std::string_view raw(reinterpret_cast<const char*>(data), size);
  io::PrepareStats st;
  const std::string prepared = io::prepare_text(raw, &st);
  const size_t bad = io::find_invalid_utf8(raw);
  const std::string path = fuzz::write_input("input.txt", data, size);
  fuzz::guarded([&] { (void)io::load_text(path); });
  if (bad != std::string_view::npos) return 0;
  if (io::find_invalid_utf8(prepared) != std::string_view::npos) {
    std::fprintf(stderr, "prepare_text turned valid UTF-8 into invalid UTF-8\n");
    std::abort();
  }
  const Tokenizers& t = tokenizers();
  round_trip(*t.gpt2, prepared, "gpt2");
  round_trip(*t.llama, prepared, "llama");
  return 0;
}
