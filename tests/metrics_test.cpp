#include "monitoring/metrics.hpp"

#include <gtest/gtest.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <set>
#include <nlohmann/json.hpp>
#include <vector>

#include "http_get.hpp"
#include "monitoring/journal.hpp"
#include "monitoring/resources.hpp"
#include "monitoring/service_discovery.hpp"
#include "net/zmq_bridge.hpp"  // pick_free_tcp_port

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
  m.recoveries(ev::plan_cause::node_lost).Increment();
  m.recoveries(ev::plan_cause::node_lost).Increment();
  m.recoveries(ev::plan_cause::node_joined).Increment();
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

// Two servers on ports the system picks: each says its own, and answers there.
TEST(metrics, a_free_port_is_bound_and_reported) {
  metrics first("a"), second("b");
  ASSERT_TRUE(first.serve_on_free_port("127.0.0.1"));
  ASSERT_TRUE(second.serve_on_free_port("127.0.0.1"));
  EXPECT_GT(first.port(), 0);
  EXPECT_GT(second.port(), 0);
  EXPECT_NE(first.port(), second.port());
  first.world_size().Set(3);
  second.world_size().Set(5);
  EXPECT_TRUE(has_line(http_get(first.port(), "/metrics"), "dtactor_world_size{job=\"a\"} 3"));
  EXPECT_TRUE(has_line(http_get(second.port(), "/metrics"), "dtactor_world_size{job=\"b\"} 5"));
  EXPECT_FALSE(first.serve_on_free_port("127.0.0.1"));  // at most once
}

// Ports handed out for tests lie below the kernel's ephemeral range (where
// no connection is given them meanwhile), are free, and do not repeat.
TEST(metrics, picked_ports_are_free_distinct_and_below_the_ephemeral_range) {
  int floor = 32768, last = 60999;
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    ASSERT_EQ(std::fscanf(f, "%d %d", &floor, &last), 2);
    std::fclose(f);
  }
  std::set<int> seen;
  for (int i = 0; i < 100; ++i) {
    auto port = pick_free_tcp_port();
    ASSERT_TRUE(port) << port.message();
    if (floor > 11000) {
      EXPECT_LT(port.value(), floor);
    }
    EXPECT_TRUE(seen.insert(port.value()).second) << port.value() << " handed out twice";
  }
  metrics m("c");
  const int port = *seen.begin();
  EXPECT_TRUE(m.serve(port, "127.0.0.1")) << port;
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

TEST(metrics, observability_series_have_prometheus_names) {
  metrics m("j");
  m.checkpoint_saved(500, 2.5e6, 0.3);
  m.eval_metric("accuracy").Set(0.875);
  m.eval_metric("val_loss").Set(0.4);
  m.eval_metric("Exact-Match").Set(0.05);
  m.eval_step().Set(500);
  m.data_wait().Observe(0.002);
  m.rank_cpu_seconds("0").Increment(12.5);
  m.rank_resident_memory("1").Set(3e8);
  m.rank_peak_resident_memory("1").Set(3.5e8);
  const std::string r = m.render();
  const std::string j = "job=\"j\"";
  EXPECT_TRUE(has_line(r, "dtactor_checkpoint_size_bytes{" + j + "} 2500000")) << r;
  EXPECT_TRUE(has_line(r, "dtactor_checkpoint_last_step{" + j + "} 500"));
  EXPECT_TRUE(has_line(r, "dtactor_checkpoint_save_seconds_count{" + j + "} 1"));
  EXPECT_TRUE(has_line(r, "dtactor_eval_accuracy{" + j + "} 0.875"));
  EXPECT_TRUE(has_line(r, "dtactor_eval_loss{" + j + "} 0.4"));
  EXPECT_TRUE(has_line(r, "dtactor_eval_exact_match{" + j + "} 0.05"));
  EXPECT_TRUE(has_line(r, "dtactor_eval_step{" + j + "} 500"));
  EXPECT_TRUE(has_line(r, "dtactor_data_wait_seconds_count{" + j + "} 1"));
  EXPECT_TRUE(has_line(r, "# TYPE dtactor_rank_cpu_seconds_total counter"));
  EXPECT_TRUE(r.find("dtactor_rank_cpu_seconds_total{") != std::string::npos && r.find("rank=\"0\"") != std::string::npos);
  EXPECT_NE(r.find("dtactor_rank_peak_resident_memory_bytes{"), std::string::npos);
  // The checkpoint timestamp is now.
  const auto ts = r.find("\ndtactor_checkpoint_last_timestamp_seconds{" + j + "} ");
  ASSERT_NE(ts, std::string::npos);
  const double t = std::atof(r.c_str() + r.find("} ", ts) + 2);
  EXPECT_NEAR(t, unix_time_now(), 60);
  // This process's own usage, read at scrape time.
  EXPECT_NE(r.find("\nprocess_cpu_seconds_total{" + j + "} "), std::string::npos);
  const auto rss = r.find("\nprocess_resident_memory_bytes{" + j + "} ");
  ASSERT_NE(rss, std::string::npos);
  EXPECT_GT(std::atof(r.c_str() + r.find("} ", rss) + 2), 1e6);
}

// Goodput's gauges: the ratio and one series per bucket (monitoring/goodput.hpp).
TEST(metrics, goodput_is_a_ratio_and_seconds_by_bucket) {
  metrics m("j");
  ev::goodput g;
  g.ratio = 0.75;
  g.wall_s = 100;
  g.productive_s = 75;
  g.recovery_s = 20;
  g.other_s = 5;
  m.goodput(g);
  const std::string r = m.render();
  EXPECT_TRUE(has_line(r, "# TYPE dtactor_goodput_ratio gauge")) << r;
  EXPECT_TRUE(has_line(r, "dtactor_goodput_ratio{job=\"j\"} 0.75")) << r;
  EXPECT_TRUE(has_line(r, "dtactor_goodput_seconds{job=\"j\",bucket=\"productive\"} 75")) << r;
  EXPECT_TRUE(has_line(r, "dtactor_goodput_seconds{job=\"j\",bucket=\"recovery\"} 20")) << r;
  EXPECT_TRUE(has_line(r, "dtactor_goodput_seconds{job=\"j\",bucket=\"waiting\"} 0")) << r;
  EXPECT_EQ(r.find("bucket=\"wall\""), std::string::npos);  // wall is not a bucket: the buckets add up to it
}

TEST(metrics, proc_usage_of_this_process_and_a_gone_one) {
  auto u = read_proc_usage();
  ASSERT_TRUE(u);
  EXPECT_GT(u->rss_bytes, 1e6);
  EXPECT_GE(u->peak_rss_bytes, u->rss_bytes);
  // CPU time counts (in clock ticks): spin for 50 ms of it.
  const auto t0 = std::chrono::steady_clock::now();
  volatile uint64_t spin = 0;
  while (std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(50)) spin = spin + 1;
  auto later = read_proc_usage();
  ASSERT_TRUE(later);
  EXPECT_GE(later->cpu_s - u->cpu_s, 0.02);
  EXPECT_NEAR(u->start_unix + u->age_s, unix_time_now(), 5);
  auto self = read_proc_usage(::getpid());
  ASSERT_TRUE(self);
  EXPECT_FALSE(read_proc_usage(0x3fffffff));  // no such process
}

TEST(metrics, rank_usage_tracker_fills_rank_series) {
  metrics m;
  rank_usage_tracker t(m);
  EXPECT_FALSE(t.sample("nobody"));
  t.track("peer-a", 3, ::getpid());
  auto u = t.sample("peer-a");
  ASSERT_TRUE(u);
  const std::string r = m.render();
  EXPECT_NE(r.find("dtactor_rank_resident_memory_bytes{rank=\"3\"} "), std::string::npos) << r;
  EXPECT_NE(r.find("dtactor_rank_cpu_seconds_total{rank=\"3\"} "), std::string::npos) << r;
}

// The value of an unlabelled series in `text`, -1 when absent.
double series_value(const std::string& text, const std::string& name) {
  const auto at = text.find("\n" + name + " ");
  return at == std::string::npos ? -1 : std::stod(text.substr(at + name.size() + 2));
}

TEST(metrics, waiting_spares_memory_is_its_own_gauge_not_a_ranks_series) {
  metrics m;
  rank_usage_tracker t(m);
  t.track("peer-a", 0, ::getpid());
  t.track_spares({::getpid(), 0x3fffffff});  // a live one and one already gone
  t.sample_all();
  std::string r = m.render();
  const double self_rss = read_proc_usage(::getpid())->rss_bytes;
  EXPECT_NEAR(series_value(r, "dtactor_spare_resident_memory_bytes"), self_rss, self_rss * 0.5) << r;
  EXPECT_NE(r.find("dtactor_rank_resident_memory_bytes{rank=\"0\"} "), std::string::npos) << r;
  EXPECT_EQ(r.find("dtactor_rank_resident_memory_bytes{rank=\"-1\"}"), std::string::npos) << r;
  t.track_spares({});  // the spare took a rank's place
  t.sample_all();
  EXPECT_EQ(series_value(m.render(), "dtactor_spare_resident_memory_bytes"), 0.0);
}

TEST(metrics, http_sd_lists_the_coordinator_and_admitted_nodes) {
  sd_targets sd("job-x");
  EXPECT_EQ(nlohmann::json::parse(sd.json()), nlohmann::json::array());
  sd.set_coordinator("127.0.0.1", 9400);
  sd.note_registration("peer-1", "n1", "10.0.0.5", 9401);
  sd.note_registration("peer-2", "n2", "10.0.0.6", 0);   // no metrics endpoint
  sd.note_registration("peer-3", "n3", "10.0.0.7", 9403);  // never accepted
  sd.admit("peer-1");
  sd.admit("peer-2");
  auto j = nlohmann::json::parse(sd.json());
  ASSERT_EQ(j.size(), 2u) << j;
  EXPECT_EQ(j[0]["targets"][0], "127.0.0.1:9400");
  EXPECT_EQ(j[0]["labels"]["job"], "job-x");
  EXPECT_EQ(j[0]["labels"]["role"], "coordinator");
  EXPECT_EQ(j[1]["targets"][0], "10.0.0.5:9401");
  EXPECT_EQ(j[1]["labels"]["node"], "n1");
  EXPECT_EQ(j[1]["labels"]["role"], "node");
  // A node registering again with a new address replaces the old one.
  sd.note_registration("peer-9", "n1", "fe80::1", 9401);
  sd.admit("peer-9");
  j = nlohmann::json::parse(sd.json());
  ASSERT_EQ(j.size(), 2u);
  EXPECT_EQ(j[1]["targets"][0], "[fe80::1]:9401");
  sd.remove_node("n1");
  EXPECT_EQ(nlohmann::json::parse(sd.json()).size(), 1u);

  // Served on the metrics port, with the content type Prometheus requires.
  metrics m("job-x");
  m.add_route("/sd", "application/json", [&sd] { return sd.json(); });
  auto port = pick_free_tcp_port();
  ASSERT_TRUE(port);
  ASSERT_TRUE(m.serve(port.value(), "127.0.0.1"));
  const std::string reply = http_get(m.port(), "/sd");
  EXPECT_NE(reply.find("200 OK"), std::string::npos) << reply;
  EXPECT_NE(reply.find("Content-Type: application/json"), std::string::npos) << reply;
  const auto body = nlohmann::json::parse(reply.substr(reply.find("\r\n\r\n") + 4));
  EXPECT_EQ(body[0]["labels"]["role"], "coordinator");
  EXPECT_NE(http_get(m.port(), "/metrics").find("200 OK"), std::string::npos);
}

// Clients that connect and send nothing (or trickle) hold one worker each
// until the request timeout; a scrape beside them is answered at once (one
// thread serving one connection at a time made it wait for every one of
// them in turn: 20 x 2 s here, past http_get's 10 s).
TEST(metrics, idle_clients_do_not_hold_a_scrape) {
  metrics m("job-idle");
  auto port = pick_free_tcp_port();
  ASSERT_TRUE(port);
  ASSERT_TRUE(m.serve(port.value(), "127.0.0.1"));
  std::vector<int> idle;
  for (int i = 0; i < 20; ++i) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(m.port()));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    if (i % 2) {
      ASSERT_EQ(::send(fd, "GET /met", 8, 0), 8);  // half a request line, never finished
    }
    idle.push_back(fd);
  }
  const std::string r = http_get(m.port(), "/metrics");
  EXPECT_NE(r.find("200 OK"), std::string::npos) << r.substr(0, 200);
  for (int fd : idle) ::close(fd);
}

}  // namespace
}  // namespace dtactor
