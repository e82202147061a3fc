// The node process: the node agent actor (actors/node_agent), the ZeroMQ
// bridge (a DEALER to the coordinator, a ROUTER on an ipc socket for the
// ranks), and the rank processes it starts and reaps.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <caf/all.hpp>

#include <atomic>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <thread>

#include "base/async_log.hpp"
#include "base/line_forwarder.hpp"
#include "base/log_limiter.hpp"
#include "base/printable.hpp"
#include "actors/membership.hpp"
#include "actors/messages.hpp"
#include "actors/node_agent.hpp"
#include "app/caf_setup.hpp"
#include "app/cluster.hpp"
#include "app/cluster_util.hpp"
#include "base/blas_info.hpp"
#include "monitoring/gpu_metrics.hpp"
#include "monitoring/metrics.hpp"
#include "dtactor/config.hpp"
#include "job/settings.hpp"
#include "monitoring/resources.hpp"
#include "base/preemption_notice.hpp"
#include "base/process.hpp"
#include "net/wire.hpp"
#include "net/zmq_bridge.hpp"

namespace dtactor {

namespace {

int fail(const std::string& msg, int code = 1) {
  stderr_line("dtactor: " + msg);
  return code;
}

// The agent stamps heartbeats with its actor clock (steady_clock) seconds;
// the coordinator echoes them back.
void observe_heartbeat_rtt(metrics& m, double echoed_steady_s) {
  const double now = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  const double rtt = now - echoed_steady_s;
  if (rtt >= 0 && rtt < 60) m.heartbeat_rtt().Observe(rtt);
}

// The usage of the rank process behind a step report, for the coordinator's
// `resources` journal events.
void add_usage(pb::step_report& r, const std::optional<proc_usage>& u, const node_id& id) {
  r.set_node_id(id.str());
  if (!u) return;
  r.set_cpu_s(u->cpu_s);
  r.set_rss_bytes(u->rss_bytes);
  r.set_peak_rss_bytes(u->peak_rss_bytes);
  r.set_process_age_s(u->age_s);
}

// Starts rank processes (this binary, --role rank) and reaps them on its own
// thread, reporting each exit to the node agent as a rank_exit message.
class rank_launcher : public process_launcher {
 public:
  // `fault_args` go to the first start of local rank 0 only (fault injection;
  // to every start of it when `every_start`: --fail-mode rank-oom).
  // Exits go to `agent` (set before any rank starts).
  rank_launcher(std::vector<std::string> base_args, std::vector<std::string> fault_args, bool every_start)
      : base_(std::move(base_args)), fault_(std::move(fault_args)), fault_every_start_(every_start), reaper_([this](pid_t pid, int code) {
          caf::anon_send(agent_, rank_exit_atom::value, static_cast<int32_t>(pid), static_cast<int32_t>(code));
        }) {}
  ~rank_launcher() override { stop(); }

  // Before the agent starts (it spawns ranks once started).
  void attach(node_agent_handle agent) { agent_ = std::move(agent); }

  result<int32_t> spawn(int32_t local_rank) override {
    auto args = base_;
    args.push_back("--local-rank");
    args.push_back(std::to_string(local_rank));
    if (local_rank == 0 && !fault_.empty()) {
      args.insert(args.end(), fault_.begin(), fault_.end());
      if (!fault_every_start_) fault_.clear();
    }
    // Ranks are in a process group of their own: a signal to the node's
    // group (a terminal's Ctrl-C) reaches the node, which decides how its
    // ranks stop (at a step boundary, after a final checkpoint); they die
    // with it if it dies (PR_SET_PDEATHSIG).
    auto c = spawn_rank(args);
    if (!c) return c.err();
    const pid_t pid = c->release();
    reaper_.adopt(pid);
    return static_cast<int32_t>(pid);
  }

  // A warm spare: the ranks' arguments without a local rank (and without
  // fault injection, which is local rank 0's first process's).
  result<int32_t> spawn_spare() override {
    auto args = base_;
    args.push_back("--spare");
    auto c = spawn_rank(args);
    if (!c) return c.err();
    const pid_t pid = c->release();
    reaper_.adopt(pid);
    return static_cast<int32_t>(pid);
  }

  // A rank leaves at once on SIGUSR2, the node's own signal to it (SIGTERM
  // may come from a scheduler to the whole process tree, and then the node
  // decides: app/rank.cpp); one that does not (stopped, stuck in the
  // kernel) is killed after the grace period.
  void terminate(int32_t pid) override { reaper_.terminate(pid, std::chrono::seconds(3), SIGUSR2); }
  void kill(int32_t pid) override { reaper_.kill(pid); }

  // The ranks are killed and reaped, then what they wrote last is passed on.
  void stop() {
    reaper_.stop();
    output_.stop();
  }

 private:
  // A rank writes its stdout and stderr into a pipe the node reads
  // (output_), whose lines go out through the node's non-blocking stderr:
  // a stderr nobody reads never blocks a rank's training thread. Without
  // a pipe (no descriptors left) the rank shares the node's stderr.
  result<child_process> spawn_rank(const std::vector<std::string>& args) {
    auto pipe = output_.open_pipe();
    if (!pipe) return child_process::spawn(args, true);
    auto c = child_process::spawn_to_fd(args, true, pipe.value());
    ::close(pipe.value());
    return c;
  }

  std::vector<std::string> base_;
  std::vector<std::string> fault_;
  bool fault_every_start_ = false;
  node_agent_handle agent_;
  line_forwarder output_;  // the ranks' lines to stderr_line; stops after the reaper
  child_reaper reaper_;    // last: its thread stops before the members it uses go
};

// Default id: the host name; in a network namespace of its own (a host of
// its own that shares the machine's host name) with the namespace added. A
// host name outside the node id alphabet is mapped into it.
std::string default_node_id() {
  std::string id = host_name();
  if (!in_initial_net_namespace()) {
    const std::string ns = net_namespace();
    const auto a = ns.find('['), b = ns.find(']');
    id += "-net" + (a != std::string::npos && b != std::string::npos ? ns.substr(a + 1, b - a - 1) : std::string("ns"));
  }
  for (char& c : id)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') c = '_';
  if (id.size() > 128) id.resize(128);
  return id;
}

// The node's /metrics and its exit, from the agent's typed events (main
// only wires them). Per-rank CPU and memory: dtactor_rank_*{rank} and the
// step reports' usage fields.
decltype(node_agent_options::events) events_to_metrics(metrics& m, std::atomic<zmq_bridge*>& bridge_ptr, std::shared_ptr<rank_usage_tracker> usage,
                                                       caf::actor main_actor) {
  return [&m, &bridge_ptr, usage, main_actor, last_step = std::make_shared<int64_t>(0)](const node_event& e) {
    if (const auto* reg = std::get_if<nev::registered>(&e)) {
      if (auto* b = bridge_ptr.load()) b->set_job_id(reg->job_id);
    } else if (const auto* no = std::get_if<nev::refused>(&e)) {
      caf::anon_send(main_actor, refused_atom::value, no->reason);
    } else if (const auto* up = std::get_if<nev::gave_up>(&e)) {
      caf::anon_send(main_actor, gave_up_atom::value, up->reason);
    } else if (const auto* ack = std::get_if<nev::heartbeat_acked>(&e)) {
      observe_heartbeat_rtt(m, ack->echoed_sent_steady_s);
    } else if (const auto* hello = std::get_if<nev::rank_started>(&e)) {
      usage->track(hello->peer, hello->local_rank, hello->pid);
    } else if (const auto* plan = std::get_if<nev::plan_received>(&e)) {
      m.generation().Set(static_cast<double>(plan->generation));
      m.world_size().Set(plan->world_size);
    } else if (const auto* sp = std::get_if<nev::spares>(&e)) {
      m.spare_ranks().Set(sp->warm);
      usage->track_spares({sp->pids.begin(), sp->pids.end()});
      if (sp->taken > 0) m.spare_takeovers().Increment(sp->taken);
    } else if (const auto* steps = std::get_if<nev::steps_reported>(&e)) {
      const auto& r = steps->report;
      m.samples().Increment(static_cast<double>(r.samples()));
      m.step_duration().Observe(r.step_s());
      m.allreduce_duration().Observe(r.allreduce_s());
      if (r.data_wait_s() > 0) m.data_wait().Observe(r.data_wait_s() / std::max(1, r.steps_covered()));
      m.loss().Set(r.loss());
      if (r.step() > *last_step) {
        *last_step = r.step();
        m.step().Set(static_cast<double>(*last_step));
      }
    }
  };
}

// The cloud's preemption notice: a leave at the next step boundary, as on
// SIGTERM, long before the kill. The watcher's thread sends it to the agent.
std::unique_ptr<preemption_watcher> watch_preemption(const cluster_cli& cli, const node_agent_handle& agent) {
  if (cli.preemption_notice == "off") return nullptr;
  preemption_watch_options wo;
  wo.cloud = cli.preemption_notice;
  wo.endpoints = metadata_endpoints_from([](const char* k) { return std::getenv(k); }, cli.azure_metadata_endpoint);
  wo.poll_interval = std::chrono::milliseconds(cli.preemption_poll_ms);
  return std::make_unique<preemption_watcher>(
      wo, curl_http(),
      [agent](const preemption_notice& n) {
        const double ahead = n.announced_unix_s - n.noticed_unix_s;
        const std::string reason = std::string("preemption notice (") + to_string(n.cloud) + (n.detail.empty() ? "" : " " + n.detail) +
                                   (n.announced.empty() ? "" : " at " + n.announced) + ", " + std::to_string(static_cast<int>(ahead)) + " s ahead)";
        stderr_line("node: " + reason + ": leaving at the next step boundary");
        caf::anon_send(agent, leave_atom::value, reason, std::string(to_string(n.cloud)), n.announced, n.announced_unix_s, n.noticed_unix_s);
      },
      [](const std::string& line) { stderr_line("node: " + line); });
}

// Waits for the agent to quit (shutdown from the coordinator, or a leave),
// leaving on a signal or when the coordinator never answers. Returns the
// exit code so far; a refusal's reason goes to *refusal.
int wait_for_the_agent(caf::scoped_actor& self, const node_agent_handle& agent, const cluster_cli& cli, zmq_bridge& bridge, gpu_metrics& gpu,
                       std::string* refusal, std::string* gave_up, const std::atomic<uint64_t>& coordinator_refusals) {
  int code = 0;
  self->monitor(agent);
  bool done = false, left = false;
  uint64_t ticks = 0;
  const auto started = std::chrono::steady_clock::now();
  std::optional<std::chrono::steady_clock::time_point> signalled_at;
  while (!done) {
    self->receive([&](const caf::down_msg&) { done = true; }, [&](refused_atom, const std::string& why) { *refusal = why; },
                  [&](gave_up_atom, const std::string& why) { *gave_up = why; },
                  caf::after(std::chrono::milliseconds(100)) >> [&] {
                    if (++ticks % 20 == 0) gpu.sample();
                    // Nothing ever heard from the coordinator: a wrong address
                    // or a coordinator that is not running.
                    if (!left && bridge.stats().received == 0 && cli.connect_timeout_s > 0 &&
                        std::chrono::steady_clock::now() - started > std::chrono::seconds(cli.connect_timeout_s)) {
                      if (coordinator_refusals.load() > 0)
                        stderr_line("dtactor: the coordinator at " + cli.coordinator + " refused our key (or we have none) for " +
                                    std::to_string(cli.connect_timeout_s) + " s; every process of the job needs the same --key");
                      else
                        stderr_line("dtactor: no answer from the coordinator at " + cli.coordinator + " after " +
                                    std::to_string(cli.connect_timeout_s) + " s; is it running and reachable?");
                      left = true;
                      code = 1;
                      caf::anon_send(agent, leave_atom::value, std::string("coordinator unreachable"));
                      return;
                    }
                    const int sig = cli.stop_signal ? cli.stop_signal->load() : 0;
                    if (sig != 0 && !left && cli.signal_waits_for_stop_s > 0) {
                      // The whole job is being stopped (Slurm signals every task):
                      // the coordinator's shutdown writes the final checkpoint.
                      const auto now = std::chrono::steady_clock::now();
                      if (!signalled_at) {
                        signalled_at = now;
                        stderr_line("node: signal " + std::to_string(sig) + ": waiting up to " + std::to_string(cli.signal_waits_for_stop_s) +
                                    " s for the coordinator to stop the job after a final checkpoint");
                      }
                      if (now - *signalled_at < std::chrono::seconds(cli.signal_waits_for_stop_s)) return;
                    }
                    if (sig != 0 && !left) {
                      left = true;
                      code = 128 + sig;
                      caf::anon_send(agent, leave_atom::value, std::string("signal ") + std::to_string(sig));
                    }
                  });
  }
  return code;
}

// Who this node is and where its ranks are reached: from the command line
// and the network, before anything starts.
struct node_identity {
  node_id id;             // claimed: no live process on this machine holds it
  std::string advertise;  // the address the ranks' peers reach them at
  file_lock claim;        // the id's claim, held as long as the node runs
};

// Errors are usage errors (exit code 2): a missing or unresolvable
// The first coordinator address whose name resolves: the leader's host may
// be gone (its name with it) while a standby's resolves. Error: none does.
result<tcp_endpoint> first_resolvable(const std::vector<tcp_endpoint>& coords) {
  std::string first_why;
  for (const auto& c : coords) {
    const std::string why = resolution_error(c.host, c.port);
    if (why.empty()) return c;
    if (first_why.empty()) first_why = why;
  }
  return make_error(coords.size() > 1 ? first_why + "; no other --coordinator address resolves either" : first_why);
}

// --coordinator, a bad --nproc-per-node or --node-id, an id in use.
result<node_identity> identify_node(const cluster_cli& cli) {
  if (cli.coordinator.empty()) return make_error("--role node needs --coordinator tcp://HOST:PORT");
  // A coordinator and its standbys (--coordinator A,B): the node speaks
  // to the one holding the newest lease epoch it has heard (zmq_bridge's
  // add_dealer).
  auto coords = parse_tcp_endpoints(cli.coordinator, "--coordinator");
  if (!coords) return coords.err();
  if (cli.nproc_per_node < 1 || cli.nproc_per_node > 1024) return make_error("--nproc-per-node must be 1..1024");
  // Also with --advertise-addr: coordinator names of which none resolves
  // would otherwise end in a connect timeout.
  auto coord = first_resolvable(coords.value());
  if (!coord) return coord.err();
  node_identity who;
  who.advertise = cli.advertise_addr;
  if (who.advertise.empty()) {
    auto towards = local_address_towards(coord->host, coord->port);
    if (!towards) return towards.err();
    who.advertise = towards.value();
  }
  // A --node-id outside the alphabet is refused (the coordinator would refuse it too).
  if (!cli.node_id.empty())
    if (auto why = node_id_problem(cli.node_id); !why.empty()) return make_error("--node-id: " + why);
  auto claim = claim_node_id(cli.node_id.empty() ? default_node_id() : cli.node_id, !cli.node_id.empty(), cli.coordinator);
  if (!claim) return claim.err();
  if (!claim->note.empty()) stderr_line("node: " + claim->note);
  who.id = node_id{claim->id};
  who.claim = std::move(claim->lock);
  return who;
}

// The path of the ipc socket private to this process, which its ranks
// reach it at.
result<std::string> ranks_ipc_path(uint64_t incarnation) {
  std::error_code ec;
  const auto tmp_dir = std::filesystem::temp_directory_path(ec);
  if (ec) {
    const char* t = std::getenv("TMPDIR");
    return make_error("no temporary directory for the ranks' ipc socket (TMPDIR='" + std::string(t ? t : "") + "'): " + ec.message());
  }
  return (tmp_dir / ("dtactor-" + std::to_string(::getpid()) + "-" + std::to_string(incarnation % 100000) + ".ipc")).string();
}

// The agent's options that the command line and the identity decide (its
// events and report annotations are wired by run_node).
node_agent_options agent_options(const cluster_cli& cli, const node_identity& who, uint64_t incarnation) {
  node_agent_options o;
  o.node_id = who.id;
  o.advertise_addr = who.advertise;
  o.hostname = host_name();
  o.nproc = cli.nproc_per_node;
  o.metrics_port = cli.metrics_port;
  o.standby = cli.standby_node;
  o.header.sender = sender_id::of_node(who.id.str()).to_string();
  o.header.incarnation = incarnation;
  o.liveness.heartbeat_interval = std::chrono::milliseconds(100);
  o.liveness.heartbeat_timeout = std::chrono::milliseconds(1000);
  // The job's own heartbeat settings (register_ack's config), read as the
  // coordinator reads them.
  o.liveness_from_config = liveness_options_from_text<config>;
  o.rank_exit_limit_from_config = [](const std::string& toml) -> std::optional<int32_t> {
    auto c = config::parse_toml(toml, "register_ack");
    if (!c) return std::nullopt;
    auto cluster = cluster_settings_of(c.value());
    if (!cluster) return std::nullopt;
    return static_cast<int32_t>(cluster.value().rank_exit_limit);
  };
  if (cli.spares >= 0) o.spares = cli.spares;
  o.spares_from_config = [](const std::string& toml) -> std::optional<int32_t> {
    auto c = config::parse_toml(toml, "register_ack");
    if (!c) return std::nullopt;
    auto cluster = cluster_settings_of(c.value());
    if (!cluster) return std::nullopt;
    return cluster.value().spare_ranks;
  };
  // Never blocks the agent (a stderr nobody reads would stop its heartbeats).
  o.log = [](const std::string& line) { stderr_line("node: " + printable(line, 0)); };
  return o;
}

// Starts this binary as `--role rank` for each local rank, with the fault
// injection of --fail-at-step for local rank 0.
std::shared_ptr<rank_launcher> make_launcher(const cluster_cli& cli, const node_identity& who, const std::string& ranks_endpoint) {
  return std::make_shared<rank_launcher>(
      std::vector<std::string>{self_executable(), "--role", "rank", "--node-endpoint", ranks_endpoint, "--node-id", who.id.str(), "--coordinator",
                               cli.coordinator, "--advertise-addr", who.advertise, "--nproc-per-node", std::to_string(cli.nproc_per_node),
                               "--threads-per-rank", std::to_string(cli.threads_per_rank)},
      cli.fail_at_step >= 0 ? std::vector<std::string>{"--fail-at-step", std::to_string(cli.fail_at_step), "--fail-mode", to_string(cli.fail_mode)}
                            : std::vector<std::string>{},
      cli.fail_mode == fault_mode::rank_oom);
}

// The bridge, delivering every inbound frame to `agent`. With a key both
// links are CURVE: the ranks' ROUTER admits the job's client key only, and
// the DEALER to the coordinator pins the job's server key, so a plan (and
// the module it names) reaches this node only from a holder of the key,
// never from a stranger at that address. A refused handshake to the
// coordinator is a key problem, not a full queue or an unreachable
// coordinator: said so (at most once a second after the first few) and
// counted in `coordinator_refusals`. A connection to a coordinator address
// that comes up is told to the agent (it registers there at once). The
// coordinator's address is dialled every 100-200 ms while nobody listens
// there, without backing off (as each of several addresses is): one
// address in front of a coordinator and its standby (a floating address, a
// Service) gets the new leader's port a TTL after the loss, and a backoff
// grown meanwhile would find it seconds later.
// The agent is spawned once the bridge has bound the relay listener (its
// endpoint is in the agent's options): `agent` is set then, and what
// arrives before is dropped.
struct agent_slot {
  std::atomic<bool> set{false};
  node_agent_handle handle;
};

std::unique_ptr<zmq_bridge> make_bridge(const cluster_cli& cli, std::shared_ptr<agent_slot> agent, std::shared_ptr<std::atomic<uint64_t>> coordinator_refusals) {
  zmq_bridge_options bo;
  bo.key = cli.key;
  bo.reconnect_ivl_max_ms = bo.group_reconnect_ivl_max_ms;
  auto refusals = std::make_shared<log_limiter>(nullptr, log_limiter::options{1, std::chrono::seconds(5)});
  return std::make_unique<zmq_bridge>(
      bo,
      [agent](const std::string& link, const std::string& peer, pb::envelope env) {
        if (agent->set.load(std::memory_order_acquire)) caf::anon_send(agent->handle, inbound{link, peer, std::move(env)});
      },
      nullptr,
      [refusals, coordinator_refusals, coordinator = cli.coordinator](const std::string& link, bool router, handshake_failure why, const std::string&) {
        if (router || link != links::coordinator) return;
        coordinator_refusals->fetch_add(1);
        refusals->log(to_string(why), "dtactor: the coordinator at " + coordinator + " refused our key (or we have none): handshake failed (" +
                                          to_string(why) + "); give every process of the job the same --key (or none to all)");
      },
      nullptr,
      [agent](const std::string& link, const std::string& endpoint) {
        if (link == links::coordinator && agent->set.load(std::memory_order_acquire)) caf::anon_send(agent->handle, reachable_atom::value, endpoint);
      });
}

// The listener for the heartbeats of the node's relay group, should the
// coordinator make it their relay (actors/relays.hpp): a free port on every
// interface, named at the advertised address.
result<std::string> open_relay_listener(zmq_bridge& bridge, const node_identity& who) {
  auto r = bridge.add_router(links::relay_in, "tcp://0.0.0.0:*");
  if (!r) return make_error("cannot open a heartbeat relay listener: " + r.message());
  return connectable_endpoint(r.value(), who.advertise);
}

// Opens links::relay to `endpoint`, closing the one open (empty: only that).
std::function<void(const std::string&)> relay_dialler(std::atomic<zmq_bridge*>& bridge, const node_identity& who, uint64_t incarnation) {
  const std::string routing = sender_id::of_node(who.id.str()).to_string() + "/" + std::to_string(incarnation);
  return [&bridge, routing](const std::string& endpoint) {
    auto* b = bridge.load();
    if (!b) return;
    (void)b->remove_link(links::relay);
    if (endpoint.empty()) return;
    if (auto r = b->add_dealer(links::relay, endpoint, routing); !r) stderr_line("node: cannot dial heartbeat relay " + printable(endpoint) + ": " + r.message());
  };
}

// The bridge's two links: the ranks' ROUTER on `ranks_endpoint`, and the
// DEALER to the coordinator, its identity the node's sender id and
// incarnation. Error: one line naming the address.
status open_links(zmq_bridge& bridge, const cluster_cli& cli, const node_identity& who, const std::string& ranks_endpoint, uint64_t incarnation) {
  if (auto r = bridge.add_router(links::ranks, ranks_endpoint); !r) return make_error("cannot open " + ranks_endpoint + ": " + r.message());
  if (auto r = bridge.add_dealer(links::coordinator, cli.coordinator, sender_id::of_node(who.id.str()).to_string() + "/" + std::to_string(incarnation)); !r)
    return make_error("cannot connect to " + cli.coordinator + ": " + r.message());
  stderr_line("node: '" + who.id.str() + "' (" + who.advertise + ") connecting to " + cli.coordinator + " with " + std::to_string(cli.nproc_per_node) +
              " rank(s)");
  return {};
}

// The node's exit code from how the wait ended: a refusal or an agent that
// gave every rank up is 1 (said on stderr); a signal that arrived while the
// job was ending (the coordinator's stop can be quicker than the wait's
// tick) still names how the node ended.
int node_exit_code(int code, const std::string& refusal, const std::string& gave_up, const node_id& id, const cluster_cli& cli) {
  if (!refusal.empty()) {
    stderr_line("dtactor: refused by the coordinator: " + printable(refusal, printable_max_detail_chars));
    code = 1;
  }
  if (!gave_up.empty()) {
    stderr_line("dtactor: node '" + id.str() + "' left the job, every rank given up: " + gave_up);
    code = 1;
  }
  if (code == 0 && cli.stop_signal && cli.stop_signal->load() != 0) code = 128 + cli.stop_signal->load();
  return code;
}

}  // namespace

int run_node(const cluster_cli& cli) {
  // Lines never block (an unread stderr drops them, counted, rather than
  // stop the agent's heartbeats); flushed for at most 2 s at the end.
  stderr_log_scope async_stderr(async_log_options{4096, "dtactor node"});
  choose_blas_kernels_for_children();  // before any rank starts: none loads LibTorch twice
  auto who = identify_node(cli);
  if (!who) return fail(who.message(), 2);
  const node_id& id = who->id;
  const uint64_t incarnation = wire::new_incarnation();

  metrics m;  // the job label is not known before registration
  if (cli.metrics_port > 0)
    if (auto st = m.serve(cli.metrics_port, cli.metrics_addr); !st) return fail(st.message());
  // GPU memory and utilisation when the NVIDIA driver's NVML is present.
  gpu_metrics gpu(m.registry());
  if (gpu.available()) stderr_line("node: NVML: " + std::to_string(gpu.devices()) + " GPU(s) exported on /metrics");
  auto ipc_path = ranks_ipc_path(incarnation);
  if (!ipc_path) return fail(ipc_path.message());
  const std::string ranks_endpoint = "ipc://" + ipc_path.value();

  caf::actor_system_config sys_cfg;
  configure_caf(sys_cfg, 2);
  caf::actor_system sys{sys_cfg};
  // Actors send through this pointer; it is set once the bridge exists and
  // cleared before the bridge stops (actors may still be running then).
  std::unique_ptr<zmq_bridge> bridge;
  std::atomic<zmq_bridge*> bridge_ptr{nullptr};
  outbound out = [&](const std::string& link, const std::string& peer, pb::envelope env) {
    if (auto* b = bridge_ptr.load()) (void)b->send(link, peer, env);
  };
  // The process's own actor: the agent's refusal reaches it as a message,
  // and it waits for the agent to quit.
  caf::scoped_actor self{sys};

  node_agent_options o = agent_options(cli, who.value(), incarnation);
  auto launcher = make_launcher(cli, who.value(), ranks_endpoint);
  // The node's /metrics and its exit, from the agent's typed events. Per-rank
  // CPU and memory: dtactor_rank_*{rank} and the step reports' usage fields.
  auto usage = std::make_shared<rank_usage_tracker>(m);
  m.on_scrape([usage] { usage->sample_all(); });
  o.annotate_report = [usage, id](const std::string& peer, pb::step_report& r) { add_usage(r, usage->sample(peer), id); };
  o.events = events_to_metrics(m, bridge_ptr, usage, caf::actor_cast<caf::actor>(self));
  auto coordinator_refusals = std::make_shared<std::atomic<uint64_t>>(0);  // shared: the bridge thread may outlive this scope's end
  auto slot = std::make_shared<agent_slot>();
  bridge = make_bridge(cli, slot, coordinator_refusals);
  bridge_ptr.store(bridge.get());
  auto relay_endpoint = open_relay_listener(*bridge, who.value());
  if (!relay_endpoint) return fail(relay_endpoint.message());
  o.relay_endpoint = relay_endpoint.value();
  o.dial_relay = relay_dialler(bridge_ptr, who.value(), incarnation);
  auto agent = sys.spawn(node_agent, o, out, launcher);
  launcher->attach(agent);
  slot->handle = agent;
  slot->set.store(true, std::memory_order_release);
  if (auto st = open_links(*bridge, cli, who.value(), ranks_endpoint, incarnation); !st) return fail(st.message());
  caf::anon_send(agent, start_atom::value);

  std::unique_ptr<preemption_watcher> watcher = watch_preemption(cli, agent);
  std::string refusal, gave_up;
  const int waited = wait_for_the_agent(self, agent, cli, *bridge, gpu, &refusal, &gave_up, *coordinator_refusals);
  watcher.reset();
  const int code = node_exit_code(waited, refusal, gave_up, id, cli);
  launcher->stop();
  // What the agent sent last (its ranks' exits, a leave) goes out first.
  bridge->stop(std::chrono::seconds(1));
  bridge_ptr.store(nullptr);
  std::error_code ec;
  std::filesystem::remove(ipc_path.value(), ec);
  return code;
}

}  // namespace dtactor
