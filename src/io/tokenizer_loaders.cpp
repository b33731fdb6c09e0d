// Tokenizer files: validation of vocabulary data, and the loaders for GGUF vocabularies, llama2.c
// tokenizer files, GPT-2 vocab.json + merges.txt and Hugging Face tokenizer.json.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <unordered_set>

#include "core/error.h"
#include "core/mapped_file.h"
#include "io/gguf.h"
#include "io/tokenizer_bpe_common.h"
#include "io/unicode.h"

namespace focus::io {

using namespace bpe;

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// ------------------------------------------------------------------ validation and loaders

void check_vocab(const VocabData& v, const std::string& source) {
  const size_t n = v.tokens.size();
  FOCUS_CHECK(n > 0, source, ": the vocabulary is empty");
  FOCUS_CHECK(n < (size_t)INT32_MAX, source, ": vocabulary too large (", n, " tokens)");
  FOCUS_CHECK(v.types.empty() || v.types.size() == n, source, ": ", v.types.size(), " token types for ", n, " tokens");
  if (v.kind == VocabData::Kind::SentencePiece) {
    FOCUS_CHECK(v.scores.size() == n, source, ": ", v.scores.size(), " scores for ", n, " tokens");
    for (size_t i = 0; i < n; ++i)
      FOCUS_CHECK(std::isfinite(v.scores[i]), source, ": token ", i, " has a non-finite score");
  }
  for (auto [name, id] : {std::pair<const char*, int32_t>{"BOS", v.bos}, {"EOS", v.eos}, {"unknown", v.unk}})
    FOCUS_CHECK(id >= -1 && id < (int64_t)n, source, ": ", name, " token id ", id, " is outside the vocabulary (",
                n, " tokens)");
}

std::unique_ptr<Tokenizer> build(const VocabData& v, const std::string& source) {
  check_vocab(v, source);
  if (v.kind == VocabData::Kind::ByteBPE) return bpe::make_byte_bpe(v, source);
  return bpe::make_sentencepiece(v, source);
}

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

json parse_json_file(const std::string& path) {
  const std::string text = read_file(path);
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    fail(path, ": invalid JSON: ", e.what());
  }
}

// Token -> id object to a dense token list.
std::vector<std::string> tokens_from_map(const json& m, const std::string& path) {
  FOCUS_CHECK(m.is_object(), path, ": expected a JSON object mapping token -> id");
  std::vector<std::string> tokens(m.size());
  std::vector<bool> seen(m.size(), false);
  for (auto it = m.begin(); it != m.end(); ++it) {
    FOCUS_CHECK(it.value().is_number_integer(), path, ": the id of token '", it.key(), "' is not an integer");
    const int64_t id = it.value().get<int64_t>();
    FOCUS_CHECK(id >= 0 && id < (int64_t)tokens.size(), path, ": token '", it.key(), "' has id ", id,
                ", outside 0..", tokens.size() - 1, " (ids must be dense)");
    FOCUS_CHECK(!seen[id], path, ": id ", id, " is given to more than one token");
    seen[id] = true;
    tokens[id] = it.key();
  }
  return tokens;
}

void check_merges(const std::vector<std::string>& tokens, const std::vector<std::string>& merges,
                  const std::string& path) {
  std::unordered_set<std::string_view> have(tokens.begin(), tokens.end());
  for (size_t r = 0; r < merges.size(); ++r) {
    const std::string& m = merges[r];
    const size_t sp = m.find(' ', 1);
    FOCUS_CHECK(sp != std::string::npos, path, ": merge ", r + 1, " ('", m, "') is not two tokens separated by a space");
    const std::string a = m.substr(0, sp), b = m.substr(sp + 1);
    FOCUS_CHECK(have.count(a), path, ": merge ", r + 1, " ('", m, "') references unknown token '", a, "'");
    FOCUS_CHECK(have.count(b), path, ": merge ", r + 1, " ('", m, "') references unknown token '", b, "'");
    FOCUS_CHECK(have.count(a + b), path, ": merge ", r + 1, " ('", m, "') makes '", a + b,
                "', which is not in the vocabulary");
  }
}

int32_t find_token(const std::vector<std::string>& tokens, std::initializer_list<const char*> names) {
  for (const char* name : names)
    for (size_t i = 0; i < tokens.size(); ++i)
      if (tokens[i] == name) return (int32_t)i;
  return -1;
}

// A Hugging Face tokenizer.json holding a BPE model (vocab_from_hf_json below: any field of an
// unexpected JSON type becomes an error naming the file).
VocabData read_hf_json(const std::string& path) {
  const json j = parse_json_file(path);
  FOCUS_CHECK(j.is_object() && j.contains("model") && j["model"].is_object(), path,
              ": not a Hugging Face tokenizer.json (no \"model\" object)");
  const json& model = j["model"];
  FOCUS_CHECK(!model.contains("type") || model["type"].is_string(), path, ": model.type is ",
              model["type"].dump().substr(0, 80), ", not a string");
  const std::string type = model.value("type", std::string("BPE"));
  FOCUS_CHECK(type == "BPE", path, ": tokenizer model type '", type, "' is not supported (only BPE)");
  FOCUS_CHECK(model.contains("vocab"), path, ": model has no vocab");
  VocabData v;
  v.tokens = tokens_from_map(model["vocab"], path);
  v.types.assign(v.tokens.size(), kTypeNormal);
  if (j.contains("added_tokens") && j["added_tokens"].is_array()) {
    // Added tokens extend the vocabulary (or replace entries of it): their ids stay within a few
    // of its end, so a gap larger than kMaxGap is a corrupt id, not a table to allocate.
    constexpr int64_t kMaxGap = 1 << 16;
    const int64_t max_id = (int64_t)v.tokens.size() + (int64_t)j["added_tokens"].size() + kMaxGap;
    for (const json& a : j["added_tokens"]) {
      FOCUS_CHECK(a.is_object() && a.contains("id") && a.contains("content") && a["id"].is_number_integer() &&
                      a["content"].is_string() && (!a.contains("special") || a["special"].is_boolean()),
                  path, ": malformed entry in added_tokens: ", a.dump().substr(0, 200));
      const int64_t id = a["id"].get<int64_t>();
      FOCUS_CHECK(id >= 0 && id < max_id, path, ": added token id ", id, " out of range (the vocabulary has ",
                  v.tokens.size(), " tokens)");
      if ((size_t)id >= v.tokens.size()) {
        v.tokens.resize(id + 1);
        v.types.resize(id + 1, kTypeUnused);
      }
      v.tokens[id] = a["content"].get<std::string>();
      v.types[id] = a.value("special", false) ? kTypeControl : kTypeUser;
    }
  }
  if (model.contains("merges")) {
    FOCUS_CHECK(model["merges"].is_array(), path, ": model.merges is not an array");
    for (const json& m : model["merges"]) {
      if (m.is_string()) {
        v.merges.push_back(m.get<std::string>());
      } else {
        FOCUS_CHECK(m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string(), path,
                    ": malformed merge entry ", m.dump());
        v.merges.push_back(m[0].get<std::string>() + " " + m[1].get<std::string>());
      }
    }
  }
  const std::string dump_pre = j.contains("pre_tokenizer") ? j["pre_tokenizer"].dump() : "";
  const std::string dump_dec = j.contains("decoder") ? j["decoder"].dump() : "";
  const std::string dump_norm = j.contains("normalizer") ? j["normalizer"].dump() : "";
  const bool byte_level = dump_pre.find("\"ByteLevel\"") != std::string::npos ||
                          dump_dec.find("\"ByteLevel\"") != std::string::npos;
  if (byte_level) {
    v.kind = VocabData::Kind::ByteBPE;
    check_merges(v.tokens, v.merges, path);
    const json& pre = j.contains("pre_tokenizer") ? j["pre_tokenizer"] : json();
    v.pre = "gpt2";
    if (dump_pre.find("\"Digits\"") != std::string::npos && dump_pre.find("\"individual_digits\":true") != std::string::npos)
      v.pre = "smollm";
    if (pre.is_object() && pre.value("type", "") == "Sequence" && pre.contains("pretokenizers")) {
      for (const json& p : pre["pretokenizers"]) {
        if (p.value("type", "") != "Split" || !p.contains("pattern") || !p["pattern"].contains("Regex")) continue;
        const std::string re = p["pattern"]["Regex"].get<std::string>();
        const std::string llama3 =
            "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
            "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
        const std::string qwen2 =
            "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
            "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
        if (re == llama3) v.pre = "llama3";
        else if (re == qwen2) v.pre = "qwen2";
        else v.pre = "unrecognised Split pattern " + re;
      }
    }
  } else {
    // SentencePiece-style BPE written as ranked merges (Llama/Gemma tokenizer.json): a token's
    // score is minus the rank of the first merge making it; tokens no merge makes are left
    // out of merging.
    FOCUS_CHECK(model.value("byte_fallback", false) || dump_norm.find(kSpaceMarker) != std::string::npos ||
                    dump_pre.find("Metaspace") != std::string::npos,
                path, ": BPE model is neither byte-level nor SentencePiece-style (unsupported)");
    v.kind = VocabData::Kind::SentencePiece;
    check_merges(v.tokens, v.merges, path);
    std::unordered_map<std::string_view, int32_t> id_of;
    for (size_t i = 0; i < v.tokens.size(); ++i) id_of.emplace(v.tokens[i], (int32_t)i);
    v.scores.assign(v.tokens.size(), 0.f);
    std::vector<bool> made(v.tokens.size(), false);
    for (size_t r = 0; r < v.merges.size(); ++r) {
      std::string ab = v.merges[r];
      ab.erase(ab.find(' ', 1), 1);
      const int32_t id = id_of.at(ab);
      if (!made[id]) v.scores[id] = -(float)r, made[id] = true;
    }
    for (size_t i = 0; i < v.tokens.size(); ++i) {
      if (v.types[i] != kTypeNormal) continue;
      if (parse_byte_token(v.tokens[i]) >= 0) v.types[i] = kTypeByte;
      else if (!made[i] && unicode::utf8_len(v.tokens[i], 0) < v.tokens[i].size()) v.types[i] = kTypeUnused;
    }
    v.add_space_prefix = dump_norm.find("Prepend") != std::string::npos ||
                         (dump_pre.find("Metaspace") != std::string::npos &&
                          dump_pre.find("\"prepend_scheme\":\"never\"") == std::string::npos);
    v.merges.clear();
  }
  if (model.contains("unk_token") && model["unk_token"].is_string())
    v.unk = find_token(v.tokens, {model["unk_token"].get_ref<const std::string&>().c_str()});
  // BOS/EOS: tokenizer_config.json beside the file when present, else the usual names.
  const fs::path cfg = fs::path(path).parent_path() / "tokenizer_config.json";
  bool have_cfg = false;
  if (fs::exists(cfg)) {
    const json c = parse_json_file(cfg.string());
    auto tok_name = [](const json& t) -> std::string {
      if (t.is_string()) return t.get<std::string>();
      if (t.is_object() && t.contains("content") && t["content"].is_string()) return t["content"].get<std::string>();
      return "";
    };
    if (c.contains("bos_token")) v.bos = find_token(v.tokens, {tok_name(c["bos_token"]).c_str()});
    if (c.contains("eos_token")) v.eos = find_token(v.tokens, {tok_name(c["eos_token"]).c_str()});
    if (c.contains("add_bos_token") && c["add_bos_token"].is_boolean()) v.add_bos = c["add_bos_token"].get<bool>();
    have_cfg = true;
  }
  if (!have_cfg) {
    v.bos = find_token(v.tokens, {"<|begin_of_text|>", "<s>", "<bos>", "<|endoftext|>"});
    v.eos = find_token(v.tokens, {"<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>"});
    v.add_bos = v.kind == VocabData::Kind::SentencePiece || find_token(v.tokens, {"<|begin_of_text|>"}) >= 0;
  }
  return v;
}

VocabData vocab_from_hf_json(const std::string& path) {
  try {
    return read_hf_json(path);
  } catch (const json::exception& e) {
    throw Error(path + ": malformed tokenizer.json (" + e.what() + ")");
  }
}

}  // namespace

// ------------------------------------------------------------------ public API

std::unique_ptr<Tokenizer> make_tokenizer(const VocabData& v) { return build(v, "tokenizer"); }

VocabData vocab_from_gguf(const GGUFFile& f) {
  const std::string& path = f.path();
  VocabData v;
  const std::string model = f.get_string("tokenizer.ggml.model");
  if (model == "gpt2") v.kind = VocabData::Kind::ByteBPE;
  else if (model == "llama") v.kind = VocabData::Kind::SentencePiece;
  else fail(path, ": tokenizer model '", model, "' is not supported (expected 'gpt2' or 'llama')");
  v.tokens = f.get_string_array("tokenizer.ggml.tokens");
  const size_t n = v.tokens.size();
  if (f.has("tokenizer.ggml.scores")) {
    const auto s = f.get_float_array("tokenizer.ggml.scores");
    FOCUS_CHECK(s.size() == n, path, ": tokenizer.ggml.scores has ", s.size(), " entries for ", n, " tokens");
    v.scores.assign(s.begin(), s.end());
  } else {
    FOCUS_CHECK(v.kind != VocabData::Kind::SentencePiece, path, ": 'llama' tokenizer without tokenizer.ggml.scores");
  }
  if (f.has("tokenizer.ggml.token_type")) {
    const auto t = f.get_int_array("tokenizer.ggml.token_type");
    FOCUS_CHECK(t.size() == n, path, ": tokenizer.ggml.token_type has ", t.size(), " entries for ", n, " tokens");
    v.types.assign(t.begin(), t.end());
  }
  if (v.kind == VocabData::Kind::ByteBPE) {
    v.merges = f.get_string_array("tokenizer.ggml.merges");
    check_merges(v.tokens, v.merges, path);
    v.pre = f.get_string("tokenizer.ggml.pre", "gpt2");
  }
  v.bos = (int32_t)f.get_int("tokenizer.ggml.bos_token_id", -1);
  v.eos = (int32_t)f.get_int("tokenizer.ggml.eos_token_id", -1);
  v.unk = (int32_t)f.get_int("tokenizer.ggml.unknown_token_id", -1);
  const bool spm = v.kind == VocabData::Kind::SentencePiece;
  v.add_bos = f.get_int("tokenizer.ggml.add_bos_token", spm ? 1 : 0) != 0;
  v.add_space_prefix = f.get_int("tokenizer.ggml.add_space_prefix", spm ? 1 : 0) != 0;
  check_vocab(v, path);
  for (size_t i = 0; i < n; ++i)
    FOCUS_CHECK(unicode::is_valid_utf8(v.tokens[i]), path, ": token ", i, " is not valid UTF-8");
  return v;
}

VocabData vocab_from_llama2c(const std::string& path, int32_t vocab_size) {
  FOCUS_CHECK(vocab_size >= 0, path, ": negative vocabulary size ", vocab_size);
  MappedFile f(path);
  const uint8_t* p = f.data();
  const size_t size = f.size();
  FOCUS_CHECK(size >= 4, path, ": too small for a llama2.c tokenizer (", size, " bytes)");
  int32_t max_len;
  std::memcpy(&max_len, p, 4);
  FOCUS_CHECK(max_len > 0 && max_len <= (1 << 16), path, ": implausible max_token_length ", max_len,
              " (not a llama2.c tokenizer?)");
  VocabData v;
  v.kind = VocabData::Kind::SentencePiece;
  size_t pos = 4;
  while (vocab_size == 0 ? pos < size : v.tokens.size() < (size_t)vocab_size) {
    const size_t i = v.tokens.size();
    FOCUS_CHECK(size - pos >= 8, path, ": truncated at token ", i, " (offset ", pos, ", ", size - pos,
                " bytes left, need 8 for score and length)");
    float score;
    int32_t len;
    std::memcpy(&score, p + pos, 4);
    std::memcpy(&len, p + pos + 4, 4);
    pos += 8;
    FOCUS_CHECK(len >= 0 && (size_t)len <= size - pos, path, ": token ", i, " at offset ", pos - 4,
                " claims ", len, " bytes but only ", size - pos, " remain (truncated or corrupt)");
    FOCUS_CHECK(std::isfinite(score), path, ": token ", i, " has a non-finite score");
    v.tokens.emplace_back(reinterpret_cast<const char*>(p + pos), (size_t)len);
    v.scores.push_back(score);
    pos += len;
  }
  FOCUS_CHECK(v.tokens.size() >= 3, path, ": only ", v.tokens.size(), " tokens");
  v.unk = 0;
  v.bos = 1;
  v.eos = 2;
  v.add_bos = true;
  v.add_space_prefix = true;
  return v;
}

VocabData vocab_from_gpt2_files(const std::string& vocab_json, const std::string& merges_txt) {
  VocabData v;
  v.kind = VocabData::Kind::ByteBPE;
  v.tokens = tokens_from_map(parse_json_file(vocab_json), vocab_json);
  const std::string text = read_file(merges_txt);
  size_t pos = 0, line_no = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) nl = text.size();
    std::string line = text.substr(pos, nl - pos);
    pos = nl + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || (line_no == 1 && line.rfind("#version", 0) == 0)) continue;
    FOCUS_CHECK(line.find(' ', 1) != std::string::npos, merges_txt, ":", line_no, ": expected 'token token', got '",
                line, "'");
    v.merges.push_back(std::move(line));
  }
  {
    std::unordered_set<std::string_view> have(v.tokens.begin(), v.tokens.end());
    for (size_t r = 0; r < v.merges.size(); ++r) {
      const std::string& m = v.merges[r];
      const size_t sp = m.find(' ', 1);
      for (const std::string& t : {m.substr(0, sp), m.substr(sp + 1), m.substr(0, sp) + m.substr(sp + 1)})
        FOCUS_CHECK(have.count(t), merges_txt, ": merge ", r + 1, " ('", m, "') references token '", t, "', which is not in ",
                    vocab_json);
    }
  }
  v.pre = "gpt2";
  const int32_t eot = find_token(v.tokens, {"<|endoftext|>"});
  v.bos = v.eos = eot;
  if (eot >= 0) {
    v.types.assign(v.tokens.size(), kTypeNormal);
    v.types[eot] = kTypeControl;
  }
  return v;
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path, int32_t vocab_size) {
  FOCUS_CHECK(fs::exists(path), path, ": no such file or directory");
  if (fs::is_directory(path)) {
    const fs::path d(path);
    for (auto [vj, mt] : {std::pair<const char*, const char*>{"vocab.json", "merges.txt"}, {"encoder.json", "vocab.bpe"}})
      if (fs::exists(d / vj) && fs::exists(d / mt))
        return build(vocab_from_gpt2_files((d / vj).string(), (d / mt).string()), path);
    if (fs::exists(d / "tokenizer.json")) return load_tokenizer((d / "tokenizer.json").string(), vocab_size);
    if (fs::exists(d / "tokenizer.bin")) return load_tokenizer((d / "tokenizer.bin").string(), vocab_size);
    fail(path, ": no tokenizer here (looked for vocab.json + merges.txt, encoder.json + vocab.bpe, tokenizer.json, "
               "tokenizer.bin)");
  }
  char magic[4] = {0, 0, 0, 0};
  {
    MappedFile f(path);
    if (f.size() >= 4) std::memcpy(magic, f.data(), 4);
  }
  if (std::memcmp(magic, "GGUF", 4) == 0) {
    GGUFFile f(path);
    return build(vocab_from_gguf(f), path);
  }
  const std::string name = fs::path(path).filename().string();
  FOCUS_CHECK(!ends_with(name, ".model"), path,
              ": SentencePiece .model files are not read directly; use its llama2.c tokenizer.bin export or a GGUF");
  if (ends_with(name, ".json")) {
    if (name == "vocab.json" || name == "encoder.json") {
      const fs::path dir = fs::path(path).parent_path();
      const fs::path merges = dir / (name == "vocab.json" ? "merges.txt" : "vocab.bpe");
      FOCUS_CHECK(fs::exists(merges), path, ": needs ", merges.string(), " beside it");
      return build(vocab_from_gpt2_files(path, merges.string()), path);
    }
    return build(vocab_from_hf_json(path), path);
  }
  return build(vocab_from_llama2c(path, vocab_size), path);
}

}  // namespace focus::io
