// focus prepare INPUT OUTPUT: a text file without Gutenberg boilerplate, BOM and CRLF.
#include <cstdio>
#include <fstream>

#include "cli/setup.h"
#include "core/error.h"
#include "io/text.h"

namespace focus::cli {
namespace {

struct PrepareFlags {
  std::string in, out;
};

int run_prepare(const PrepareFlags& f) {
  io::PrepareStats st;
  const std::string s = io::load_text(f.in, &st);
  std::ofstream out(f.out, std::ios::binary);
  FOCUS_CHECK(out, f.out, ": cannot open for writing");
  out << s;
  FOCUS_CHECK(out.good(), f.out, ": write failed");
  std::fprintf(stderr, "%s -> %s: %zu -> %zu bytes%s%s%s\n", f.in.c_str(), f.out.c_str(), st.bytes_in, st.bytes_out,
               st.had_bom ? ", BOM dropped" : "", st.had_crlf ? ", CRLF -> LF" : "",
               st.gutenberg ? ", Gutenberg boilerplate stripped" : "");
  return 0;
}

}  // namespace

Command add_prepare(CLI::App& app) {
  auto f = std::make_shared<PrepareFlags>();
  auto* sub = app.add_subcommand("prepare", "strip Gutenberg boilerplate, BOM and CRLF");
  sub->add_option("input", f->in, "input text file")->required();
  sub->add_option("output", f->out, "output file")->required();
  return {sub, [f] { return run_prepare(*f); }};
}

}  // namespace focus::cli
