#include <gtest/gtest.h>

#include <fstream>

#include "core/error.h"
#include "io/text.h"
#include "test_util.h"

using focus::io::prepare_text;

TEST(PrepareText, StripsBomCrlfAndGutenbergBoilerplate) {
  const std::string raw =
      "\xEF\xBB\xBFThe Project Gutenberg eBook of X\r\n\r\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\r\n\r\n"
      "Chapter 1\r\nIt was.\r\n\r\n*** END OF THE PROJECT GUTENBERG EBOOK X ***\r\nLicense text\r\n";
  focus::io::PrepareStats st;
  EXPECT_EQ(prepare_text(raw, &st), "Chapter 1\nIt was.\n");
  EXPECT_TRUE(st.had_bom);
  EXPECT_TRUE(st.had_crlf);
  EXPECT_TRUE(st.gutenberg);
}

TEST(PrepareText, PlainTextKeepsContent) {
  EXPECT_EQ(prepare_text("a\r\nb\rc\n"), "a\nb\nc\n");
  EXPECT_EQ(prepare_text("no markers here"), "no markers here");
}

TEST(PrepareText, EveryGutenbergBookLosesItsLicense) {
  for (const char* name : {"pg-1661-the-adventures-of-sherlock-holmes.txt", "pg-345-dracula.txt",
                           "pg-2600-war-and-peace.txt", "pg-996-don-quixote.txt"}) {
    const std::string p = focus::test::data_path(std::string("text/") + name);
    FOCUS_NEED_FILE(p);
    focus::io::PrepareStats st;
    const std::string s = focus::io::load_text(p, &st);
    EXPECT_TRUE(st.gutenberg) << name;
    EXPECT_EQ(s.find("Project Gutenberg License"), std::string::npos) << name;
    EXPECT_EQ(s.find("*** START OF"), std::string::npos) << name;
    EXPECT_EQ(s.find('\r'), std::string::npos) << name;
    EXPECT_GT(s.size(), st.bytes_in * 8 / 10) << name;
  }
}

TEST(PrepareText, BadInputsGiveClearErrors) {
  const std::string dir = ::testing::TempDir();
  const std::string empty = dir + "/empty.txt", bad = dir + "/bad_utf8.txt";
  { std::ofstream f(empty); }
  { std::ofstream f(bad, std::ios::binary); f << "ok \xC3\x28 broken"; }
  try {
    focus::io::load_text(empty);
    FAIL();
  } catch (const focus::Error& e) {
    EXPECT_NE(std::string(e.what()).find("empty"), std::string::npos);
  }
  try {
    focus::io::load_text(bad);
    FAIL();
  } catch (const focus::Error& e) {
    EXPECT_NE(std::string(e.what()).find("invalid UTF-8 at byte offset 3"), std::string::npos) << e.what();
  }
  EXPECT_THROW(focus::io::load_text(dir + "/does-not-exist.txt"), focus::Error);
}
