// The preemption notice watcher without sockets: each cloud's documented
// response shapes, the endpoint overrides, AWS's token handshake, and a
// metadata service that never answers (base/preemption_notice.hpp).
#include "base/preemption_notice.hpp"
#include "base/unix_time.hpp"

#include <gtest/gtest.h>

#include <condition_variable>
#include <map>
#include <mutex>

using namespace dtactor;
using namespace std::chrono_literals;

TEST(PreemptionNotice, ParsesTimes) {
  auto a = parse_utc_time("2026-11-25T08:30:00Z");
  ASSERT_TRUE(a);
  EXPECT_DOUBLE_EQ(*a, 1795595400.0);
  auto b = parse_utc_time("Wed, 25 Nov 2026 08:30:00 GMT");
  ASSERT_TRUE(b);
  EXPECT_DOUBLE_EQ(*b, *a);
  EXPECT_DOUBLE_EQ(parse_utc_time("2026-11-25T08:30:00.5Z").value(), *a + 0.5);
  EXPECT_FALSE(parse_utc_time("2026-11-25T08:30:00+02:00"));
  EXPECT_FALSE(parse_utc_time(""));
  EXPECT_FALSE(parse_utc_time("soon"));
}

TEST(PreemptionNotice, AwsInstanceAction) {
  auto n = parse_aws_instance_action(R"({"action": "terminate", "time": "2026-11-25T08:30:00Z"})", 1795595280.0);
  ASSERT_TRUE(n);
  EXPECT_EQ(n->cloud, cloud_kind::aws);
  EXPECT_EQ(n->detail, "terminate");
  EXPECT_EQ(n->announced, "2026-11-25T08:30:00Z");
  EXPECT_DOUBLE_EQ(n->announced_unix_s - n->noticed_unix_s, 120.0);
  EXPECT_FALSE(parse_aws_instance_action("<html>Not Found</html>", 0));
  EXPECT_FALSE(parse_aws_instance_action(R"({"time": "2026-11-25T08:30:00Z"})", 0));
}

TEST(PreemptionNotice, GcpPreempted) {
  EXPECT_FALSE(parse_gcp_preempted("FALSE", 10));
  auto n = parse_gcp_preempted("TRUE\n", 10);
  ASSERT_TRUE(n);
  EXPECT_EQ(n->cloud, cloud_kind::gcp);
  EXPECT_DOUBLE_EQ(n->announced_unix_s, 40.0);  // GCP's documented 30 s
}

TEST(PreemptionNotice, AzureScheduledEvents) {
  const std::string none = R"({"DocumentIncarnation": 1, "Events": []})";
  EXPECT_FALSE(parse_azure_events(none, "vm-b", 0));
  const std::string reboot =
      R"({"DocumentIncarnation": 2, "Events": [{"EventId": "x", "EventType": "Reboot", "Resources": ["vm-b"], "NotBefore": "Wed, 25 Nov 2026 08:30:00 GMT"}]})";
  EXPECT_FALSE(parse_azure_events(reboot, "vm-b", 0));
  // Found by fuzzing: members of another type than documented are no event, never an exception.
  EXPECT_FALSE(parse_azure_events(R"({"Events": [{"EventId": "x", "EventType": 1}]})", "", 0));
  auto odd = parse_azure_events(R"({"Events": [{"EventId": 7, "EventType": "Preempt", "NotBefore": []}]})", "", 5.0);
  ASSERT_TRUE(odd);
  EXPECT_EQ(odd->detail, "");
  EXPECT_DOUBLE_EQ(odd->announced_unix_s, 35.0);
  const std::string preempt =
      R"({"DocumentIncarnation": 2, "Events": [{"EventId": "e1", "EventType": "Preempt", "Resources": ["vm-a"], "NotBefore": "Wed, 25 Nov 2026 08:30:00 GMT"}]})";
  EXPECT_FALSE(parse_azure_events(preempt, "vm-b", 0)) << "another VM's event";
  auto n = parse_azure_events(preempt, "vm-a", 1795595370.0);
  ASSERT_TRUE(n);
  EXPECT_EQ(n->detail, "e1");
  EXPECT_DOUBLE_EQ(n->announced_unix_s - n->noticed_unix_s, 30.0);
  EXPECT_TRUE(parse_azure_events(preempt, "", 0)) << "no VM name known: any Preempt event";
}

TEST(PreemptionNotice, EndpointOverrides) {
  std::map<std::string, std::string> env;
  auto get = [&](const char* k) -> const char* { return env.count(k) ? env[k].c_str() : nullptr; };
  auto d = metadata_endpoints_from(get, "");
  EXPECT_EQ(d.aws, "http://169.254.169.254");
  EXPECT_EQ(d.gcp, "http://metadata.google.internal");
  EXPECT_EQ(d.azure, "http://169.254.169.254");
  env["AWS_EC2_METADATA_SERVICE_ENDPOINT"] = "http://127.0.0.1:8111/";
  env["GCE_METADATA_HOST"] = "127.0.0.1:8112";
  env["DTACTOR_AZURE_METADATA_ENDPOINT"] = "http://127.0.0.1:8113";
  auto e = metadata_endpoints_from(get, "");
  EXPECT_EQ(e.aws, "http://127.0.0.1:8111");
  EXPECT_EQ(e.gcp, "http://127.0.0.1:8112");
  EXPECT_EQ(e.azure, "http://127.0.0.1:8113");
  EXPECT_EQ(metadata_endpoints_from(get, "http://10.0.0.1:1").azure, "http://10.0.0.1:1") << "the option wins over the environment";
}

namespace {
// An in-memory IMDSv2: tokens, 401 without one, 404 until `notice`.
struct fake_aws {
  bool notice = false;
  int token_requests = 0;
  std::string token = "t1";
  http_call call() {
    return [this](const std::string& method, const std::string& url, const std::vector<std::string>& h, std::chrono::milliseconds) {
      http_reply r;
      if (method == "PUT" && url == "http://imds/latest/api/token") {
        ++token_requests;
        r.code = h.size() == 1 && h[0].rfind("X-aws-ec2-metadata-token-ttl-seconds: ", 0) == 0 ? 200 : 400;
        r.body = token;
      } else if (method == "GET" && url == "http://imds/latest/meta-data/spot/instance-action") {
        if (h.empty() || h[0] != "X-aws-ec2-metadata-token: " + token) r.code = 401;
        else if (!notice) r.code = 404;
        else {
          r.code = 200;
          r.body = R"({"action":"stop","time":"2026-11-25T08:30:00Z"})";
        }
      } else {
        r.code = 404;
      }
      return r;
    };
  }
};
metadata_endpoints imds() {
  metadata_endpoints ep;
  ep.aws = "http://imds";
  return ep;
}
}  // namespace

TEST(PreemptionNotice, AwsTokenHandshakeAndRefresh) {
  fake_aws f;
  metadata_poller p(cloud_kind::aws, imds(), f.call(), 100ms);
  std::optional<preemption_notice> n;
  std::string err;
  EXPECT_EQ(p.poll(0, n, err), metadata_poller::outcome::none);
  EXPECT_EQ(p.poll(0, n, err), metadata_poller::outcome::none);
  EXPECT_EQ(f.token_requests, 1) << "one token for many polls";
  f.token = "t2";  // the token expired: a 401, a new token, the same poll
  f.notice = true;
  ASSERT_EQ(p.poll(0, n, err), metadata_poller::outcome::notice) << err;
  EXPECT_EQ(f.token_requests, 2);
  EXPECT_EQ(n->detail, "stop");
}

TEST(PreemptionNotice, UnreachableServiceNeverNotices) {
  std::mutex mu;
  std::condition_variable cv;
  int calls = 0;
  std::vector<std::string> logs;
  http_call dead = [&](const std::string&, const std::string&, const std::vector<std::string>&, std::chrono::milliseconds) {
    std::lock_guard<std::mutex> l(mu);
    ++calls;
    cv.notify_all();
    return http_reply{0, "", "Couldn't connect to server"};
  };
  bool noticed = false;
  {
    preemption_watch_options o;
    o.cloud = "aws";
    o.poll_interval = 1ms;
    preemption_watcher w(o, dead, [&](const preemption_notice&) { noticed = true; }, [&](const std::string& s) {
      std::lock_guard<std::mutex> l(mu);
      logs.push_back(s);
    });
    std::unique_lock<std::mutex> l(mu);
    ASSERT_TRUE(cv.wait_for(l, 10s, [&] { return calls >= 20; }));
  }
  EXPECT_FALSE(noticed);
  int unreachable_lines = 0;
  for (const auto& s : logs)
    if (s.find("training goes on") != std::string::npos) ++unreachable_lines;
  EXPECT_EQ(unreachable_lines, 1) << "said once, not at every poll";
}

TEST(PreemptionNotice, AutoIsQuietWhereNoCloudAnswers) {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::string> logs;
  std::vector<std::string> urls;
  http_call dead = [&](const std::string&, const std::string& url, const std::vector<std::string>&, std::chrono::milliseconds) {
    std::lock_guard<std::mutex> l(mu);
    urls.push_back(url);
    return http_reply{0, "", "timeout"};
  };
  preemption_watch_options o;
  preemption_watcher w(o, dead, [](const preemption_notice&) { FAIL() << "no notice expected"; }, [&](const std::string& s) {
    std::lock_guard<std::mutex> l(mu);
    logs.push_back(s);
    cv.notify_all();
  });
  std::unique_lock<std::mutex> l(mu);
  ASSERT_TRUE(cv.wait_for(l, 10s, [&] { return !logs.empty(); }));
  ASSERT_EQ(logs.size(), 1u);
  EXPECT_NE(logs[0].find("not watching"), std::string::npos) << logs[0];
  EXPECT_EQ(urls.size(), 3u) << "one detection request per cloud";
}

TEST(PreemptionNotice, AutoPicksTheCloudThatAnswers) {
  std::mutex mu;
  std::condition_variable cv;
  std::optional<preemption_notice> got;
  http_call gcp = [&](const std::string&, const std::string& url, const std::vector<std::string>& h, std::chrono::milliseconds) {
    if (url.find("/computeMetadata/v1/instance/preempted") != std::string::npos && !h.empty() && h[0] == "Metadata-Flavor: Google")
      return http_reply{200, "TRUE", ""};
    return http_reply{0, "", "timeout"};
  };
  preemption_watch_options o;
  o.poll_interval = 1ms;
  preemption_watcher w(o, gcp, [&](const preemption_notice& n) {
    std::lock_guard<std::mutex> l(mu);
    got = n;
    cv.notify_all();
  }, nullptr);
  std::unique_lock<std::mutex> l(mu);
  ASSERT_TRUE(cv.wait_for(l, 10s, [&] { return got.has_value(); }));
  EXPECT_EQ(got->cloud, cloud_kind::gcp);
}

// The real HTTP client (libcurl) against tests/fake_metadata.py, each cloud:
// nothing before the notice, the notice after it.
#include <fstream>
#include <thread>

#include "base/process.hpp"
#include "test_util.hpp"

TEST(PreemptionNotice, CurlAgainstEachCloudsShape) {
  dtactor::testing::temp_dir d;
  for (cloud_kind c : {cloud_kind::aws, cloud_kind::gcp, cloud_kind::azure}) {
    const std::string port_file = d.path() + "/port-" + to_string(c);
    auto p = child_process::spawn({"/usr/bin/python3.11", DTACTOR_SOURCE_DIR "/tests/fake_metadata.py", "--cloud", to_string(c), "--port-file", port_file});
    ASSERT_TRUE(p) << p.message();
    int port = 0;
    for (int i = 0; i < 1000 && port == 0 && p->running(); ++i) {
      std::ifstream f(port_file);
      if (!(f >> port)) port = 0;
      if (port == 0) std::this_thread::sleep_for(10ms);
    }
    ASSERT_NE(port, 0) << "the fake metadata service did not start";
    const std::string base = "http://127.0.0.1:" + std::to_string(port);
    metadata_endpoints ep{base, base, base};
    auto http = curl_http();
    metadata_poller poller(c, ep, http, 2000ms);
    EXPECT_TRUE(poller.detect()) << to_string(c);
    std::optional<preemption_notice> n;
    std::string err;
    EXPECT_EQ(poller.poll(unix_time_now(), n, err), metadata_poller::outcome::none) << to_string(c) << ": " << err;
    ASSERT_EQ(http("GET", base + "/__control/notice", {}, 2000ms).code, 200);
    ASSERT_EQ(poller.poll(unix_time_now(), n, err), metadata_poller::outcome::notice) << to_string(c) << ": " << err;
    EXPECT_EQ(n->cloud, c);
    EXPECT_NEAR(n->announced_unix_s - n->noticed_unix_s, c == cloud_kind::aws ? 120 : 30, 2.0);
    // The other clouds' detection does not take this one's service for theirs.
    for (cloud_kind other : {cloud_kind::aws, cloud_kind::gcp, cloud_kind::azure}) {
      if (other != c) {
        EXPECT_FALSE(metadata_poller(other, ep, http, 2000ms).detect()) << to_string(other) << " on " << to_string(c);
      }
    }
    p->signal(SIGKILL);
    p->wait();
  }
}
