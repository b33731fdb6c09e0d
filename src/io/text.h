// Text preparation: UTF-8 BOM, CRLF and Project Gutenberg boilerplate.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace focus::io {

struct PrepareStats {
  bool had_bom = false, had_crlf = false, gutenberg = false;
  size_t bytes_in = 0, bytes_out = 0;
};

// Drops a UTF-8 BOM, turns CRLF/CR into LF, and, when the text has Project Gutenberg
// "*** START OF ..." / "*** END OF ..." markers, keeps only the body between them.
std::string prepare_text(std::string_view raw, PrepareStats* stats = nullptr);

// Reads FILE and prepares it; throws Error naming the file if it is missing, empty after
// preparation, or not valid UTF-8 (the message gives the byte offset).
std::string load_text(const std::string& path, PrepareStats* stats = nullptr);

class Tokenizer;

// Each file loaded with load_text and encoded without BOS, concatenated; the first max_tokens
// tokens when max_tokens > 0. Throws Error naming a file that encodes to no tokens.
std::vector<int32_t> load_text_tokens(const Tokenizer& tok, const std::vector<std::string>& paths,
                                      int64_t max_tokens = 0);

// Offset of the first invalid UTF-8 byte, or npos.
size_t find_invalid_utf8(std::string_view s);

}  // namespace focus::io
