#include "core/progress.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>

namespace focus {

std::string format_rate(double per_s, const std::string& unit) {
  char b[64];
  if (per_s >= 1 || per_s <= 0)
    std::snprintf(b, sizeof(b), "%.1f %s/s", per_s, unit.c_str());
  else
    std::snprintf(b, sizeof(b), "%.1f s/%s", 1 / per_s, unit.c_str());
  return b;
}

std::string format_duration(double seconds) {
  const long long s = seconds > 0 ? (long long)(seconds + 0.5) : 0;
  char b[32];
  if (s < 60)
    std::snprintf(b, sizeof(b), "%llds", s);
  else if (s < 3600)
    std::snprintf(b, sizeof(b), "%lldm%02llds", s / 60, s % 60);
  else
    std::snprintf(b, sizeof(b), "%lldh%02lldm", s / 3600, s % 3600 / 60);
  return b;
}

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
  std::fprintf(stderr, "%s%s [%s] %3.0f%% %lld/%lld %s ETA %s %s%s", tty_ ? "\r" : "", label_.c_str(), bar.c_str(),
               frac * 100, (long long)done, (long long)total_, format_rate(rate, unit_).c_str(),
               format_duration(eta).c_str(), extra.c_str(), tty_ ? "\x1b[K" : "\n");
  std::fflush(stderr);
}

void Progress::finish(const std::string& extra) {
  const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  if (tty_ && drawn_) std::fprintf(stderr, "\r\x1b[K");
  char took[32];
  if (el < 60) std::snprintf(took, sizeof(took), "%.1fs", el);
  std::fprintf(stderr, "%s done in %s %s\n", label_.c_str(), el < 60 ? took : format_duration(el).c_str(),
               extra.c_str());
}

namespace {
std::atomic<bool> g_interrupt{false};
static_assert(std::atomic<bool>::is_always_lock_free);
}  // namespace

void request_interrupt() { g_interrupt.store(true); }
void clear_interrupt() { g_interrupt.store(false); }
bool interrupted() { return g_interrupt.load(); }

}  // namespace focus
