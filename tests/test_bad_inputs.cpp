// Malformed inputs through the `focus` binary: each must end with a clear message naming the
// file and a non-zero exit, never a crash. CI also runs this suite against an AddressSanitizer
// build of the binary (FOCUS_BIN points at it).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/mapped_file.h"
#include "test_util.h"

namespace fs = std::filesystem;
using focus::test::book;
using focus::test::focus_bin;
using focus::test::stories;
using focus::test::tok512;

namespace {

using Run = focus::test::BinRun;
Run run(const std::string& args) { return focus::test::run_focus(args); }

std::string dir() {
  static const std::string d = [] {
    std::string p = ::testing::TempDir() + "/focus_bad_inputs";
    fs::create_directories(p);
    return p;
  }();
  return d;
}

std::string write(const std::string& name, const std::string& bytes) {
  const std::string p = dir() + "/" + name;
  std::ofstream(p, std::ios::binary).write(bytes.data(), (std::streamsize)bytes.size());
  return p;
}

// Minimal GGUF writer for hand-made files.
struct GGUF {
  std::string b;
  void u32(uint32_t v) { b.append(reinterpret_cast<const char*>(&v), 4); }
  void u64(uint64_t v) { b.append(reinterpret_cast<const char*>(&v), 8); }
  void str(const std::string& s) {
    u64(s.size());
    b += s;
  }
  void kv_str(const std::string& k, const std::string& v) {
    str(k);
    u32(8);
    str(v);
  }
  void kv_u32(const std::string& k, uint32_t v) {
    str(k);
    u32(4);
    u32(v);
  }
  void header(uint64_t n_tensors, uint64_t n_kv) {
    b = "GGUF";
    u32(3);
    u64(n_tensors);
    u64(n_kv);
  }
  void tensor(const std::string& name, std::vector<uint64_t> ne, uint32_t type, uint64_t off) {
    str(name);
    u32((uint32_t)ne.size());
    for (auto d : ne) u64(d);
    u32(type);
    u64(off);
  }
  void align_data(size_t n_bytes) {
    while (b.size() % 32) b.push_back('\0');
    b.append(n_bytes, '\0');
  }
};

// A structurally valid GGUF of architecture `arch` holding one F32 tensor (dim 8, 2 heads), with
// the extra integer keys `extra` ("attention.key_length", ...; the architecture prefix is added).
std::string tiny_gguf(const std::string& arch, const std::string& tname, std::vector<uint64_t> ne,
                      const std::vector<std::pair<std::string, uint32_t>>& extra = {}) {
  GGUF g;
  g.header(1, 6 + extra.size());
  g.kv_str("general.architecture", arch);
  g.kv_u32(arch + ".embedding_length", 8);
  g.kv_u32(arch + ".block_count", 1);
  g.kv_u32(arch + ".attention.head_count", 2);
  g.kv_u32(arch + ".feed_forward_length", 16);
  g.kv_u32(arch + ".context_length", 32);
  for (const auto& [k, v] : extra) g.kv_u32(arch + "." + k, v);
  g.tensor(tname, ne, 0, 0);
  uint64_t n = 1;
  for (auto d : ne) n *= d;
  g.align_data(n * 4);
  return g.b;
}

void expect_clean_error(const std::string& args, const std::string& file, const std::string& phrase) {
  if (!fs::exists(focus_bin())) GTEST_SKIP() << "focus binary not built: " << focus_bin();
  Run r = run(args);
  EXPECT_NE(r.code, 0) << args;
  EXPECT_LT(r.code, 128) << "crashed (signal) on " << args << "\n" << r.err;
  EXPECT_NE(r.err.find("error: "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(file), std::string::npos) << "message does not name " << file << ":\n" << r.err;
  EXPECT_NE(r.err.find(phrase), std::string::npos) << "message lacks '" << phrase << "':\n" << r.err;
  EXPECT_EQ(r.err.find("AddressSanitizer"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("runtime error"), std::string::npos) << r.err;
  const size_t at = r.err.rfind("error: ");
  if (at != std::string::npos) {
    const size_t end = r.err.find('\n', at);
    focus::test::record_error(r.err.substr(at + 7, end == std::string::npos ? std::string::npos : end - at - 7),
                              "focus " + args);
  }
}


}  // namespace

TEST(BadInputs, GgufEmptyFile) {
  const auto p = write("empty.gguf", "");
  expect_clean_error("info " + p, p, "GGUF");
}

TEST(BadInputs, GgufWrongMagic) {
  const auto p = write("magic.gguf", "GGUX" + std::string(60, '\0'));
  expect_clean_error("info " + p, p, "GGUF");
}

TEST(BadInputs, GgufTruncatedHeader) {
  FOCUS_NEED_FILE(focus::test::smollm2_path());
  std::string all = focus::read_file(focus::test::smollm2_path());
  const auto p = write("trunc_header.gguf", all.substr(0, 2000));
  expect_clean_error("info " + p, p, "");
}

TEST(BadInputs, GgufTruncatedTensorData) {
  FOCUS_NEED_FILE(focus::test::smollm2_path());
  std::string all = focus::read_file(focus::test::smollm2_path());
  const auto p = write("trunc_data.gguf", all.substr(0, all.size() / 2));
  expect_clean_error("info " + p, p, "");
}

TEST(BadInputs, GgufAbsurdStringLength) {
  GGUF g;
  g.header(0, 1);
  g.u64(1ull << 60);  // key length
  g.b += "general.architecture";
  const auto p = write("absurd_string.gguf", g.b);
  expect_clean_error("info " + p, p, "");
}

TEST(BadInputs, GgufAbsurdTensorCount) {
  GGUF g;
  g.header(1ull << 50, 0);
  const auto p = write("absurd_count.gguf", g.b);
  expect_clean_error("info " + p, p, "");
}

TEST(BadInputs, GgufUnknownTensorType) {
  GGUF g;
  g.header(1, 1);
  g.kv_str("general.architecture", "llama");
  g.tensor("token_embd.weight", {8, 4}, 77, 0);
  g.align_data(256);
  const auto p = write("unknown_type.gguf", g.b);
  expect_clean_error("info " + p, p, "type");
}

TEST(BadInputs, GgufUnknownArchitecture) {
  const auto p = write("mamba.gguf", tiny_gguf("mamba", "token_embd.weight", {8, 4}));
  expect_clean_error("info " + p, p, "unsupported architecture 'mamba'");
}

TEST(BadInputs, GgufMissingTensor) {
  const auto p = write("missing.gguf", tiny_gguf("llama", "token_embd.weight", {8, 4}));
  expect_clean_error("info " + p, p, "missing tensor");
}

TEST(BadInputs, GgufInconsistentShape) {
  const auto p = write("shape.gguf", tiny_gguf("llama", "token_embd.weight", {7, 4}));
  expect_clean_error("info " + p, p, "shape");
}

TEST(BadInputs, GgufValueHeadSizeDiffersFromKeyHeadSize) {
  // Without attention.key_length the key head size is 8 / 2 = 4.
  auto p = write("vlen.gguf", tiny_gguf("llama", "token_embd.weight", {8, 4}, {{"attention.value_length", 8}}));
  expect_clean_error("info " + p, p, "llama.attention.value_length is 8 but the key head size");
  p = write("klen_vlen.gguf", tiny_gguf("llama", "token_embd.weight", {8, 4},
                                        {{"attention.key_length", 4}, {"attention.value_length", 6}}));
  expect_clean_error("info " + p, p, "llama.attention.value_length is 6 but the key head size");
  // Equal sizes pass this check (and fail later, on the missing tensors).
  p = write("vlen_ok.gguf", tiny_gguf("llama", "token_embd.weight", {8, 4}, {{"attention.value_length", 4}}));
  expect_clean_error("info " + p, p, "missing tensor");
}

TEST(BadInputs, Llama2cTruncated) {
  FOCUS_NEED_FILE(stories());
  std::string all = focus::read_file(stories());
  const auto p = write("trunc_llama2c.bin", all.substr(0, all.size() - 1000));
  expect_clean_error("info " + p + " --tokenizer " + tok512(), p, "truncated");
}

TEST(BadInputs, Llama2cAbsurdHeader) {
  int32_t h[7] = {-64, 172, 5, 8, 4, 512, 512};
  const auto p = write("absurd_llama2c.bin", std::string(reinterpret_cast<const char*>(h), sizeof(h)) + "xxxx");
  expect_clean_error("info " + p, p, "not a llama2.c checkpoint");
}

TEST(BadInputs, Llama2cTokenizerTruncated) {
  FOCUS_NEED_FILE(stories());
  std::string tok = focus::read_file(tok512());
  const auto t = write("trunc_tok.bin", tok.substr(0, tok.size() / 2));
  expect_clean_error("info " + stories() + " --tokenizer " + t, t, "");
}

TEST(BadInputs, NanWeightsAreReported) {
  FOCUS_NEED_FILE(stories());
  std::string all = focus::read_file(stories());
  const float nan = std::nanf("");
  for (int i = 0; i < 64; ++i) std::memcpy(&all[28 + 4 * (512 * 64 + i)], &nan, 4);  // rms_att of layer 0
  const auto p = write("nan.bin", all);
  const auto text = focus::test::data_path("text/tinystories-sample-cs336.txt");
  expect_clean_error("eval --model " + p + " --tokenizer " + tok512() + " --text " + text + " --ctx 64", p,
                     "non-finite");
  expect_clean_error("generate --model " + p + " --tokenizer " + tok512() + " --prompt Once -n 4", p, "non-finite");
}

TEST(BadInputs, SafetensorsMissingConfig) {
  const std::string d = dir() + "/st_noconfig";
  fs::create_directories(d);
  write("st_noconfig/model.safetensors", std::string(8, '\0'));
  expect_clean_error("info " + d, d, "config.json");
}

TEST(BadInputs, SafetensorsHeaderBeyondFile) {
  const std::string d = dir() + "/st_hdr";
  fs::create_directories(d);
  write("st_hdr/config.json", R"({"model_type":"gpt2","n_embd":8,"n_layer":1,"n_head":2,"vocab_size":16})");
  uint64_t n = 1 << 20;
  write("st_hdr/model.safetensors", std::string(reinterpret_cast<const char*>(&n), 8) + "{}");
  expect_clean_error("info " + d, d, "");
}

TEST(BadInputs, SafetensorsBadJson) {
  const std::string d = dir() + "/st_json";
  fs::create_directories(d);
  write("st_json/config.json", R"({"model_type":"gpt2","n_embd":8,"n_layer":1,"n_head":2,"vocab_size":16})");
  const std::string hdr = "{\"wte.weight\": {\"dtype\": \"F32\", ";
  uint64_t n = hdr.size();
  write("st_json/model.safetensors", std::string(reinterpret_cast<const char*>(&n), 8) + hdr);
  expect_clean_error("info " + d, d, "");
}

TEST(BadInputs, SafetensorsSizeMismatch) {
  const std::string d = dir() + "/st_size";
  fs::create_directories(d);
  write("st_size/config.json", R"({"model_type":"gpt2","n_embd":8,"n_layer":1,"n_head":2,"vocab_size":16})");
  const std::string hdr = R"({"wte.weight":{"dtype":"F32","shape":[16,8],"data_offsets":[0,100]}})";
  uint64_t n = hdr.size();
  write("st_size/model.safetensors", std::string(reinterpret_cast<const char*>(&n), 8) + hdr + std::string(100, '\0'));
  expect_clean_error("info " + d, d, "");
}

TEST(BadInputs, ConfigUnknownModelType) {
  const std::string d = dir() + "/st_type";
  fs::create_directories(d);
  write("st_type/config.json", R"({"model_type":"rwkv"})");
  write("st_type/model.safetensors", std::string("\x02\0\0\0\0\0\0\0{}", 10));
  expect_clean_error("info " + d, d, "unsupported model_type 'rwkv'");
}

TEST(BadInputs, TextInvalidUtf8) {
  FOCUS_NEED_FILE(stories());
  const auto t = write("bad.txt", "Once upon a \xFF\xFE time");
  expect_clean_error("eval --model " + stories() + " --text " + t + " --ctx 64", t, "invalid UTF-8");
}

TEST(BadInputs, TextEmpty) {
  FOCUS_NEED_FILE(stories());
  const auto t = write("empty.txt", "");
  expect_clean_error("eval --model " + stories() + " --text " + t + " --ctx 64", t, "empty");
}

TEST(BadInputs, MissingModelFile) {
  const std::string p = dir() + "/no-such-model.gguf";
  expect_clean_error("info " + p, p, "no such file");
}

TEST(BadInputs, RetrofitInitFolderMissingOrMalformed) {
  FOCUS_NEED_FILE(stories());
  FOCUS_NEED_FILE(book("pg-345-dracula.txt"));
  FOCUS_NEED_FILE(book("pg-1342-pride-and-prejudice.txt"));
  const std::string args = "retrofit --model " + stories() + " --tokenizer " + tok512() + " --train " +
                           book("pg-345-dracula.txt") + " --valid " + book("pg-1342-pride-and-prejudice.txt") +
                           " --ctx 64 --steps 1 --out " + dir() + "/init_out --init ";
  const std::string none = dir() + "/no-such-routers";
  expect_clean_error(args + none, none, "not a router folder");
  const std::string d = dir() + "/bad_routers";
  fs::create_directories(d);
  write("bad_routers/focus.json", "{\"format\": \"focus-router\", \"window\": ");
  write("bad_routers/router.safetensors", "");
  expect_clean_error(args + d, d + "/focus.json", "invalid JSON");
  // A sound focus.json (stories260K: dim 64, 5 layers) beside a truncated tensor file: the
  // settings are read first, the tensors when the routers are loaded, and both name their file.
  const std::string t = dir() + "/truncated_routers";
  fs::create_directories(t);
  write("truncated_routers/focus.json",
        "{\"format\": \"focus-router\", \"window\": 32, \"sinks\": 1, \"groups\": 8, \"dg\": 16, "
        "\"model_dim\": 64, \"model_layers\": 5, \"layers\": [0, 1, 2, 3, 4]}");
  write("truncated_routers/router.safetensors", "abc");
  expect_clean_error(args + t, t + "/router.safetensors", "truncated safetensors file");
}

TEST(BadInputs, RetrofitResidualBudgetThatDoesNotFit) {
  FOCUS_NEED_FILE(stories());
  FOCUS_NEED_FILE(book("pg-345-dracula.txt"));
  FOCUS_NEED_FILE(book("pg-1342-pride-and-prejudice.txt"));
  const std::string args = "retrofit --model " + stories() + " --tokenizer " + tok512() + " --train " +
                           book("pg-345-dracula.txt") + " --valid " + book("pg-1342-pride-and-prejudice.txt") +
                           " --ctx 64 --steps 1 --objective distill --window 16 --sinks 1 --out " + dir() +
                           "/residual_out --residual-budget ";
  auto budget = [](const std::string& name, int window, int layers, int heads) {
    std::string k = "[";
    for (int l = 0; l < layers; ++l) {
      k += l ? ", [" : "[";
      for (int h = 0; h < heads; ++h) k += (h ? ", " : "") + std::to_string(2);
      k += "]";
    }
    return write(name, "{\"format\": \"focus-block-budget\", \"version\": 1, \"block\": 4, \"window\": " +
                           std::to_string(window) + ", \"sinks\": 1, \"ctx\": 64, \"k\": " + k + "]}");
  };
  const std::string w = budget("residual_window.json", 32, 5, 8);
  expect_clean_error(args + w, w, "measured with window 32");
  const std::string l = budget("residual_layers.json", 16, 3, 8);
  expect_clean_error(args + l, l, "budgets for 3 layers");
  const std::string h = budget("residual_heads.json", 16, 5, 2);
  expect_clean_error(args + h, h, "2 head budgets");
  expect_clean_error("retrofit --model " + stories() + " --tokenizer " + tok512() + " --train " +
                         book("pg-345-dracula.txt") + " --valid " + book("pg-1342-pride-and-prejudice.txt") +
                         " --ctx 64 --steps 1 --window 16 --out " + dir() + "/residual_out --residual-budget " + h,
                     "--residual-budget", "needs --objective distill");
}

// Block budgets for the hybrid are calibrated on what the routers' groups leave unread. Routers with
// group weights run on the soft kernel, which has no blocks: refused, naming the folder, and no
// budget file is written. Far-pair terms weight the pairs read without changing which they are, so
// such routers are calibrated like any others.
TEST(BadInputs, BudgetRefusesRoutersWithGroupWeights) {
  FOCUS_NEED_FILE(stories());
  FOCUS_NEED_FILE(book("pg-345-dracula.txt"));
  FOCUS_NEED_FILE(book("pg-1342-pride-and-prejudice.txt"));
  if (!fs::exists(focus_bin())) GTEST_SKIP() << "focus binary not built: " << focus_bin();
  for (const std::string flag : {"--group-bias", "--far-bias"}) {
    SCOPED_TRACE(flag);
    const std::string routers = dir() + "/weighted_routers" + flag, out = dir() + "/weighted_budget" + flag + ".json";
    const focus::test::BinRun made = run("retrofit --model " + stories() + " --tokenizer " + tok512() + " --train " +
                                         book("pg-345-dracula.txt") + " --valid " + book("pg-1342-pride-and-prejudice.txt") +
                                         " --ctx 64 --steps 1 --valid-windows 2 --objective sparse --window 16 " + flag +
                                         " --out " + routers);
    ASSERT_EQ(made.code, 0) << made.err;
    const std::string budget = "budget --model " + stories() + " --tokenizer " + tok512() + " --text " +
                               book("pg-345-dracula.txt") + " --focus " + routers +
                               " --max-tokens 630 --mean-k 2 --block-size 4 --window 16 --ctx 64 --out " + out;
    if (flag == "--group-bias") {
      expect_clean_error(budget, routers, "group weights");
      EXPECT_FALSE(fs::exists(out));
    } else {
      const focus::test::BinRun r = run(budget);
      EXPECT_EQ(r.code, 0) << r.err;
      EXPECT_TRUE(fs::exists(out));
    }
  }
}

// Memory limits are checked before anything large is allocated: FOCUS_MEMORY_LIMIT stands in for a
// small machine, and each job is refused with its estimate and the part that does not fit.
namespace {
struct MemoryLimit {
  explicit MemoryLimit(const char* v) { setenv("FOCUS_MEMORY_LIMIT", v, 1); }
  ~MemoryLimit() { unsetenv("FOCUS_MEMORY_LIMIT"); }
};
}  // namespace

TEST(BadInputs, ContextBeyondMemoryIsRefusedWithTheEstimate) {
  FOCUS_NEED_FILE(stories());
  FOCUS_NEED_FILE(book("pg-345-dracula.txt"));
  FOCUS_NEED_FILE(book("pg-1342-pride-and-prejudice.txt"));
  const std::string model = "--model " + stories() + " --tokenizer " + tok512();
  {
    MemoryLimit lim("1M");
    expect_clean_error("eval " + model + " --text " + book("pg-345-dracula.txt") + " --ctx 256 --kv-type f32",
                       "eval at ctx 256", "needs about");
    // A window scored in one forward keeps no KV rows: the estimate is the activations'.
    const focus::test::BinRun r = run("eval " + model + " --text " + book("pg-345-dracula.txt") + " --ctx 256 --kv-type f32");
    EXPECT_NE(r.err.find("activations"), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find("KV cache"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("only 1.00 MiB is free"), std::string::npos) << r.err;
    expect_clean_error("retrofit " + model + " --train " + book("pg-345-dracula.txt") + " --valid " +
                           book("pg-1342-pride-and-prejudice.txt") + " --ctx 256 --steps 1 --out " + dir() + "/mem_out",
                       "retrofit at ctx 256", "layer inputs");
  }
  {
    MemoryLimit lim("128K");  // scoring through the decoding path keeps 256 rows: 320 KiB in float32
    const std::string args = "eval " + model + " --text " + book("pg-345-dracula.txt") + " --ctx 256 --decode --kv-type f32";
    expect_clean_error(args, "eval at ctx 256", "KV cache 320 KiB");
    EXPECT_NE(run(args).err.find("--kv-type f16"), std::string::npos);
  }
  {
    MemoryLimit lim("64K");  // stories260K's f16 cache: 640 bytes a position
    expect_clean_error("generate " + model + " -p 'Once upon' -n 400", "generate (3 prompt tokens + 400 new)",
                       "generate fewer tokens");
  }
  {
    // The same jobs fit a limit that holds them.
    MemoryLimit lim("64M");
    const focus::test::BinRun r = run("eval " + model + " --text " + book("pg-345-dracula.txt") + " --ctx 256 --max-tokens 300");
    EXPECT_EQ(r.code, 0) << r.err;
  }
  {
    MemoryLimit lim("12x");
    expect_clean_error("eval " + model + " --text " + book("pg-345-dracula.txt"), "FOCUS_MEMORY_LIMIT='12x'",
                       "unknown unit");
  }
}

TEST(BadInputs, WeightsBeyondMemoryAreRefusedBeforeConversion) {
  FOCUS_NEED_FILE(stories());
  MemoryLimit lim("100K");  // stories260K in bf16 holds about 0.5 MB of matrices
  expect_clean_error("info " + stories() + " --tokenizer " + tok512() + " --weights bf16", stories(),
                     "weights held as bf16");
  const focus::test::BinRun r = run("info " + stories() + " --tokenizer " + tok512());  // float32 file, viewed in place
  EXPECT_EQ(r.code, 0) << r.err;
  // A quantized GGUF: its blocks are read in place natively; --weights f32 would copy 513 MiB.
  const std::string gguf = focus::test::smollm2_path();
  FOCUS_NEED_FILE(gguf);
  MemoryLimit lim2("100M");
  expect_clean_error("info " + gguf + " --weights f32", gguf, "weights held as float32");
  EXPECT_EQ(run("info " + gguf).code, 0);
  expect_clean_error("bench model --model " + gguf + " --prefill 8192 --reps 1", "bench model", "KV cache");
}

TEST(BadInputs, BinaryTextIsRefusedAndA100MBLineIsRead) {
  FOCUS_NEED_FILE(stories());
  std::string bin(4096, '\0');
  for (size_t i = 0; i < bin.size(); ++i) bin[i] = (char)((i * 2654435761u) >> 13);
  const auto b = write("binary.bin", bin);
  expect_clean_error("eval --model " + stories() + " --tokenizer " + tok512() + " --text " + b + " --ctx 64", b,
                     "invalid UTF-8");
  // One line of 100 MB (words, no line break) is read, tokenized and scored.
  const std::string words = "the cat sat on a mat and looked at the small red bird ";
  std::string line;
  line.reserve(100u << 20);
  while (line.size() + words.size() < (100u << 20)) line += words;
  const auto t = write("line100m.txt", line);
  line.clear();
  line.shrink_to_fit();
  const focus::test::BinRun r = run("eval --model " + stories() + " --tokenizer " + tok512() + " --text " + t +
                    " --ctx 64 --max-tokens 128");
  fs::remove(t);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("tokens scored 128"), std::string::npos) << r.out;
}
