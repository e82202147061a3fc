#include "monitoring/metrics.hpp"

#include <gtest/gtest.h>

#include "http_get.hpp"
#include "runtime/zmq_bridge.hpp"  // pick_free_tcp_port

namespace dtactor {
namespace {

using test_support::http_get;

bool has_line(const std::string& text, const std::string& line) {
  return text.find("\n" + line + "\n") != std::string::npos || text.rfind(line + "\n", 0) == 0;
}

TEST(metrics, served_over_http_with_prometheus_names) {
  metrics m("test-job");
  auto port = pick_free_tcp_port();
  ASSERT_TRUE(port) << port.message();
  auto served = m.serve(port.value(), "127.0.0.1");
  ASSERT_TRUE(served) << served.message();
  EXPECT_EQ(m.port(), port.value());

  m.world_size().Set(4);
  m.generation().Set(3);
  m.step().Set(1200);
  m.nodes_alive().Set(2);
  m.loss().Set(0.5);
  m.learning_rate().Set(0.25);
  m.samples_per_second().Set(1500);
  m.samples().Increment(64);
  m.samples().Increment(64);
  m.recoveries("node_lost").Increment();
  m.recoveries("node_lost").Increment();
  m.recoveries("node_joined").Increment();
  m.lost_steps().Increment(3);
  m.wire_dropped_frames("garbage").Increment();
  m.step_duration().Observe(0.2);
  m.allreduce_duration().Observe(0.003);
  m.failure_detection().Observe(1.5);
  m.recovery().Observe(4);
  m.heartbeat_rtt().Observe(0.0004);
  m.checkpoint_save().Observe(0.7);

  const std::string r = http_get(m.port(), "/metrics");
  ASSERT_NE(r.find("200 OK"), std::string::npos) << r.substr(0, 200);
  const std::string j = "job=\"test-job\"";
  EXPECT_TRUE(has_line(r, "dtactor_world_size{" + j + "} 4")) << r;
  EXPECT_TRUE(has_line(r, "dtactor_generation{" + j + "} 3"));
  EXPECT_TRUE(has_line(r, "dtactor_step{" + j + "} 1200"));
  EXPECT_TRUE(has_line(r, "dtactor_nodes_alive{" + j + "} 2"));
  EXPECT_TRUE(has_line(r, "dtactor_loss{" + j + "} 0.5"));
  EXPECT_TRUE(has_line(r, "dtactor_learning_rate{" + j + "} 0.25"));
  EXPECT_TRUE(has_line(r, "dtactor_samples_per_second{" + j + "} 1500"));
  EXPECT_TRUE(has_line(r, "dtactor_samples_total{" + j + "} 128"));
  EXPECT_TRUE(has_line(r, "dtactor_recoveries_total{cause=\"node_lost\"," + j + "} 2") ||
              has_line(r, "dtactor_recoveries_total{" + j + ",cause=\"node_lost\"} 2"));
  EXPECT_TRUE(has_line(r, "dtactor_recoveries_total{cause=\"node_joined\"," + j + "} 1") ||
              has_line(r, "dtactor_recoveries_total{" + j + ",cause=\"node_joined\"} 1"));
  EXPECT_TRUE(has_line(r, "dtactor_lost_steps_total{" + j + "} 3"));
  EXPECT_TRUE(has_line(r, "dtactor_wire_dropped_frames_total{" + j + ",kind=\"garbage\"} 1") ||
              has_line(r, "dtactor_wire_dropped_frames_total{kind=\"garbage\"," + j + "} 1"));
  EXPECT_TRUE(has_line(r, "# TYPE dtactor_samples_total counter"));
  EXPECT_TRUE(has_line(r, "# TYPE dtactor_loss gauge"));
  for (const char* h : {"dtactor_step_duration_seconds", "dtactor_allreduce_duration_seconds",
                        "dtactor_failure_detection_seconds", "dtactor_recovery_seconds",
                        "dtactor_heartbeat_rtt_seconds", "dtactor_checkpoint_save_seconds"}) {
    EXPECT_TRUE(has_line(r, std::string("# TYPE ") + h + " histogram")) << h;
    EXPECT_TRUE(has_line(r, std::string(h) + "_count{" + j + "} 1")) << h;
  }
  EXPECT_TRUE(has_line(r, "dtactor_step_duration_seconds_sum{" + j + "} 0.2"));
  EXPECT_TRUE(has_line(r, "dtactor_step_duration_seconds_bucket{" + j + ",le=\"0.25\"} 1"));
  EXPECT_TRUE(has_line(r, "dtactor_step_duration_seconds_bucket{" + j + ",le=\"0.1\"} 0"));
  EXPECT_TRUE(has_line(r, "dtactor_step_duration_seconds_bucket{" + j + ",le=\"+Inf\"} 1"));

  EXPECT_NE(http_get(m.port(), "/").find("404 Not Found"), std::string::npos);

  // The same text is available without HTTP.
  EXPECT_TRUE(has_line(m.render(), "dtactor_world_size{" + j + "} 4"));
  // Values move between scrapes.
  m.world_size().Set(3);
  EXPECT_TRUE(has_line(http_get(m.port(), "/metrics"), "dtactor_world_size{" + j + "} 3"));
}

TEST(metrics, port_zero_is_off_and_no_job_label_when_none_given) {
  metrics m;
  ASSERT_TRUE(m.serve(0));
  EXPECT_EQ(m.port(), 0);
  m.world_size().Set(2);
  EXPECT_TRUE(has_line(m.render(), "dtactor_world_size 2")) << m.render();
}

TEST(metrics, port_in_use_is_a_clear_error) {
  metrics first("a"), second("b");
  auto port = pick_free_tcp_port();
  ASSERT_TRUE(port);
  ASSERT_TRUE(first.serve(port.value(), "127.0.0.1"));
  auto taken = second.serve(port.value(), "127.0.0.1");
  ASSERT_FALSE(taken);
  EXPECT_NE(taken.message().find("cannot serve /metrics on 127.0.0.1:" + std::to_string(port.value())),
            std::string::npos)
      << taken.message();
  std::fprintf(stderr, "[message] %s\n", taken.message().c_str());
  EXPECT_FALSE(second.serve(-1));
}

}  // namespace
}  // namespace dtactor
