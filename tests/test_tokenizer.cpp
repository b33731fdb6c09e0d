#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/mapped_file.h"
#include "io/gguf.h"
#include "io/tokenizer.h"
#include "test_util.h"

namespace fs = std::filesystem;
using focus::io::Tokenizer;
using focus::io::VocabData;
using Ids = std::vector<int32_t>;

namespace {

std::string gpt2_dir() { return focus::test::data_path("tokenizers/gpt2"); }
std::string tok512_path() { return focus::test::data_path("models/stories260K/tok512.bin"); }
std::string llama2_path() { return focus::test::data_path("tokenizers/llama2-32k/tokenizer.bin"); }
std::string text_path(const std::string& name) { return focus::test::data_path("text/" + name); }

// Loaded once per test program; every test checks its input exists first.
const Tokenizer& cached(const std::string& path) {
  static std::map<std::string, std::unique_ptr<Tokenizer>> loaded;
  auto& t = loaded[path];
  if (!t) t = focus::io::load_tokenizer(path);
  return *t;
}

// A text file as the MANIFEST counts it: BOM dropped, CRLF -> LF, everything else kept.
std::string read_text(const std::string& path) {
  std::string s = focus::read_file(path);
  if (s.rfind("\xEF\xBB\xBF", 0) == 0) s.erase(0, 3);
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i)
    if (!(s[i] == '\r' && i + 1 < s.size() && s[i + 1] == '\n')) out += s[i];
  return out;
}

std::vector<std::string> all_text_files() {
  std::vector<std::string> files;
  const std::string dir = focus::test::data_path("text");
  if (fs::is_directory(dir))
    for (const auto& e : fs::directory_iterator(dir))
      if (e.is_regular_file()) files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  return files;
}

std::string write_file(const std::string& name, const std::string& bytes) {
  const std::string p = ::testing::TempDir() + "/" + name;
  std::ofstream f(p, std::ios::binary);
  f << bytes;
  return p;
}

template <typename F>
std::string error_of(F&& f) {
  const std::string m = focus::test::error_of(f);
  return m.empty() ? "(no error)" : m;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Encodes and decodes every text file (or its first `prefix` bytes, cut at a UTF-8 boundary).
void round_trip_all_files(const Tokenizer& tok, size_t prefix) {
  const auto files = all_text_files();
  if (files.empty()) {
    if (focus::test::require_data()) FAIL() << "no text files under " << focus::test::data_path("text");
    GTEST_SKIP() << "no text files";
  }
  for (const auto& f : files) {
    std::string t = read_text(f);
    if (t.size() > prefix) {
      size_t n = prefix;
      while (n > 0 && ((unsigned char)t[n] & 0xC0) == 0x80) --n;
      t.resize(n);
    }
    const Ids ids = tok.encode(t, true);
    const std::string back = tok.decode(ids);
    EXPECT_TRUE(back == t) << fs::path(f).filename() << ": decode(encode(text)) differs from the text";
    EXPECT_GT(ids.size(), t.size() / 8) << f;
  }
}

// Varied sentences; their ids below come from scripts/tokenizer_reference.py (Hugging Face
// tokenizers for SmolLM2, sentencepiece for Llama 2 and Gemma 3).
const char* const kSentences[] = {
    "Hello world",
    "The year 2024 had 366 days; pi is 3.14159 and 1,000,000 is a million.",
    "  Leading spaces,   three inside, and trailing  ",
    "Tabs\tand\nnewlines\n\n\nand a CRLF\r\nline",
    "Don't stop: it's 'quoted' & \"double\" \xE2\x80\x94 dashes\xE2\x80\xA6 (parens) [brackets] {braces} #hash "
    "@at $100 50%",
    "\xC3\x9Cn\xC3\xAF" "c\xC3\xB6" "d\xC3\xA9: caf\xC3\xA9, Stra\xC3\x9F" "e, \xCE\x95\xCE\xBB\xCE\xBB\xCE\xB7\xCE\xBD"
    "\xCE\xB9\xCE\xBA\xCE\xAC, \xD1\x80\xD1\x83\xD1\x81\xD1\x81\xD0\xBA\xD0\xB8\xD0\xB9, "
    "\xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E\xE3\x81\xAE\xE3\x83\x86\xE3\x82\xAD\xE3\x82\xB9\xE3\x83\x88, "
    "\xED\x95\x9C\xEA\xB5\xAD\xEC\x96\xB4, emoji \xF0\x9F\xA4\x96\xF0\x9F\x8E\x89",
    "x\xC2\xB2 \xC2\xBD \xE2\x85\xB7 \xD9\xA1\xD9\xA2\xD9\xA3 numbers in other scripts",
    "<|im_start|>user\nHi<|im_end|>",
};

}  // namespace

// ------------------------------------------------------------------ GPT-2

TEST(TokenizerGPT2, KnownIds) {
  FOCUS_NEED_FILE(gpt2_dir() + "/encoder.json");
  const Tokenizer& t = cached(gpt2_dir());
  EXPECT_EQ(t.vocab_size(), 50257);
  EXPECT_EQ(t.encode("Hello world", false), (Ids{15496, 995}));
  EXPECT_EQ(t.encode("The quick brown fox jumps over the lazy dog.", false),
            (Ids{464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13}));
  EXPECT_EQ(t.eos(), 50256);
  EXPECT_FALSE(t.add_bos_default());
  EXPECT_EQ(t.decode({15496, 995}), "Hello world");
}

TEST(TokenizerGPT2, SpecialTextIsPlainText) {
  FOCUS_NEED_FILE(gpt2_dir() + "/encoder.json");
  const Tokenizer& t = cached(gpt2_dir());
  const Ids ids = t.encode("a<|endoftext|>b", false);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 50256), 0);
  EXPECT_EQ(t.decode(ids), "a<|endoftext|>b");
  EXPECT_EQ(t.decode({50256}), "");  // EOS decodes to nothing
}

TEST(TokenizerGPT2, WholeFileCountsMatchManifest) {
  // BOM dropped, CRLF -> LF, Project Gutenberg boilerplate kept.
  const std::pair<const char*, size_t> cases[] = {
      {"tinyshakespeare.txt", 338025},
      {"pg-1661-the-adventures-of-sherlock-holmes.txt", 150528},
      {"pg-2600-war-and-peace.txt", 854037},
      {"wikitext-2-raw-v1-test-hf-rows-crlf.txt", 283287},
      {"wikitext-2-v1-tokenized-test.txt", 295877},
      {"tinystories-sample-cs336.txt", 953},
  };
  FOCUS_NEED_FILE(gpt2_dir() + "/encoder.json");
  for (const auto& [name, count] : cases) FOCUS_NEED_FILE(text_path(name));
  const Tokenizer& t = cached(gpt2_dir());
  for (const auto& [name, count] : cases) EXPECT_EQ(t.encode(read_text(text_path(name)), false).size(), count) << name;
}

TEST(TokenizerGPT2, FolderFilePairAndTokenizerJsonAgree) {
  FOCUS_NEED_FILE(gpt2_dir() + "/encoder.json");
  const std::string text = "It's 2024:  numbers 12345, caf\xC3\xA9 \xF0\x9F\xA4\x96\n\n  end ";
  const Ids want = cached(gpt2_dir()).encode(text, false);
  auto from_json = focus::io::load_tokenizer(gpt2_dir() + "/encoder.json");
  EXPECT_EQ(from_json->encode(text, false), want);

  // The same vocabulary as a Hugging Face tokenizer.json.
  const VocabData v = focus::io::vocab_from_gpt2_files(gpt2_dir() + "/encoder.json", gpt2_dir() + "/vocab.bpe");
  nlohmann::json j;
  nlohmann::json vocab = nlohmann::json::object();
  for (size_t i = 0; i < v.tokens.size(); ++i)
    if (v.tokens[i] != "<|endoftext|>") vocab[v.tokens[i]] = i;
  j["model"] = {{"type", "BPE"}, {"vocab", vocab}, {"merges", v.merges}};
  j["added_tokens"] = nlohmann::json::array({{{"id", 50256}, {"content", "<|endoftext|>"}, {"special", true}}});
  j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  j["decoder"] = {{"type", "ByteLevel"}};
  const std::string dir = ::testing::TempDir() + "/hf_gpt2";
  fs::create_directories(dir);
  write_file("hf_gpt2/tokenizer.json", j.dump());
  auto hf = focus::io::load_tokenizer(dir);
  EXPECT_EQ(hf->encode(text, false), want);
  EXPECT_EQ(hf->eos(), 50256);
  EXPECT_EQ(hf->decode(want), text);
}

TEST(TokenizerGPT2, UnknownPreTokenizerFallsBackToGpt2) {
  FOCUS_NEED_FILE(gpt2_dir() + "/encoder.json");
  VocabData v = focus::io::vocab_from_gpt2_files(gpt2_dir() + "/encoder.json", gpt2_dir() + "/vocab.bpe");
  v.pre = "no-such-pre-tokenizer";
  auto t = focus::io::make_tokenizer(v);
  EXPECT_EQ(t->encode("Hello world 123", false), cached(gpt2_dir()).encode("Hello world 123", false));
}

TEST(TokenizerGPT2, UserDefinedTokensAreCutOutWhole) {
  FOCUS_NEED_FILE(gpt2_dir() + "/encoder.json");
  std::unique_ptr<Tokenizer> t;
  {
    VocabData v = focus::io::vocab_from_gpt2_files(gpt2_dir() + "/encoder.json", gpt2_dir() + "/vocab.bpe");
    v.tokens.push_back("<tag>");
    v.types.push_back(4);  // user-defined
    t = focus::io::make_tokenizer(v);
  }  // the tokenizer must not depend on the VocabData it was made from
  const Ids ids = t->encode("x<tag>y <tag><ta", false);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 50257), 2);
  EXPECT_EQ(t->decode(ids), "x<tag>y <tag><ta");
}

TEST(TokenizerGPT2, InvalidUtf8RoundTrips) {
  FOCUS_NEED_FILE(gpt2_dir() + "/encoder.json");
  const Tokenizer& t = cached(gpt2_dir());
  const std::string s = "ok \xFF\xFE broken \xC3 end\xE2\x82";
  EXPECT_EQ(t.decode(t.encode(s, false)), s);
  EXPECT_TRUE(t.encode("", false).empty());
}

// ------------------------------------------------------------------ llama2.c vocabularies

TEST(TokenizerLlama2c, Tok512KnownIds) {
  FOCUS_NEED_FILE(tok512_path());
  const Tokenizer& t = cached(tok512_path());
  EXPECT_EQ(t.vocab_size(), 512);
  EXPECT_EQ(t.bos(), 1);
  EXPECT_EQ(t.eos(), 2);
  EXPECT_TRUE(t.add_bos_default());
  const Ids ids = t.encode("Once upon a time, there was a little girl named Lily.", true);
  EXPECT_EQ(ids, (Ids{1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426}));
  EXPECT_EQ(t.decode(ids), "Once upon a time, there was a little girl named Lily.");
  // Streaming pieces: the dummy-prefix space is dropped right after BOS.
  std::string streamed;
  for (size_t i = 1; i < ids.size(); ++i) streamed += t.piece(ids[i], ids[i - 1]);
  EXPECT_EQ(streamed, "Once upon a time, there was a little girl named Lily.");
  EXPECT_EQ(t.encode("", true), (Ids{1}));
}

TEST(TokenizerLlama2c, Llama2KnownIds) {
  FOCUS_NEED_FILE(llama2_path());
  const Tokenizer& t = cached(llama2_path());
  EXPECT_EQ(t.vocab_size(), 32000);
  EXPECT_EQ(t.encode("Once upon a time", true), (Ids{1, 9038, 2501, 263, 931}));
  // From sentencepiece on tokenizer.model (scripts/tokenizer_reference.py llama2).
  const std::vector<Ids> want = {
      {15043, 3186},
      {450, 1629, 29871, 29906, 29900, 29906, 29946, 750, 29871, 29941, 29953, 29953, 3841, 29936, 2930, 338, 29871, 29941, 29889, 29896, 29946, 29896, 29945, 29929, 322, 29871, 29896, 29892, 29900, 29900, 29900, 29892, 29900, 29900, 29900, 338, 263, 7284, 29889},
      {259, 951, 9382, 8162, 29892, 259, 2211, 2768, 29892, 322, 25053, 259},
      {323, 6897, 12, 392, 13, 1482, 9012, 13, 13, 13, 392, 263, 315, 2241, 29943, 30004, 13, 1220},
      {3872, 29915, 29873, 5040, 29901, 372, 29915, 29879, 525, 339, 5715, 29915, 669, 376, 8896, 29908, 813, 12569, 267, 30098, 313, 862, 575, 29897, 518, 2634, 9737, 29962, 426, 2634, 778, 29913, 396, 8568, 732, 271, 395, 29896, 29900, 29900, 29871, 29945, 29900, 29995},
      {7189, 29876, 30085, 29883, 9289, 29948, 29901, 274, 28059, 29892, 22667, 29892, 29871, 30311, 30142, 30142, 30183, 30133, 30136, 30173, 30216, 29892, 14251, 2542, 29892, 29871, 30325, 30346, 30968, 30199, 30572, 30454, 30255, 30279, 29892, 29871, 30877, 31293, 31129, 29892, 953, 29877, 2397, 29871, 243, 162, 167, 153, 243, 162, 145, 140},
      {921, 30088, 29871, 30226, 29871, 229, 136, 186, 29871, 220, 164, 220, 165, 220, 166, 3694, 297, 916, 12078},
      {529, 29989, 326, 29918, 2962, 29989, 29958, 1792, 13, 18567, 29966, 29989, 326, 29918, 355, 29989, 29958},
  };
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(t.encode(kSentences[i], false), want[i]) << kSentences[i];
    EXPECT_EQ(t.decode(t.encode(kSentences[i], true)), kSentences[i]);
  }
}

TEST(TokenizerLlama2c, Llama2WholeFileCounts) {
  // Token counts from sentencepiece on tokenizer.model over the whole prepared file.
  const std::pair<const char*, size_t> cases[] = {
      {"tinyshakespeare.txt", 368633},
      {"pg-1661-the-adventures-of-sherlock-holmes.txt", 161992},
      {"wikitext-2-raw-v1-test-hf-rows-crlf.txt", 332754},
  };
  FOCUS_NEED_FILE(llama2_path());
  for (const auto& [name, count] : cases) FOCUS_NEED_FILE(text_path(name));
  const Tokenizer& t = cached(llama2_path());
  for (const auto& [name, count] : cases) EXPECT_EQ(t.encode(read_text(text_path(name)), false).size(), count) << name;
}

// The Llama 2 vocabulary written the way Hugging Face stores SentencePiece BPE models
// (tokenizer.json with ranked merges, U+2581 for spaces, byte fallback) must tokenize the same.
TEST(TokenizerLlama2c, SameAsHuggingFaceSentencePieceJson) {
  FOCUS_NEED_FILE(llama2_path());
  const VocabData v = focus::io::vocab_from_llama2c(llama2_path(), 32000);
  const std::string marker = "\xE2\x96\x81";
  std::vector<std::string> pieces(v.tokens.size());
  std::map<std::string, int32_t> id_of;
  for (size_t i = 0; i < v.tokens.size(); ++i) {
    std::string t = i == 1 ? "<s>" : i == 2 ? "</s>" : v.tokens[i];
    for (size_t p = 0; (p = t.find(' ', p)) != std::string::npos;) t.replace(p, 1, marker);
    pieces[i] = t;
    id_of[t] = (int32_t)i;
  }
  // Merges in the order of the scores of the pieces they make, as converters write them.
  std::vector<std::pair<int32_t, std::string>> merges;
  for (size_t i = 3; i < pieces.size(); ++i) {
    const std::string& t = pieces[i];
    for (size_t p = 1; p < t.size(); ++p) {
      if (((unsigned char)t[p] & 0xC0) == 0x80) continue;
      auto a = id_of.find(t.substr(0, p)), b = id_of.find(t.substr(p));
      if (a != id_of.end() && b != id_of.end() && a->second > 2 && b->second > 2)
        merges.push_back({(int32_t)i, t.substr(0, p) + " " + t.substr(p)});
    }
  }
  std::stable_sort(merges.begin(), merges.end(),
                   [&](const auto& x, const auto& y) { return v.scores[x.first] > v.scores[y.first]; });
  nlohmann::json vocab = nlohmann::json::object(), merge_list = nlohmann::json::array();
  for (size_t i = 0; i < pieces.size(); ++i) vocab[pieces[i]] = i;
  for (const auto& m : merges) merge_list.push_back(m.second);
  nlohmann::json j;
  j["model"] = {{"type", "BPE"}, {"vocab", vocab}, {"merges", merge_list}, {"byte_fallback", true},
                {"unk_token", "<unk>"}};
  j["added_tokens"] = nlohmann::json::array({{{"id", 0}, {"content", "<unk>"}, {"special", true}},
                                             {{"id", 1}, {"content", "<s>"}, {"special", true}},
                                             {{"id", 2}, {"content", "</s>"}, {"special", true}}});
  j["normalizer"] = {{"type", "Sequence"},
                     {"normalizers", {{{"type", "Prepend"}, {"prepend", marker}},
                                      {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", marker}}}}};
  j["decoder"] = {{"type", "Sequence"}, {"decoders", nlohmann::json::array({{{"type", "ByteFallback"}}})}};
  const std::string dir = ::testing::TempDir() + "/hf_llama2";
  fs::create_directories(dir);
  const std::string path = write_file("hf_llama2/tokenizer.json", j.dump());
  auto hf = focus::io::load_tokenizer(path);
  const Tokenizer& bin = cached(llama2_path());
  EXPECT_EQ(hf->bos(), 1);
  EXPECT_EQ(hf->eos(), 2);
  EXPECT_TRUE(hf->add_bos_default());
  for (const char* s : kSentences) EXPECT_EQ(hf->encode(s, true), bin.encode(s, true)) << s;
  const std::string name = text_path("pg-1661-the-adventures-of-sherlock-holmes.txt");
  FOCUS_NEED_FILE(name);
  const std::string text = read_text(name).substr(0, 200000);
  const Ids ids = hf->encode(text, true);
  EXPECT_EQ(ids, bin.encode(text, true));
  EXPECT_EQ(hf->decode(ids), text);
}

TEST(TokenizerLlama2c, TruncatedFile) {
  FOCUS_NEED_FILE(tok512_path());
  const std::string good = focus::read_file(tok512_path());
  const std::string p = write_file("tok512_truncated.bin", good.substr(0, good.size() - 3));
  const std::string e = error_of([&] { focus::io::vocab_from_llama2c(p, 512); });
  EXPECT_TRUE(contains(e, p)) << e;
  EXPECT_TRUE(contains(e, "token 511")) << e;
  // Asking for more tokens than the file has.
  const std::string e2 = error_of([&] { focus::io::vocab_from_llama2c(tok512_path(), 600); });
  EXPECT_TRUE(contains(e2, "truncated")) << e2;
  // Too small for a header.
  const std::string tiny = write_file("tok_tiny.bin", "ab");
  EXPECT_TRUE(contains(error_of([&] { focus::io::vocab_from_llama2c(tiny, 0); }), "too small"));
}

TEST(TokenizerLlama2c, AbsurdLengthField) {
  std::string bytes(4, '\0');
  const int32_t max_len = 7, len = 1 << 30;
  const float score = 0.f;
  std::memcpy(bytes.data(), &max_len, 4);
  bytes.append(reinterpret_cast<const char*>(&score), 4);
  bytes.append(reinterpret_cast<const char*>(&len), 4);
  bytes += "abc";
  const std::string p = write_file("tok_absurd.bin", bytes);
  const std::string e = error_of([&] { focus::io::vocab_from_llama2c(p, 0); });
  EXPECT_TRUE(contains(e, p) && contains(e, "claims 1073741824 bytes")) << e;
  const int32_t neg = -5;
  std::memcpy(bytes.data() + 8, &neg, 4);
  const std::string p2 = write_file("tok_negative.bin", bytes);
  EXPECT_TRUE(contains(error_of([&] { focus::io::vocab_from_llama2c(p2, 0); }), "claims -5 bytes"));
  const int32_t bad_max = -1;
  std::memcpy(bytes.data(), &bad_max, 4);
  const std::string p3 = write_file("tok_badmax.bin", bytes);
  EXPECT_TRUE(contains(error_of([&] { focus::io::vocab_from_llama2c(p3, 0); }), "max_token_length"));
}

TEST(TokenizerLlama2c, ByteFallbackAndInvalidUtf8RoundTrip) {
  FOCUS_NEED_FILE(tok512_path());
  const Tokenizer& t = cached(tok512_path());
  const std::string s = "Lily saw \xE6\x97\xA5\xE6\x9C\xAC \xF0\x9F\xA4\x96 and \xFF\xC3 bytes";
  const Ids ids = t.encode(s, true);
  EXPECT_EQ(t.decode(ids), s);
  EXPECT_NE(std::find(ids.begin(), ids.end(), 3 + 0xE6), ids.end());  // <0xE6>
}

// ------------------------------------------------------------------ GGUF vocabularies

TEST(TokenizerGGUF, SmolLM2KnownIds) {
  const std::string p = focus::test::smollm2_path();
  FOCUS_NEED_FILE(p);
  const Tokenizer& t = cached(p);
  EXPECT_EQ(t.vocab_size(), 49152);
  EXPECT_FALSE(t.add_bos_default());
  // From Hugging Face tokenizers built on the same GGUF vocabulary and merges
  // (scripts/tokenizer_reference.py smollm2).
  const std::vector<Ids> want = {
      {19556, 905},
      {504, 713, 216, 34, 32, 34, 36, 761, 216, 35, 38, 38, 2009, 43, 16916, 314, 216, 35, 30, 33, 36, 33, 37, 41, 284, 216, 33, 28, 32, 32, 32, 28, 32, 32, 32, 314, 253, 2215, 30},
      {216, 36970, 5600, 28, 256, 1296, 2972, 28, 284, 35079, 256},
      {68, 7366, 197, 397, 198, 2241, 5110, 1116, 198, 397, 253, 340, 9483, 54, 201, 198, 1311},
      {8084, 982, 2853, 42, 357, 506, 637, 385, 5036, 23, 1456, 476, 21414, 18, 1841, 287, 9604, 2829, 365, 7126, 5400, 25, 933, 6838, 936, 1175, 77, 1662, 6838, 561, 109, 907, 14307, 3394, 261, 1885, 33, 32, 32, 216, 37, 32, 21},
      {142, 246, 94, 25972, 83, 7466, 84, 2756, 42, 37366, 28, 19144, 34878, 85, 28, 5664, 239, 17162, 17162, 25723, 11517, 12001, 21118, 26112, 28, 216, 9175, 14714, 9382, 39511, 7872, 24958, 28, 17097, 241, 115, 40993, 179, 120, 248, 26453, 11100, 224, 10391, 251, 10391, 134, 11100, 226, 28, 216, 33085, 246, 181, 130, 251, 183, 240, 129, 28, 649, 33777, 15107, 114, 240, 10813, 232, 227},
      {104, 19133, 216, 16738, 216, 173, 223, 132, 216, 164, 111, 164, 112, 164, 113, 2966, 281, 550, 18487},
      {44, 108, 306, 79, 3738, 108, 46, 4093, 198, 26843, 44, 108, 306, 79, 486, 108, 46},
  };
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(t.encode(kSentences[i], false), want[i]) << kSentences[i];
    EXPECT_EQ(t.decode(want[i]), kSentences[i]);
  }
  // Control tokens decode to their text (BOS/EOS to nothing) but never come out of plain text.
  EXPECT_EQ(t.decode({0}), "<|endoftext|>");
  EXPECT_EQ(t.decode({1, 2}), "");
}

TEST(TokenizerGGUF, SmolLM2WholeFileCounts) {
  // From scripts/tokenizer_reference.py smollm2 --file (ids agreed token for token).
  const std::pair<const char*, size_t> cases[] = {
      {"tinyshakespeare.txt", 341094},
      {"pg-2600-war-and-peace.txt", 823612},
      {"wikitext-2-raw-v1-test-hf-rows-crlf.txt", 301948},
  };
  const std::string p = focus::test::smollm2_path();
  FOCUS_NEED_FILE(p);
  for (const auto& [name, count] : cases) FOCUS_NEED_FILE(text_path(name));
  const Tokenizer& t = cached(p);
  for (const auto& [name, count] : cases) EXPECT_EQ(t.encode(read_text(text_path(name)), false).size(), count) << name;
}

TEST(TokenizerGGUF, Gemma3KnownIds) {
  const std::string p = focus::test::gemma3_path();
  FOCUS_NEED_FILE(p);
  const Tokenizer& t = cached(p);
  EXPECT_EQ(t.vocab_size(), 262144);
  EXPECT_EQ(t.bos(), 2);
  EXPECT_EQ(t.eos(), 1);
  EXPECT_TRUE(t.add_bos_default());
  // From sentencepiece on a model built from the same GGUF pieces and scores, with the
  // user-defined pieces (newline/space runs, HTML tags) cut out first
  // (scripts/tokenizer_reference.py gemma3).
  const std::vector<Ids> want = {
      {9259, 1902},
      {818, 1051, 236743, 236778, 236771, 236778, 236812, 1053, 236743, 236800, 236825, 236825, 2668, 236793, 4604, 563, 236743, 236800, 236761, 236770, 236812, 236770, 236810, 236819, 532, 236743, 236770, 236764, 236771, 236771, 236771, 236764, 236771, 236771, 236771, 563, 496, 3625, 236761},
      {138, 91293, 9952, 236764, 139, 19891, 4888, 236764, 532, 45330, 138},
      {76222, 255968, 624, 107, 208697, 109, 624, 496, 174055, 236811, 251, 107, 1257},
      {8993, 236789, 236745, 4721, 236787, 625, 236789, 236751, 756, 148758, 236789, 833, 623, 7902, 236775, 2192, 157677, 237064, 568, 16611, 3852, 236768, 870, 212439, 236842, 642, 1457, 2620, 236783, 997, 11240, 1392, 502, 609, 236770, 236771, 236771, 236743, 236810, 236771, 236908},
      {238194, 236749, 238527, 236755, 55515, 236859, 236787, 33443, 236764, 80176, 236764, 23883, 109959, 42220, 236764, 170362, 236764, 33375, 238582, 236945, 95830, 236764, 50413, 237430, 236764, 64334, 236743, 246143, 242061},
      {236781, 238131, 47041, 236743, 464, 371, 421, 115241, 241303, 242044, 4945, 528, 1032, 32524},
      {236820, 236909, 548, 236779, 3041, 111038, 2364, 107, 10979, 236820, 236909, 548, 236779, 643, 111038},
  };
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(t.encode(kSentences[i], false), want[i]) << kSentences[i];
    EXPECT_EQ(t.decode(want[i]), kSentences[i]);
  }
  const Ids ids = t.encode("Hi", true);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids[0], 2);
  EXPECT_EQ(t.decode(ids), "Hi");
}

TEST(TokenizerGGUF, Gemma3WholeFileCounts) {
  // From scripts/tokenizer_reference.py gemma3 --file (ids agreed token for token).
  const std::pair<const char*, size_t> cases[] = {
      {"tinyshakespeare.txt", 321210},
      {"pg-2600-war-and-peace.txt", 778351},
      {"wikitext-2-raw-v1-test-hf-rows-crlf.txt", 292281},
  };
  const std::string p = focus::test::gemma3_path();
  FOCUS_NEED_FILE(p);
  for (const auto& [name, count] : cases) FOCUS_NEED_FILE(text_path(name));
  const Tokenizer& t = cached(p);
  for (const auto& [name, count] : cases) EXPECT_EQ(t.encode(read_text(text_path(name)), false).size(), count) << name;
}

TEST(TokenizerGGUF, UnsupportedModelNamesFileAndModel) {
  // A minimal GGUF v3 file: no tensors, one string key.
  std::string b = "GGUF";
  auto u32 = [&](uint32_t v) { b.append(reinterpret_cast<const char*>(&v), 4); };
  auto u64 = [&](uint64_t v) { b.append(reinterpret_cast<const char*>(&v), 8); };
  auto str = [&](const std::string& s) { u64(s.size()); b += s; };
  u32(3);
  u64(0);
  u64(1);
  str("tokenizer.ggml.model");
  u32(8);  // string
  str("bert");
  const std::string p = write_file("tok_bert.gguf", b);
  const std::string e = error_of([&] {
    focus::io::GGUFFile f(p);
    focus::io::vocab_from_gguf(f);
  });
  EXPECT_TRUE(contains(e, p) && contains(e, "bert")) << e;
  const std::string e2 = error_of([&] { focus::io::load_tokenizer(p); });
  EXPECT_TRUE(contains(e2, "bert")) << e2;
}

// ------------------------------------------------------------------ round trips over every text file

TEST(TokenizerRoundTrip, GPT2AllFiles) {
  FOCUS_NEED_FILE(gpt2_dir() + "/encoder.json");
  round_trip_all_files(cached(gpt2_dir()), SIZE_MAX);
}
TEST(TokenizerRoundTrip, Tok512AllFiles) {
  FOCUS_NEED_FILE(tok512_path());
  round_trip_all_files(cached(tok512_path()), SIZE_MAX);
}
TEST(TokenizerRoundTrip, Llama2AllFiles) {
  FOCUS_NEED_FILE(llama2_path());
  round_trip_all_files(cached(llama2_path()), SIZE_MAX);
}
TEST(TokenizerRoundTrip, SmolLM2AllFiles) {
  FOCUS_NEED_FILE(focus::test::smollm2_path());
  round_trip_all_files(cached(focus::test::smollm2_path()), SIZE_MAX);
}
TEST(TokenizerRoundTrip, Gemma3AllFiles) {
  FOCUS_NEED_FILE(focus::test::gemma3_path());
  // The smaller shapes: the first 256 KB of each file (the slowest of the round trips sanitized).
  round_trip_all_files(cached(focus::test::gemma3_path()), focus::test::small_shapes() ? (256u << 10) : SIZE_MAX);
}

// ------------------------------------------------------------------ malformed GPT-2 files and vocab data

TEST(TokenizerErrors, BadVocabJson) {
  const std::string merges = write_file("ok_merges.txt", "#version: 0.2\na b\n");
  const std::string bad = write_file("bad_vocab.json", "{\"a\": 0, \"b\": 1,");
  std::string e = error_of([&] { focus::io::vocab_from_gpt2_files(bad, merges); });
  EXPECT_TRUE(contains(e, bad) && contains(e, "invalid JSON")) << e;
  const std::string not_obj = write_file("array_vocab.json", "[1, 2, 3]");
  e = error_of([&] { focus::io::vocab_from_gpt2_files(not_obj, merges); });
  EXPECT_TRUE(contains(e, not_obj) && contains(e, "object")) << e;
  const std::string gap = write_file("gap_vocab.json", "{\"a\": 0, \"b\": 5}");
  e = error_of([&] { focus::io::vocab_from_gpt2_files(gap, merges); });
  EXPECT_TRUE(contains(e, gap) && contains(e, "dense")) << e;
  const std::string dup = write_file("dup_vocab.json", "{\"a\": 0, \"b\": 0}");
  e = error_of([&] { focus::io::vocab_from_gpt2_files(dup, merges); });
  EXPECT_TRUE(contains(e, "more than one token")) << e;
  e = error_of([&] { focus::io::vocab_from_gpt2_files(::testing::TempDir() + "/missing.json", merges); });
  EXPECT_TRUE(contains(e, "missing.json")) << e;
}

TEST(TokenizerErrors, MergeReferencingMissingToken) {
  const std::string vocab = write_file("small_vocab.json", "{\"a\": 0, \"b\": 1, \"ab\": 2}");
  const std::string merges = write_file("bad_merges.txt", "#version: 0.2\na b\nab c\n");
  const std::string e = error_of([&] { focus::io::vocab_from_gpt2_files(vocab, merges); });
  EXPECT_TRUE(contains(e, merges) && contains(e, "merge 2") && contains(e, "'c'")) << e;
  const std::string ok = write_file("ok2_merges.txt", "#version: 0.2\na b\n");
  VocabData v = focus::io::vocab_from_gpt2_files(vocab, ok);
  EXPECT_EQ(v.tokens.size(), 3u);
  EXPECT_EQ(v.merges.size(), 1u);
  v.merges.push_back("b zz");
  const std::string e2 = error_of([&] { focus::io::make_tokenizer(v); });
  EXPECT_TRUE(contains(e2, "unknown token 'zz'")) << e2;
  const std::string one = write_file("one_merges.txt", "#version: 0.2\nab\n");
  EXPECT_TRUE(contains(error_of([&] { focus::io::vocab_from_gpt2_files(vocab, one); }), ":2:"));
}

TEST(TokenizerErrors, InconsistentVocabData) {
  VocabData v;
  EXPECT_TRUE(contains(error_of([&] { focus::io::make_tokenizer(v); }), "empty"));
  v.kind = VocabData::Kind::SentencePiece;
  v.tokens = {"<unk>", "a", "b"};
  v.scores = {0.f, 0.f};
  EXPECT_TRUE(contains(error_of([&] { focus::io::make_tokenizer(v); }), "2 scores for 3 tokens"));
  v.scores = {0.f, 0.f, 0.f};
  v.bos = 7;
  EXPECT_TRUE(contains(error_of([&] { focus::io::make_tokenizer(v); }), "BOS token id 7"));
  v.bos = -1;
  auto t = focus::io::make_tokenizer(v);
  EXPECT_EQ(t->encode("ab", false), (Ids{1, 2}));
  EXPECT_TRUE(contains(error_of([&] { t->decode({3}); }), "out of range"));
  // A character with neither a piece nor byte tokens becomes the unknown token.
  v.unk = 0;
  EXPECT_EQ(focus::io::make_tokenizer(v)->encode("az", false), (Ids{1, 0}));
}

TEST(TokenizerErrors, LoadTokenizerMissingPath) {
  const std::string e = error_of([&] { focus::io::load_tokenizer(::testing::TempDir() + "/nothing_here.bin"); });
  EXPECT_TRUE(contains(e, "nothing_here.bin")) << e;
  const std::string empty_dir = ::testing::TempDir() + "/empty_tok_dir";
  fs::create_directories(empty_dir);
  EXPECT_TRUE(contains(error_of([&] { focus::io::load_tokenizer(empty_dir); }), "no tokenizer here"));
}
