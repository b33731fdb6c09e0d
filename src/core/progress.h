// Progress bar on stderr (rate and ETA), and the stop request that long loops check.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>

namespace focus {

// "12.3 tok/s", or "4.2 s/step" below one unit per second.
std::string format_rate(double per_s, const std::string& unit);
// "42s", "3m07s", "1h05m".
std::string format_duration(double seconds);

class Progress {
 public:
  Progress(std::string label, int64_t total, std::string unit);
  void update(int64_t done, const std::string& extra = "");
  void finish(const std::string& extra = "");

 private:
  std::string label_, unit_;
  int64_t total_;
  std::chrono::steady_clock::time_point start_, last_;
  bool tty_;
  bool drawn_ = false;
};

// A process-wide stop request. Evaluation, training and generation loops check interrupted()
// and end cleanly (a training run writes its checkpoint). The library never sets it on its own:
// the program does (the focus command from its SIGINT handler). These calls are lock-free and
// safe in a signal handler.
void request_interrupt();
void clear_interrupt();
bool interrupted();

}  // namespace focus
