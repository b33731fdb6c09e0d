// Tokenizers: byte-level BPE (GPT-2 style, ranked merges) and SentencePiece-style score BPE
// (llama2.c tokenizer files, GGUF "llama" vocabularies, with byte fallback).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace focus::io {

class GGUFFile;

// Everything a tokenizer is built from, whatever file it came from.
struct VocabData {
  enum class Kind { ByteBPE, SentencePiece } kind = Kind::ByteBPE;
  std::vector<std::string> tokens;   // token text as stored (GPT-2 byte-to-unicode form for ByteBPE)
  std::vector<float> scores;         // SentencePiece: merge priority (higher merges first)
  std::vector<int32_t> types;        // GGUF token types (1 normal, 2 unknown, 3 control, 4 user, 6 byte); may be empty
  std::vector<std::string> merges;   // ByteBPE: "a b" in rank order
  std::string pre = "gpt2";          // ByteBPE pre-tokenizer name (GGUF tokenizer.ggml.pre)
  int32_t bos = -1, eos = -1, unk = -1;
  bool add_bos = false;
  bool add_space_prefix = false;     // SentencePiece dummy prefix
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Encode text; special-token strings in the text are matched as plain text (not parsed).
  virtual std::vector<int32_t> encode(std::string_view text, bool add_bos) const = 0;
  // Decode ids to bytes; decode(encode(t)) == t for any valid UTF-8 t (BOS/EOS ids decode to "").
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  // The bytes one token contributes when it follows `prev` (for streaming output).
  virtual std::string piece(int32_t id, int32_t prev) const = 0;
  virtual int32_t vocab_size() const = 0;
  virtual int32_t bos() const = 0;
  virtual int32_t eos() const = 0;
  virtual bool add_bos_default() const = 0;
};

std::unique_ptr<Tokenizer> make_tokenizer(const VocabData& v);           // throws Error on bad data
VocabData vocab_from_gguf(const GGUFFile& f);                             // tokenizer.ggml.* keys
VocabData vocab_from_llama2c(const std::string& path, int32_t vocab_size); // tok512.bin / tokenizer.bin
VocabData vocab_from_gpt2_files(const std::string& vocab_json, const std::string& merges_txt);
// Load from a path: a llama2.c .bin, a folder with vocab.json+merges.txt (or encoder.json+vocab.bpe),
// a tokenizer.json (HF), or a .gguf. vocab_size is used only by llama2.c files (0 = read all).
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path, int32_t vocab_size = 0);

}  // namespace focus::io
