// The coordinator's sink (app/coordinator_sink): what its events become.
#include "app/coordinator_sink.hpp"

#include <gtest/gtest.h>

#include <sstream>
#include <string>

namespace dtactor {
namespace {

// The value of the series whose line starts with `series` in a scrape, or -1.
double series_value(const std::string& scrape, const std::string& series) {
  std::istringstream in(scrape);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  return -1;
}

// Goodput's gauges are set as of each scrape, not only when an event moves
// a bucket: while no step completes (an outage, a wait for nodes), the wall
// time and what it went to grow on /metrics live.
TEST(CoordinatorSink, EveryScrapeSetsGoodputAsOfTheScrape) {
  journal jn;
  metrics m("j");
  run_observer obs(run_observer::options{});
  sd_targets sd("j");
  coordinator_sink sink(jn, m, obs, sd);
  const std::string other = "dtactor_goodput_seconds{job=\"j\",bucket=\"other\"}";
  const double first = series_value(m.render(), other);
  const double second = series_value(m.render(), other);
  EXPECT_GT(first, 0);
  EXPECT_GT(second, first);
  EXPECT_EQ(series_value(m.render(), "dtactor_goodput_ratio{job=\"j\"}"), 0);
}

}  // namespace
}  // namespace dtactor
