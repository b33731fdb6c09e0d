// Test entry point. CTest runs every test in its own process, many at once; each process gets a
// temporary directory of its own (TEST_TMPDIR for ::testing::TempDir(), TMPDIR for
// std::filesystem::temp_directory_path()), so tests that reuse a file name never race. The shared
// base stays reachable as FOCUS_SHARED_TMPDIR for caches meant to outlive one process. The
// directory is removed when every test passed and kept (its path printed) otherwise.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>
#include <system_error>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const char* base_env = std::getenv("TMPDIR");
  std::string base = base_env && *base_env ? base_env : "/tmp";
  while (base.size() > 1 && base.back() == '/') base.pop_back();
  std::string templ = base + "/focus_tests.XXXXXX";
  std::string dir;
  if (mkdtemp(templ.data())) {
    dir = templ;
    setenv("FOCUS_SHARED_TMPDIR", base.c_str(), 0);
    setenv("TEST_TMPDIR", dir.c_str(), 1);
    setenv("TMPDIR", dir.c_str(), 1);
  } else {
    std::cerr << "warning: could not create a private temporary directory under " << base
              << "; tests share " << base << "\n";
  }
  const int rc = RUN_ALL_TESTS();
  if (!dir.empty()) {
    if (rc == 0 && !std::getenv("FOCUS_KEEP_TEST_TMP")) {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    } else {
      std::cerr << "test files kept in " << dir << "\n";
    }
  }
  return rc;
}
