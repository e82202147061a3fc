// Tested against the real thing: Debian's Prometheus server on loopback
// scrapes a short real `dtactor local` run through the coordinator's HTTP
// service discovery, with monitoring/alerts.yml loaded. Then every PromQL
// expression of the Grafana dashboard (panels and annotations) and every
// alert rule is run through Prometheus's HTTP API over the run's time range:
// panel queries must return data; alerts must be valid, evaluate without
// error, and stay empty in this healthy run, while the series they watch
// exist. Skips (with a message) only when the prometheus binary is missing.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "http_get.hpp"
#include "base/process.hpp"
#include "net/zmq_bridge.hpp"
#include "test_util.hpp"

namespace dtactor {
namespace {

using nlohmann::json;
using test_support::http_get;

const std::string kBin = DTACTOR_BINARY;
const std::string kSrc = DTACTOR_SOURCE_DIR;

std::string find_prometheus() {
  if (const char* p = std::getenv("PROMETHEUS_BIN"); p && *p) return p;
  for (const char* p : {"/usr/bin/prometheus", "/usr/local/bin/prometheus"})
    if (::access(p, X_OK) == 0) return p;
  return "";
}

bool port_free(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  ::close(fd);
  return ok;
}

// A port P with P+1 and P+2 free too (dtactor local gives node i P+1+i).
int three_free_ports() {
  for (int i = 0; i < 50; ++i) {
    const int p = pick_free_tcp_port().value();
    if (p < 65000 && port_free(p + 1) && port_free(p + 2)) return p;
  }
  return 0;
}

std::string body_of(const std::string& response) {
  const auto p = response.find("\r\n\r\n");
  return p == std::string::npos ? "" : response.substr(p + 4);
}

std::string url_encode(const std::string& s) {
  std::string out;
  char buf[4];
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out += static_cast<char>(c);
    } else {
      std::snprintf(buf, sizeof buf, "%%%02X", c);
      out += buf;
    }
  }
  return out;
}

// Polls `cond` until it holds or `seconds` pass: waiting for an event with a
// deadline, not a fixed sleep.
bool eventually(double seconds, const std::function<bool()>& cond) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  return cond();
}

struct prom {
  int port = 0;
  json get(const std::string& path) {
    const std::string b = body_of(http_get(port, path));
    json j = json::parse(b, nullptr, false);
    return j.is_discarded() ? json::object() : j;
  }
  // query_range over [t0, t1]; returns the API's JSON.
  json range(const std::string& expr, double t0, double t1) {
    char buf[128];
    std::snprintf(buf, sizeof buf, "&start=%.3f&end=%.3f&step=1", t0, t1);
    return get("/api/v1/query_range?query=" + url_encode(expr) + buf);
  }
};

// Samples of any series in a query_range result (NaN included).
size_t samples(const json& r) {
  size_t n = 0;
  if (r.value("status", "") != "success") return 0;
  for (const auto& s : r["data"]["result"]) n += s["values"].size();
  return n;
}

// Every expression of the dashboard: panels' targets and annotations, with
// Grafana's variables replaced as Grafana would for "all jobs".
std::vector<std::pair<std::string, std::string>> dashboard_queries(const json& dash) {
  std::vector<std::pair<std::string, std::string>> out;
  auto subst = [](std::string e) {
    e = std::regex_replace(e, std::regex("\\$job"), ".+");
    e = std::regex_replace(e, std::regex("\\$__rate_interval"), "5s");
    return e;
  };
  for (const auto& p : dash["panels"])
    if (p.contains("targets"))
      for (const auto& t : p["targets"]) out.emplace_back("panel '" + p["title"].get<std::string>() + "' " + t["refId"].get<std::string>(), subst(t["expr"]));
  for (const auto& a : dash["annotations"]["list"])
    if (a.contains("expr")) out.emplace_back("annotation '" + a["name"].get<std::string>() + "'", subst(a["expr"]));
  return out;
}

TEST(prometheus, dashboard_and_alerts_against_a_real_scrape) {
  const std::string prometheus = find_prometheus();
  if (prometheus.empty()) SKIP_OR_FAIL_IN_CI("no prometheus binary (Debian package `prometheus`; scripts/install-deps.sh installs it)");

  dtactor::testing::temp_dir dir;
  const int metrics_port = three_free_ports();
  ASSERT_GT(metrics_port, 0);
  const int prom_port = pick_free_tcp_port().value();

  // Prometheus as monitoring/prometheus.yml sets it up, at a faster pace.
  std::ofstream(dir.path() + "/prometheus.yml") << "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                                                << "rule_files:\n  - " << kSrc << "/monitoring/alerts.yml\n"
                                                << "scrape_configs:\n  - job_name: dtactor\n    honor_labels: true\n"
                                                << "    http_sd_configs:\n      - url: http://127.0.0.1:" << metrics_port << "/sd\n"
                                                << "        refresh_interval: 1s\n";
  auto server = child_process::spawn({prometheus, "--config.file=" + dir.path() + "/prometheus.yml", "--storage.tsdb.path=" + dir.path() + "/tsdb",
                                      "--web.listen-address=127.0.0.1:" + std::to_string(prom_port), "--log.level=warn"},
                                     false, dir.path() + "/prometheus.log");
  ASSERT_TRUE(server) << server.message();
  prom p{prom_port};
  ASSERT_TRUE(eventually(60, [&] { return http_get(prom_port, "/-/ready").find("200 OK") != std::string::npos; }))
      << "prometheus did not become ready; see " << dir.path() << "/prometheus.log";

  // A short real run: two nodes, one rank each, evaluations and checkpoints;
  // long enough (~20 s here) for the stall alert's 5 s offset to have data
  // even when Prometheus's first scrape comes late on a loaded machine
  // (at 3,000 steps, ~10 s, a run under the suite's load once left it none).
  const double t_start = static_cast<double>(std::time(nullptr)) - 1;
  auto run = child_process::spawn({kBin, "local", "--nodes", "2", "--nproc-per-node", "1", "--metrics-port", std::to_string(metrics_port), "--run-dir",
                                   dir.path() + "/run", "--set", "model.dim=32", "--set", "model.layers=2", "--set", "model.heads=2", "--set",
                                   "train.global_batch_size=64", "--set", "train.max_steps=6000", "--set", "train.warmup_steps=20", "--set",
                                   "train.log_every_steps=20", "--set", "eval.every_steps=1000", "--set", "eval.max_samples=500", "--set",
                                   "checkpoint.every_steps=500"},
                                  false, dir.path() + "/run.log");
  ASSERT_TRUE(run) << run.message();

  // Service discovery brings in the coordinator and both nodes.
  auto targets_up = [&] {
    auto t = p.get("/api/v1/targets?state=active");
    std::set<std::string> roles;
    int up = 0;
    for (const auto& a : t["data"]["activeTargets"])
      if (a.value("health", "") == "up") ++up, roles.insert(a["labels"].value("role", ""));
    return up == 3 && roles.count("coordinator") && roles.count("node");
  };
  EXPECT_TRUE(eventually(60, targets_up)) << p.get("/api/v1/targets").dump(1);
  // Training is seen through Prometheus: the coordinator's step moves.
  EXPECT_TRUE(eventually(120, [&] {
    auto r = p.get("/api/v1/query?query=" + url_encode("dtactor_step{role=\"coordinator\"} > 100"));
    return r.contains("data") && !r["data"]["result"].empty();
  }));
  // The job ends by itself.
  auto done = run->wait(240 * 1000);
  ASSERT_TRUE(done) << "the run did not finish";
  EXPECT_EQ(done->exit_code, 0) << done->describe() << "; see " << dir.path() << "/run.log";
  const double t_end = static_cast<double>(std::time(nullptr)) + 1;
  // The healthy stretch for the alerts: until the job finished (then its
  // processes exit and their targets go down, as they should).
  double t_finished = 0;
  for (const auto& e : dtactor::testing::read_journal(dir.path() + "/run/journal.jsonl"))
    if (e.value("event", "") == ev::job_finished::name) t_finished = e.value("t", 0.0);
  ASSERT_GT(t_finished, t_start);
  // Prometheus has evaluated the rules on this data (their last evaluation
  // came after the job's last step).
  json rules;
  EXPECT_TRUE(eventually(30, [&] {
    rules = p.get("/api/v1/rules?type=alert");
    if (rules.value("status", "") != "success") return false;
    for (const auto& g : rules["data"]["groups"])
      for (const auto& r : g["rules"])
        if (r.value("health", "") != "ok") return false;
    return !rules["data"]["groups"].empty();
  })) << rules.dump(1);

  // ---- the dashboard ----
  std::ifstream dash_in(kSrc + "/monitoring/grafana/dtactor.json");
  const json dash = json::parse(dash_in);
  const auto queries = dashboard_queries(dash);
  EXPECT_GE(queries.size(), 25u);
  // Series that stay empty in a healthy run: nothing failed, nothing dropped.
  const std::set<std::string> may_be_empty = {"panel 'Failure detection and recovery time (p90)' A",
                                              "panel 'Failure detection and recovery time (p90)' B", "panel 'Dropped wire frames' A",
                                              "annotation 'Recoveries'", "annotation 'Generation changes'",
                                              // this job reads no shards (docs/data.md)
                                              "panel 'Sharded data: bytes read' A", "panel 'Sharded data: bytes read' B",
                                              "panel 'Sharded data: cache and read-ahead' D"};
  for (const auto& [what, expr] : queries) {
    const json r = p.range(expr, t_start, t_end);
    EXPECT_EQ(r.value("status", ""), "success") << what << ": " << expr << " -> " << r.dump();
    if (!may_be_empty.count(what)) {
      EXPECT_GT(samples(r), 0u) << what << " returned no data: " << expr;
    }
  }
  // The template variable's query finds this job.
  auto jobs = p.get("/api/v1/label/job/values");
  EXPECT_FALSE(jobs["data"].empty()) << jobs.dump();
  EXPECT_EQ(jobs["data"][0].get<std::string>().rfind("job-", 0), 0u) << jobs.dump();

  // ---- the alerts ----
  std::set<std::string> alert_names;
  for (const auto& g : rules["data"]["groups"])
    for (const auto& r : g["rules"]) {
      const std::string name = r["name"], expr = r["query"];
      alert_names.insert(name);
      const json res = p.range(expr, t_start, t_finished);
      EXPECT_EQ(res.value("status", ""), "success") << name << ": " << expr;
      EXPECT_EQ(samples(res), 0u) << name << " would fire in a healthy run: " << expr << " -> " << res["data"].dump();
    }
  EXPECT_EQ(alert_names, (std::set<std::string>{"DtactorNodeLost", "DtactorTargetDown", "DtactorTrainingStalled", "DtactorLossNotFinite",
                                                "DtactorRecoveriesTooFrequent", "DtactorCheckpointTooOld"}));
  // What the alerts watch does exist in the scrape (an alert on a misspelt
  // series would be empty forever).
  for (const std::string witness :
       {"increase(dtactor_recoveries_total{cause=\"node_lost\"}[10m])", "up{role=~\"coordinator|node\"}", "dtactor_step - dtactor_step offset 5s",
        "dtactor_max_steps", "abs(dtactor_loss)", "dtactor_checkpoint_last_timestamp_seconds > 0"})
    EXPECT_GT(samples(p.range(witness, t_start, t_end)), 0u) << witness;

  server->signal(SIGTERM);
  server->wait(10000);
}

}  // namespace
}  // namespace dtactor
