// NVML is loaded at run time; on a machine without the NVIDIA driver (like
// CI) the node must go on without GPU series and say why. The GPU path itself
// needs a GPU and is not exercised here.
#include <gtest/gtest.h>

#include "monitoring/gpu_metrics.hpp"
#include "monitoring/metrics.hpp"

namespace dtactor {
namespace {

TEST(GpuMetrics, MissingNvmlMeansNoSeriesAndAReason) {
  metrics m;
  gpu_metrics g(m.registry(), "/nonexistent/libnvidia-ml.so.1");
  EXPECT_FALSE(g.available());
  EXPECT_NE(g.why_not().find("not found"), std::string::npos) << g.why_not();
  g.sample();  // harmless
  EXPECT_EQ(m.render().find("dtactor_gpu_"), std::string::npos);
}

TEST(GpuMetrics, ALibraryWithoutNvmlIsRefused) {
  metrics m;
  gpu_metrics g(m.registry(), "libc.so.6");
  EXPECT_FALSE(g.available());
  EXPECT_NE(g.why_not().find("lacks the NVML functions"), std::string::npos) << g.why_not();
  EXPECT_EQ(m.render().find("dtactor_gpu_"), std::string::npos);
}

}  // namespace
}  // namespace dtactor
