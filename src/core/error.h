// Error type and checks. Every failure a user can cause (bad file, bad flag, bad shape)
// is reported as focus::Error with a message that names the file and the problem.
#pragma once
#include <stdexcept>
#include <string>
#include <sstream>

namespace focus {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

namespace detail {
template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

template <typename... Args>
[[noreturn]] void fail(Args&&... args) {
  throw Error(detail::concat(std::forward<Args>(args)...));
}

}  // namespace focus

// FOCUS_CHECK(cond, parts...) throws focus::Error(parts...) when cond is false.
#define FOCUS_CHECK(cond, ...)                       \
  do {                                               \
    if (!(cond)) ::focus::fail(__VA_ARGS__);         \
  } while (0)
