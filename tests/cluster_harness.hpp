#pragma once
// Real coordinator and node processes on loopback for the chaos tests and
// bench/bench_chaos: start them, signal a node together with its rank
// processes, wait for journal events (polling the journal, never fixed
// sleeps). Header-only; needs DTACTOR_BINARY.
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "job/journal_events.hpp"
#include "http_get.hpp"
#include "base/process.hpp"
#include "net/zmq_bridge.hpp"

namespace dtactor::testing {

using json = nlohmann::json;

// {"a=1", "b=2"} + extra -> {"--set", "a=1", "--set", "b=2", ...}
inline std::vector<std::string> set_flags(std::vector<std::string> sets, const std::vector<std::string>& extra = {}) {
  sets.insert(sets.end(), extra.begin(), extra.end());
  std::vector<std::string> out;
  for (const auto& s : sets) {
    out.push_back("--set");
    out.push_back(s);
  }
  return out;
}

inline std::vector<json> read_journal_lines(const std::string& path) {
  std::vector<json> out;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) {
    auto j = json::parse(line, nullptr, false);
    if (!j.is_discarded()) out.push_back(std::move(j));
  }
  return out;
}

// The lines of one event, by its schema type (a renamed event breaks here at
// compile time); rank_down's two names go through journal_events_named.
inline std::vector<json> journal_events_named(const std::vector<json>& j, std::string_view name) {
  std::vector<json> out;
  for (const auto& e : j)
    if (e.value("event", "") == name) out.push_back(e);
  return out;
}
template <class E>
std::vector<json> journal_events(const std::vector<json>& j) {
  return journal_events_named(j, E::name);
}

// Polls `pred` every 20 ms for up to `timeout_s`.
inline bool eventually(const std::function<bool()>& pred, int timeout_s = 90) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return pred();
}

// Every process below `pid` (its rank processes), from /proc.
inline std::vector<pid_t> descendants(pid_t pid) {
  std::vector<pid_t> out;
  std::error_code ec;
  // Each thread lists the children it started.
  for (const auto& task : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task", ec)) {
    std::ifstream f(task.path() / "children");
    pid_t c;
    while (f >> c) {
      out.push_back(c);
      for (pid_t g : descendants(c)) out.push_back(g);
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Whether `pid` is a node's warm spare rank process (started with --spare).
inline bool is_spare_process(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/cmdline");
  std::string cmd((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return cmd.find(std::string("--spare") + '\0') != std::string::npos;
}

// A node's rank processes (its children that are no spare), or with
// `spares` its waiting spares.
inline std::vector<pid_t> rank_processes(pid_t node_pid, bool spares = false) {
  std::vector<pid_t> out;
  for (pid_t p : descendants(node_pid))
    if (is_spare_process(p) == spares) out.push_back(p);
  return out;
}

struct cluster {
  std::string run_dir;
  std::string endpoint;
  int port = 0;
  std::vector<std::string> sets;
  std::optional<child_process> coord;
  std::map<std::string, child_process> nodes;
  // Separate hosts (tests/netns_hosts.hpp): a command prefix per process
  // ("ip netns exec HOST"), and nodes left to find their own address.
  std::vector<std::string> coord_prefix;
  std::map<std::string, std::vector<std::string>> node_prefix;
  bool loopback = true;

  cluster(std::string dir, std::vector<std::string> job) : run_dir(std::move(dir)), sets(std::move(job)) {
    port = pick_free_tcp_port().value();
    endpoint = "tcp://127.0.0.1:" + std::to_string(port);
  }
  ~cluster() {
    if (coord && coord->running()) coord->signal(SIGKILL);
    for (auto& [id, n] : nodes)
      if (n.running()) {
        n.signal(SIGCONT);
        n.signal(SIGKILL);
      }
  }

  std::string start_coordinator(const std::vector<std::string>& extra = {}) {
    std::vector<std::string> a = coord_prefix;
    for (const char* arg : {DTACTOR_BINARY, "--role", "coordinator", "--listen"}) a.push_back(arg);
    a.insert(a.end(), {endpoint, "--run-dir", run_dir});
    a.insert(a.end(), sets.begin(), sets.end());
    a.insert(a.end(), extra.begin(), extra.end());
    auto c = child_process::spawn(a, false, run_dir + "/coordinator.log");
    if (!c) return c.message();
    coord.emplace(std::move(c.value()));
    return {};
  }
  std::string start_node(const std::string& id, const std::vector<std::string>& extra = {}) {
    std::vector<std::string> a = node_prefix.count(id) ? node_prefix.at(id) : std::vector<std::string>{};
    // Nodes share this machine's cores (as `dtactor local` splits them).
    a.insert(a.end(), {std::string(DTACTOR_BINARY), "--role", "node", "--coordinator", endpoint, "--node-id", id, "--threads-per-rank", "1"});
    if (loopback) a.insert(a.end(), {"--advertise-addr", "127.0.0.1"});
    // DTACTOR_TEST_SPARES=N: every node keeps N warm spare rank processes
    // (the fault tests with spares on); a test's own --spares wins.
    if (const char* n = std::getenv("DTACTOR_TEST_SPARES"); n && *n && std::find(extra.begin(), extra.end(), "--spares") == extra.end())
      a.insert(a.end(), {"--spares", n});
    a.insert(a.end(), extra.begin(), extra.end());
    auto n = child_process::spawn(a, false, run_dir + "/node-" + id + ".log");
    if (!n) return n.message();
    nodes.erase(id);
    nodes.emplace(id, std::move(n.value()));
    return {};
  }
  // The coordinator, then one node per id; the first error, or empty.
  std::string start(const std::vector<std::string>& node_ids) {
    if (auto e = start_coordinator(); !e.empty()) return e;
    for (const auto& id : node_ids)
      if (auto e = start_node(id); !e.empty()) return e;
    return {};
  }
  // Signals a node and every rank process under it.
  void signal_node(const std::string& id, int sig) {
    auto& n = nodes.at(id);
    auto kids = descendants(n.pid());
    n.signal(sig);
    for (pid_t k : kids) ::kill(k, sig);
  }

  std::vector<json> journal() const { return read_journal_lines(run_dir + "/journal.jsonl"); }

  // Polls the journal until `pred` holds, the coordinator ends, or the
  // deadline passes. Returns whether `pred` held.
  bool wait_for(const std::function<bool(const std::vector<json>&)>& pred, int timeout_s = 90) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
    while (std::chrono::steady_clock::now() < deadline) {
      if (pred(journal())) return true;
      if (coord && !coord->running()) return pred(journal());
      if (coord) coord->wait(20);
      else std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }
  // Until a step at or after `step` was journaled (at world size `world`, when given).
  bool wait_step(int64_t step, int world = 0, int timeout_s = 90) {
    return wait_for([&](const std::vector<json>& j) {
      auto s = journal_events<ev::step_completed>(j);
      return !s.empty() && s.back().at("step").get<int64_t>() >= step && (world == 0 || s.back().at("world_size") == world);
    }, timeout_s);
  }
  std::string logs() const {
    std::string out;
    for (const auto& e : std::filesystem::directory_iterator(run_dir))
      // (Regular files only: a test may make a process's output a FIFO.)
      if (e.path().extension() == ".log" && e.is_regular_file()) {
        std::ifstream f(e.path());
        std::stringstream ss;
        ss << f.rdbuf();
        std::string t = ss.str();
        if (t.size() > 3000) t = "..." + t.substr(t.size() - 3000);
        out += "---- " + e.path().filename().string() + "\n" + t;
      }
    return out;
  }
};

// A node's own dtactor_step gauge (its ranks' progress, with or without a
// coordinator), or -1.
inline double node_step(int metrics_port) {
  std::smatch m;
  const std::string scrape = test_support::http_get(metrics_port, "/metrics");
  static const std::regex re("\ndtactor_step(\\{[^}]*\\})? ([-0-9.e+]+)");
  return std::regex_search(scrape, m, re) ? std::stod(m[2]) : -1.0;
}

}  // namespace dtactor::testing
