#include "core/progress.h"

#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>

namespace focus {

Progress::Progress(std::string label, int64_t total, std::string unit)
    : label_(std::move(label)), unit_(std::move(unit)), total_(total), tty_(isatty(2)) {
  start_ = last_ = std::chrono::steady_clock::now();
}

void Progress::update(int64_t done, const std::string& extra) {
  const auto now = std::chrono::steady_clock::now();
  const double since = std::chrono::duration<double>(now - last_).count();
  if (drawn_ && since < (tty_ ? 0.2 : 10.0) && done < total_) return;
  last_ = now;
  drawn_ = true;
  const double el = std::chrono::duration<double>(now - start_).count();
  const double rate = el > 0 ? done / el : 0;
  const double eta = rate > 0 ? (total_ - done) / rate : 0;
  const int width = 30;
  const double frac = total_ > 0 ? (double)done / total_ : 0;
  std::string bar(width, ' ');
  for (int i = 0; i < (int)(frac * width); ++i) bar[i] = '=';
  std::fprintf(stderr, "%s%s [%s] %3.0f%% %lld/%lld %s %.1f %s/s ETA %.0fs %s%s", tty_ ? "\r" : "", label_.c_str(),
               bar.c_str(), frac * 100, (long long)done, (long long)total_, unit_.c_str(), rate, unit_.c_str(), eta,
               extra.c_str(), tty_ ? "\x1b[K" : "\n");
  std::fflush(stderr);
}

void Progress::finish(const std::string& extra) {
  const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  if (tty_ && drawn_) std::fprintf(stderr, "\r\x1b[K");
  std::fprintf(stderr, "%s done in %.1fs %s\n", label_.c_str(), el, extra.c_str());
}

namespace {
std::atomic<int> g_interrupts{0};
void on_sigint(int) {
  if (g_interrupts.fetch_add(1) >= 1) _exit(130);
}
}  // namespace

void install_interrupt_handler() {
  struct sigaction sa {};
  sa.sa_handler = on_sigint;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
}
bool interrupted() { return g_interrupts.load() > 0; }

}  // namespace focus
