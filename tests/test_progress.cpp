// The progress bar's rate and time formats.
#include <gtest/gtest.h>

#include "core/progress.h"

using focus::format_duration;
using focus::format_rate;

TEST(Progress, RateTurnsIntoSecondsPerUnitBelowOnePerSecond) {
  EXPECT_EQ(format_rate(104.6, "tok"), "104.6 tok/s");
  EXPECT_EQ(format_rate(1.0, "step"), "1.0 step/s");
  EXPECT_EQ(format_rate(0.02, "step"), "50.0 s/step");
  EXPECT_EQ(format_rate(0, "step"), "0.0 step/s");  // nothing done yet
}

TEST(Progress, DurationsReadAsSecondsMinutesHours) {
  EXPECT_EQ(format_duration(0), "0s");
  EXPECT_EQ(format_duration(-3), "0s");
  EXPECT_EQ(format_duration(59.4), "59s");
  EXPECT_EQ(format_duration(59.6), "1m00s");
  EXPECT_EQ(format_duration(187), "3m07s");
  EXPECT_EQ(format_duration(3600), "1h00m");
  EXPECT_EQ(format_duration(3900), "1h05m");
}
