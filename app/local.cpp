// `dtactor local`: a coordinator and N node processes on this machine, over
// loopback, on free ports. Its exit code is the coordinator's (1 when
// every node process ended before the coordinator decided the job's end,
// and the job was stopped for it).
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <optional>
#include <functional>
#include <memory>
#include <thread>

#include "app/chaos.hpp"
#include "app/cluster.hpp"
#include "app/slurm_env.hpp"
#include "base/blas_info.hpp"
#include "base/process.hpp"
#include "base/unix_time.hpp"
#include "net/zmq_bridge.hpp"

namespace dtactor {

namespace {

int local_fail(const std::string& msg, int code) {
  std::fprintf(stderr, "dtactor: %s\n", msg.c_str());
  return code;
}

struct local_node {
  std::string id;
  child_process proc;
};

// The coordinator's command line. It binds a free loopback port (and,
// without --metrics-port, serves its status page and /metrics on another)
// and reports both on `announce_fd`: no port is chosen here and taken by
// someone else before the coordinator binds it.
std::vector<std::string> coordinator_args(const cluster_cli& cli, const std::string& exe, int announce_fd) {
  std::vector<std::string> coord = {exe,         "--role",          "coordinator", "--listen", "tcp://127.0.0.1:0", "--announce-fd",
                                    std::to_string(announce_fd), "--run-dir", cli.run_dir, "--die-with-parent"};
  if (!cli.config_path.empty()) coord.insert(coord.end(), {"--config", cli.config_path});
  for (const auto& o : cli.overrides) coord.insert(coord.end(), {"--set", o});
  // A local job starts when all its nodes are there.
  coord.insert(coord.end(), {"--set", "cluster.min_nodes=" + std::to_string(cli.nodes)});
  if (cli.metrics_port > 0)
    coord.insert(coord.end(), {"--metrics-port", std::to_string(cli.metrics_port), "--metrics-addr", cli.metrics_addr});
  else
    coord.insert(coord.end(), {"--metrics-free-port", "--metrics-addr", "127.0.0.1"});
  if (cli.no_resume) coord.push_back("--no-resume");
  return coord;
}

// Node `index` (id local-INDEX), or standby node `index` (id
// local-standby-INDEX, --standby-node) whose metrics port follows the
// nodes'; its ranks use `per_rank` of the machine's cores.
result<child_process> start_node(const cluster_cli& cli, const std::string& exe, const std::string& endpoint, int index, int per_rank,
                                 bool standby = false) {
  const std::string id = (standby ? "local-standby-" : "local-") + std::to_string(index);
  std::vector<std::string> args = {exe, "--role", "node", "--coordinator", endpoint, "--nproc-per-node", std::to_string(cli.nproc_per_node),
                                   "--node-id", id, "--advertise-addr", "127.0.0.1",
                                   "--threads-per-rank", std::to_string(per_rank), "--die-with-parent"};
  if (standby) args.push_back("--standby-node");
  const int port_index = standby ? cli.nodes + index : index;
  if (cli.metrics_port > 0)
    args.insert(args.end(), {"--metrics-port", std::to_string(cli.metrics_port + 1 + port_index), "--metrics-addr", cli.metrics_addr});
  if (!standby && index == 0 && cli.fail_at_step >= 0)
    args.insert(args.end(), {"--fail-at-step", std::to_string(cli.fail_at_step), "--fail-mode", to_string(cli.fail_mode)});
  // The cluster's processes get a process group of their own (see run_local).
  return child_process::spawn(args, true);
}

// dtactor local --chaos: the monkey over this process's node children.
std::unique_ptr<chaos_monkey> make_monkey(const cluster_cli& cli, std::vector<local_node>& nodes, std::function<std::optional<std::string>()> start) {
  chaos_monkey::hooks h;
  h.alive = [&nodes] {
    std::vector<std::string> ids;
    for (auto& n : nodes)
      if (!n.proc.poll()) ids.push_back(n.id);
    return ids;
  };
  h.kill = [&nodes](const std::string& id) {
    for (auto& n : nodes)
      if (n.id == id) n.proc.signal(SIGKILL);
  };
  h.start = std::move(start);
  h.say = [](const std::string& line) { std::fprintf(stderr, "%schaos: %s\n", ::isatty(2) ? "\r\033[K" : "", line.c_str()); };
  chaos_options o;
  o.every_s = cli.chaos_every_s;
  return std::make_unique<chaos_monkey>(o, std::move(h));
}

// Every node process has ended (those that did are reaped).
bool nodes_all_ended(std::vector<local_node>& nodes) {
  return std::all_of(nodes.begin(), nodes.end(), [](local_node& n) { return n.proc.poll().has_value(); });
}

// Whether a journal line is the coordinator deciding the job's end. It
// journals it before it tells the nodes to shut down: job_stopping before
// the stop's shutdown, job_finished / job_stopped / job_failed before the
// end's.
bool decides_the_end(const ev::journal_event& e) {
  return std::holds_alternative<ev::job_stopping>(e) || std::holds_alternative<ev::job_finished>(e) ||
         std::holds_alternative<ev::job_stopped>(e) || std::holds_alternative<ev::job_failed>(e);
}

// The node processes of a local run: the first --nodes and the
// --standby-nodes, then --chaos's replacements (local-N, local-N+1, ...). The list never reallocates (the
// monkey's hooks hold it by reference): at most 256 nodes.
class local_nodes {
 public:
  local_nodes(const cluster_cli& cli, std::string exe, std::string endpoint)
      : cli_(cli), exe_(std::move(exe)), endpoint_(std::move(endpoint)), next_index_(cli.nodes + cli.standby_nodes) {
    // All the ranks share this machine's cores (a standby's too: it trains
    // once promoted).
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    per_rank_ = std::max(1, cores / ((cli.nodes + cli.standby_nodes) * cli.nproc_per_node));
    nodes_.reserve(256);
  }

  // Starts local-0 .. local-(--nodes - 1), then local-standby-0 ..
  // local-standby-(--standby-nodes - 1). Error: one could not start.
  status start_first() {
    for (int i = 0; i < cli_.nodes + cli_.standby_nodes; ++i) {
      const bool standby = i >= cli_.nodes;
      const int index = standby ? i - cli_.nodes : i;
      auto n = start_node(cli_, exe_, endpoint_, index, per_rank_, standby);
      if (!n) return n.err();
      nodes_.push_back({(standby ? "local-standby-" : "local-") + std::to_string(index), std::move(n.value())});
    }
    return {};
  }

  // A replacement's id; none when the list is full or it could not start.
  std::optional<std::string> start_replacement() {
    if (nodes_.size() >= nodes_.capacity()) return std::nullopt;
    const int index = next_index_++;
    auto n = start_node(cli_, exe_, endpoint_, index, per_rank_);
    if (!n) return std::nullopt;
    nodes_.push_back({"local-" + std::to_string(index), std::move(n.value())});
    return nodes_.back().id;
  }

  std::vector<local_node>& all() { return nodes_; }

  // The coordinator told the nodes to shut down: a few seconds each, then
  // SIGTERM, then SIGKILL.
  void reap() {
    for (auto& n : nodes_)
      if (!n.proc.wait(5000)) n.proc.signal(SIGTERM);
    for (auto& n : nodes_)
      if (!n.proc.wait(5000)) n.proc.signal(SIGKILL);
    for (auto& n : nodes_) n.proc.wait();
  }

 private:
  const cluster_cli& cli_;
  const std::string exe_;
  const std::string endpoint_;
  int per_rank_ = 1;
  int next_index_;
  std::vector<local_node> nodes_;
};

// This session's journal, as `local` follows it: opened at its end before
// the coordinator starts (an earlier session's lines are not this run's),
// each new line to --chaos's monkey, and whether the coordinator has decided
// the job's end.
class local_journal {
 public:
  explicit local_journal(const std::string& run_dir) : tail_(run_dir + "/journal.jsonl") { tail_.read_new(); }

  // --chaos: the monkey over `nodes`, fed from here on.
  void start_chaos(const cluster_cli& cli, local_nodes& nodes) {
    if (cli.chaos) monkey_ = make_monkey(cli, nodes.all(), [&nodes] { return nodes.start_replacement(); });
  }
  chaos_monkey* monkey() { return monkey_.get(); }

  // Reads the lines the coordinator appended since the last call.
  void follow() {
    for (auto& line : tail_.read_new()) {
      end_decided_ = end_decided_ || decides_the_end(line.event);
      if (monkey_) monkey_->on(line.event, line.t);
    }
  }
  // As of the last follow().
  bool end_decided() const { return end_decided_; }

 private:
  journal_tail tail_;
  std::unique_ptr<chaos_monkey> monkey_;
  bool end_decided_ = false;
};

// Every node process has ended before the coordinator decided the job's
// end: nothing will train it (nothing replaces a local node but --chaos's
// own). Nodes end on the coordinator's shutdown too, and the coordinator
// takes a while longer to exit; the journal is read after their exits are
// seen, so a node that ended on that shutdown (its end journaled before it
// was told) is never taken for one that ended first, whatever became of
// the nodes the job lost on the way.
bool nodes_ended_first(local_nodes& nodes, local_journal& journal) {
  if (!nodes_all_ended(nodes.all())) return false;
  journal.follow();
  return !journal.end_decided();
}

// How the coordinator ended; `nodes_gone`: this process stopped it because
// every node process had ended first (nodes_ended_first).
struct local_end {
  child_exit exit;
  bool nodes_gone = false;
};

// Waits for the coordinator, passing a SIGINT/SIGTERM on to it once. Once
// every node process has ended before the job's end was decided, the job
// is stopped and ends failed.
// Where the coordinator listens, as it reported once bound.
struct coordinator_ports {
  std::string endpoint;
  int status_port = 0;
};

// "ENDPOINT STATUS_PORT\n" from the coordinator's report descriptor `fd`;
// nothing when it ended first (it said why). A stop signal meanwhile is
// handed to it.
std::optional<coordinator_ports> await_coordinator_ports(const cluster_cli& cli, child_process& coordinator, int fd) {
  std::string text;
  bool forwarded = false;
  while (text.find('\n') == std::string::npos && text.size() < 512) {
    const int sig = cli.stop_signal ? cli.stop_signal->load() : 0;
    if (sig != 0 && !forwarded) {
      forwarded = true;
      coordinator.signal(sig);
    }
    pollfd p{fd, POLLIN, 0};
    const int ready = ::poll(&p, 1, 100);
    if (ready < 0 && errno != EINTR) return std::nullopt;
    if (ready <= 0) continue;
    char buf[256];
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return std::nullopt;
    text.append(buf, static_cast<size_t>(n));
  }
  coordinator_ports ports;
  const auto space = text.find(' ');
  if (space == std::string::npos) return std::nullopt;
  ports.endpoint = text.substr(0, space);
  ports.status_port = std::atoi(text.c_str() + space + 1);
  if (ports.status_port <= 0) return std::nullopt;
  return ports;
}

local_end watch_coordinator(const cluster_cli& cli, child_process& coordinator, local_nodes& nodes, local_journal& journal) {
  bool forwarded = false, nodes_gone = false;
  std::optional<child_exit> done;
  while (!(done = coordinator.wait(100))) {
    const int sig = cli.stop_signal ? cli.stop_signal->load() : 0;
    if (sig != 0 && !forwarded) {
      forwarded = true;
      coordinator.signal(sig);
    }
    journal.follow();
    if (journal.monkey() && !forwarded) journal.monkey()->tick(unix_time_now());
    if (!nodes_gone && nodes_ended_first(nodes, journal)) {
      nodes_gone = true;
      std::string how;
      for (auto& n : nodes.all()) how += (how.empty() ? "" : ", ") + n.proc.poll()->describe();
      std::fprintf(stderr, "local: every node process has ended before the job did (%s): nothing is left to train it; stopping the coordinator\n",
                   how.c_str());
      coordinator.signal(SIGTERM);
    }
  }
  return {*done, nodes_gone};
}

// The local job's exit code from the coordinator's. Stopped by this process
// because every node had gone, it ends failed (but a job that had finished
// by then, which the coordinator's exit 0 says, did finish).
int exit_code_of(const std::optional<child_exit>& exit, bool nodes_gone) {
  if (!exit) return 1;
  if (nodes_gone && (exit->signaled || exit->exit_code != 0)) return 1;
  if (exit->signaled) return 128 + exit->signal;
  return exit->exit_code;
}

}  // namespace

std::string local_arguments_problem(const cluster_cli& cli) {
  if (cli.nodes < 1 || cli.nodes > 64) return "--nodes must be 1..64";
  if (cli.nproc_per_node < 1 || cli.nproc_per_node > 64) return "--nproc-per-node must be 1..64";
  if (cli.chaos && cli.nodes < 2) return "--chaos needs --nodes 2 or more (a lost node needs survivors)";
  if (cli.standby_nodes < 0 || cli.standby_nodes > 64) return "--standby-nodes must be 0..64";
  return "";
}

int run_local(const cluster_cli& cli) {
  choose_blas_kernels_for_children();  // before any rank starts: none loads LibTorch twice
  if (auto why = local_arguments_problem(cli); !why.empty()) return local_fail(why, 2);
  // Everything the coordinator would refuse, refused before any process
  // starts: one line, as `train` gives.
  cluster_cli as_coordinator = cli;
  as_coordinator.overrides.push_back("cluster.min_nodes=" + std::to_string(cli.nodes));
  if (auto c = check_coordinator_setup(as_coordinator); c.code != 0) return local_fail(c.message, c.code);
  const std::string exe = self_executable();
  local_journal journal(cli.run_dir);
  int report[2];
  if (::pipe2(report, O_CLOEXEC) != 0) return local_fail(std::string("cannot make a pipe: ") + std::strerror(errno), 1);
  // The cluster's processes get a process group of their own: a terminal's
  // Ctrl-C (or SIGTERM to this process group) reaches only this process,
  // which hands it to the coordinator, so the job stops as one, after a
  // final checkpoint, instead of every node taking it for a preemption.
  auto c = child_process::spawn_keeping_fd(coordinator_args(cli, exe, report[1]), true, report[1]);
  ::close(report[1]);
  if (!c) {
    ::close(report[0]);
    return local_fail(c.message(), 1);
  }
  const auto ports = await_coordinator_ports(cli, c.value(), report[0]);
  ::close(report[0]);
  if (!ports) return exit_code_of(c.value().wait(), false);
  local_nodes nodes(cli, exe, ports->endpoint);
  if (auto st = nodes.start_first(); !st) {
    c->signal(SIGTERM);
    return local_fail(st.message(), 1);
  }
  const std::string host = cli.metrics_port > 0 && cli.metrics_addr != "0.0.0.0" ? cli.metrics_addr : "127.0.0.1";
  const std::string standbys = cli.standby_nodes > 0 ? " and " + std::to_string(cli.standby_nodes) + " standby node(s)" : "";
  std::fprintf(stderr, "local: coordinator on %s, %d node(s)%s x %d rank(s), run dir %s\nlocal: status page http://%s:%d/\n", ports->endpoint.c_str(),
               cli.nodes, standbys.c_str(), cli.nproc_per_node, cli.run_dir.c_str(), host.c_str(), ports->status_port);

  journal.start_chaos(cli, nodes);
  const local_end end = watch_coordinator(cli, c.value(), nodes, journal);
  if (auto* monkey = journal.monkey(); monkey && !monkey->summary().empty()) std::fprintf(stderr, "chaos: %s\n", monkey->summary().c_str());
  nodes.reap();
  return exit_code_of(end.exit, end.nodes_gone);
}

int run_static_node(const cluster_cli& cli) {
  auto fail = [](const std::string& msg) {
    std::fprintf(stderr, "dtactor: %s\n", msg.c_str());
    return 2;
  };
  auto env_int = [](const char* name, int fallback) -> std::optional<int> {
    const char* v = std::getenv(name);
    if (!v || !*v) return fallback;
    char* end = nullptr;
    const long x = std::strtol(v, &end, 10);
    if (*end != '\0' || x < 0 || x > 1000000) return std::nullopt;
    return static_cast<int>(x);
  };
  const std::string addr = std::getenv("MASTER_ADDR");
  const auto port = env_int("MASTER_PORT", 29500), world = env_int("WORLD_SIZE", -1), node_rank = env_int("NODE_RANK", 0);
  if (!port || *port < 1 || *port > 65535) return fail("MASTER_PORT must be a port number 1..65535");
  if (!world || *world < 1) return fail("static mode needs WORLD_SIZE (the number of ranks of the job) in the environment");
  if (!node_rank) return fail("NODE_RANK must be a non-negative integer");
  if (*world % cli.nproc_per_node != 0)
    return fail("WORLD_SIZE (" + std::to_string(*world) + ") is not a multiple of --nproc-per-node (" + std::to_string(cli.nproc_per_node) + ")");
  const int nnodes = *world / cli.nproc_per_node;
  if (*node_rank >= nnodes) return fail("NODE_RANK " + std::to_string(*node_rank) + " is not below the number of nodes " + std::to_string(nnodes));
  return run_static_launch(cli, addr, *port, nnodes, *node_rank, "node-" + std::to_string(*node_rank));
}

int run_slurm_node(const cluster_cli& cli) {
  std::string error;
  auto l = slurm_launch_from([](const char* k) { return std::getenv(k); }, scontrol_node_addr, error);
  if (!l) {
    std::fprintf(stderr, "dtactor: %s\n", error.c_str());
    return 2;
  }
  cluster_cli c = cli;
  // One dtactor task per node; it starts a rank per GPU Slurm gave the node.
  if (c.nproc_per_node == 1 && l->gpus_on_node > 0) c.nproc_per_node = l->gpus_on_node;
  // scancel, a preemption and --signal reach every task of the job step at
  // once, the coordinator's (a child of node 0's task) too: the job stops
  // after a final checkpoint rather than each node leaving.
  if (c.signal_waits_for_stop_s == 0) c.signal_waits_for_stop_s = 20;
  std::fprintf(stderr, "node: Slurm job %s%s: node '%s' (%d of %d), coordinator %s:%d%s\n", l->job_id.c_str(),
               l->restart_count > 0 ? (" (restart " + std::to_string(l->restart_count) + ")").c_str() : "", l->node_name.c_str(),
               l->node_index, l->nnodes, l->coordinator_host.c_str(), l->port, l->node_index == 0 ? " (runs it)" : "");
  return run_static_launch(c, l->coordinator_host, l->port, l->nnodes, l->node_index, l->node_name);
}

int run_static_launch(const cluster_cli& cli, const std::string& addr, int port, int nnodes, int node_rank, const std::string& default_node_id) {
  auto fail = [](const std::string& msg) {
    std::fprintf(stderr, "dtactor: %s\n", msg.c_str());
    return 2;
  };
  const std::string endpoint = "tcp://" + addr + ":" + std::to_string(port);
  std::optional<child_process> coord;
  if (node_rank == 0) {
    std::vector<std::string> args = {self_executable(), "--role", "coordinator", "--listen", "tcp://0.0.0.0:" + std::to_string(port), "--run-dir",
                                     cli.run_dir, "--advertise-addr", addr};
    if (!cli.config_path.empty()) args.insert(args.end(), {"--config", cli.config_path});
    for (const auto& o : cli.overrides) args.insert(args.end(), {"--set", o});
    args.insert(args.end(), {"--set", "cluster.min_nodes=" + std::to_string(nnodes), "--set", "cluster.max_nodes=" + std::to_string(nnodes)});
    auto c = child_process::spawn(args);
    if (!c) return fail(c.message());
    coord.emplace(std::move(c.value()));
  }
  cluster_cli node = cli;
  node.coordinator = endpoint;
  if (node.node_id.empty()) node.node_id = default_node_id;
  const int code = run_node(node);
  if (coord) {
    auto e = coord->wait(10000);
    if (!e) {
      coord->signal(SIGTERM);
      e = coord->wait();
    }
    if (e && (e->signaled || e->exit_code != 0)) return e->signaled ? 128 + e->signal : e->exit_code;
  }
  return code;
}

}  // namespace dtactor
