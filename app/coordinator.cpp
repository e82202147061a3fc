// The coordinator process, as wiring: the membership, job and checkpoint
// writer actors (actors/), the sink their events go to (journal, metrics,
// console), the ZeroMQ bridge to the nodes and the c10d store ranks meet at.
// No LibTorch here.
#include <caf/all.hpp>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <unistd.h>

#include "actors/membership_actor.hpp"
#include "actors/job_actor.hpp"
#include "actors/messages.hpp"
#include "app/caf_setup.hpp"
#include "app/cluster.hpp"
#include "app/cluster_util.hpp"
#include "app/coordinator_lease.hpp"
#include "app/coordinator_sink.hpp"
#include "base/async_log.hpp"
#include "base/printable.hpp"
#include "monitoring/journal.hpp"
#include "monitoring/metrics.hpp"
#include "monitoring/resources.hpp"
#include "monitoring/run_observer.hpp"
#include "monitoring/service_discovery.hpp"
#include "monitoring/status_board.hpp"
#include "storage/checkpoint_store.hpp"
#include "job/shipped_file.hpp"
#include "storage/fs.hpp"
#include "job/job_config.hpp"
#include "job/modes.hpp"
#include "job/settings.hpp"
#include "job/resume_point.hpp"
#include "net/rendezvous_store.hpp"
#include "data/sample_log.hpp"
#include "net/wire.hpp"
#include "net/zmq_bridge.hpp"

namespace dtactor {

namespace {

bool is_loopback_host(const std::string& host) {
  return host == "localhost" || host == "::1" || host == "[::1]" || host.rfind("127.", 0) == 0;
}

lease_settings lease_settings_of(const cluster_cli& cli, const job_settings& job) {
  lease_settings s;
  s.where = cli.lease;
  s.s3_endpoint = job.checkpoint.s3_endpoint;
  s.standby = cli.standby;
  s.ttl = std::chrono::milliseconds(cli.lease_ttl_ms);
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  s.holder = std::string(host) + ":" + std::to_string(::getpid());
  s.address = cli.listen;
  s.stop_signal = cli.stop_signal;
  return s;
}

int fail(const std::string& msg, int code = 1) {
  stderr_line("dtactor: " + msg);
  return code;
}

// The job's config and its settings, read once.
struct checked_config {
  config cfg;
  job_settings settings;
};

result<checked_config> checked_setup(const cluster_cli& cli, int& code) {
  code = 2;
  auto loaded = config::load(cli.config_path, cli.overrides);
  if (!loaded) return loaded.err();
  absolutize_data_paths(loaded.value());
  const config& cfg = loaded.value();
  auto settings = job_settings_of(cfg);
  if (!settings) return settings.err();
  const job_settings& s = settings.value();
  // Every plan carries the config over the control plane (net/wire.hpp).
  if (const auto n = cfg.to_toml().size(); n > max_config_bytes)
    return make_error("the effective config is " + std::to_string(n) + " bytes, over the limit of " + std::to_string(max_config_bytes) +
                      " that plans carry to the nodes; shorten the values set with --set");
  if (auto why = validate(liveness_options_from(s.cluster)); !why.empty()) return make_error(why);
  if (auto why = validate(membership_options_from(s.cluster)); !why.empty()) return make_error(why);
  auto listen = parse_tcp_endpoint(cli.listen, "--listen", true);
  if (!listen) return listen.err();
  if (listen.value().port == 0 && !cli.lease.empty())
    return make_error("--lease needs a fixed --listen port: the nodes name it in --coordinator");
  if (cli.standby && cli.lease.empty()) return make_error("--standby waits for the job's lease: name it with --lease");
  if (!cli.lease.empty())
    if (auto why = lease_place_problem(cli.lease); !why.empty()) return make_error(why);
  code = 1;
  if (auto st = ensure_writable_dir(cli.run_dir); !st) return make_error("run directory: " + st.message());
  if (auto st = check_sample_log_dir(s.data.sample_log); !st) return st.err();
  // (A standby shares the holder's run directory: it takes the lock once
  // it holds the job's lease.)
  if (auto who = file_lock::holder(run_dir_lock_path(cli.run_dir)); !who.empty() && !cli.standby)
    return make_error(run_dir_busy_message(cli.run_dir, make_error(who, errc::busy)));
  return checked_config{std::move(loaded.value()), std::move(settings.value())};
}

// A torchscript job's module goes with the job: into the store once, its
// name and digest to every node, so a node needs no copy of its own. (A
// coordinator without the file leaves it to the nodes' own copies.)
result<shipped_file> ship_module(const model_settings& model, checkpoint_store& store, journal& jn) {
  shipped_file module;
  if (model.builtin != builtin_model::torchscript || model.file.empty() || !std::filesystem::exists(model.file)) return module;
  auto shipped = ship_file(store.objects(), model.file, "module-", ".pt");
  if (!shipped) return make_error("cannot ship model.file with the job: " + shipped.message());
  module = shipped.value();
  const std::string line = (module.uploaded ? "shipped model.file to " : "model.file is already in ") + store.location() + " as " + module.object;
  stderr_line("coordinator: " + line);
  ev::module_shipped e;
  e.file = model.file;
  e.object = module.object;
  e.digest = module.digest;
  e.uploaded = module.uploaded;
  jn.write(e);
  return module;
}

// Resume: the newest committed checkpoint whose parts check out (read
// whole, in chunks: the coordinator never holds model bytes); -1 when none
// (or --no-resume). Global rank 0 of the first generation loads it from the
// store and hands it on. An error sets *code (2: a checkpoint of another job).
result<int64_t> resume_step_of(const cluster_cli& cli, const checked_config& job, checkpoint_store& store, journal& jn, int* code) {
  *code = 1;
  resume_reports reports;
  reports.log = [](const std::string& line) { stderr_line("dtactor: " + line); };
  reports.journal = [&jn](const ev::journal_event& e) { jn.write(e); };
  auto found = find_resume_point(resume_request{!cli.no_resume, ""}, store, reports);
  if (!found) return found.err();
  if (!found.value()) return int64_t{-1};
  const std::string& path = found.value()->path;
  const int64_t step = found.value()->meta.step();
  // A standby takes the lease over also when its holder ended on its own;
  // after the job's end that leaves nothing to lead, and waiting for nodes
  // that are gone would keep its Slurm step or pod running forever.
  if (cli.standby && step >= job.settings.train.max_steps) {
    *code = 0;
    return make_error("coordinator: the job is finished (" + store.location() + " holds its checkpoint at train.max_steps, step " +
                      std::to_string(step) + "): nothing for a standby to take over");
  }
  if (auto st = check_checkpoint_compatible(found.value()->meta, job.settings.model, job.settings.train, job.cfg.digest({"model."}), path); !st) {
    *code = 2;
    return st.err();
  }
  // checkpoint_restored is journaled when a rank reports it loaded it.
  ev::checkpoint_found e;
  e.step = step;
  e.path = path;
  jn.write(e);
  if (step >= job.settings.train.max_steps)
    stderr_line("coordinator: " + store.location() + " already holds a checkpoint at step " + std::to_string(step) +
                ", at train.max_steps: nothing left to train (--no-resume starts over)");
  else
    stderr_line("coordinator: resuming from step " + std::to_string(step) + " (" + path + "; --no-resume starts over)");
  return step;
}

// Earlier runs' generations (fenced commits, audit records) stay older than
// this run's: its first generation is numbered above the newest of them.
result<uint64_t> generations_after_of(const std::string& sample_log, checkpoint_store& store) {
  auto before = generations_before(store, sample_log);
  if (!before) return before.err();
  const uint64_t after = before.value();
  if (after > 0)
    stderr_line("coordinator: generations are numbered from " + std::to_string(after + 1) + " on (earlier runs of this checkpoint store" +
                (sample_log.empty() ? "" : " and sample log") + " reached " + std::to_string(after) + ")");
  return after;
}

// The main thread only waits for the job actor to say the job ended, and
// passes a stop signal on to it. Returns the exit code (128 + the signal
// when one stopped the job).
int wait_for_the_job(caf::actor_system& sys, const job_handle& job, const cluster_cli& cli) {
  int code = -1;
  int signalled = 0;
  caf::scoped_actor self{sys};
  self->send(job, wait_atom::value);
  while (code < 0) {
    self->receive([&](done_atom, int c) { code = c; },
                  caf::after(std::chrono::milliseconds(100)) >> [&] {
                    const int sig = cli.stop_signal ? cli.stop_signal->load() : 0;
                    if (sig == 0 || signalled != 0) return;
                    signalled = sig;
                    // Ranks stop at a step boundary they agree on after a
                    // final checkpoint; nodes leaving now (the same signal
                    // reached them) are part of the stop: no new generation.
                    self->send(job, stop_atom::value, "coordinator stopped by signal " + std::to_string(sig));
                  });
  }
  return signalled != 0 ? 128 + signalled : code;
}

}  // namespace

setup_check check_coordinator_setup(const cluster_cli& cli) {
  setup_check c;
  auto r = checked_setup(cli, c.code);
  if (r) c.code = 0;
  else c.message = r.message();
  return c;
}

namespace {

// Where the job starts, read from its checkpoint store before anything
// serves.
struct job_start {
  checkpoint_store store;
  shipped_file module;
  int64_t resume_step = -1;
  uint64_t generations_after = 0;
};

// Opens the job's checkpoint store, ships its module and finds where it
// resumes and how its generations are numbered. An error sets *code (2: a
// store of another job, a checkpoint of another job).
result<job_start> open_job_start(const cluster_cli& cli, const checked_config& job, journal& jn, int* code) {
  *code = 1;
  const checkpoint_settings& ckpt = job.settings.checkpoint;
  auto opened = checkpoint_store::open(checkpoint_dir_of(ckpt, cli.run_dir), checkpoint_policy_of(ckpt), default_fs_env(), ckpt.s3_endpoint);
  if (!opened) return opened.err();
  checkpoint_store store = std::move(opened.value());
  if (auto st = store.check_no_foreign_manifests(); !st) {
    *code = 2;
    return st.err();
  }
  auto shipped = ship_module(job.settings.model, store, jn);
  if (!shipped) return shipped.err();
  auto resumed = resume_step_of(cli, job, store, jn, code);
  if (!resumed) return resumed.err();
  auto after = generations_after_of(job.settings.data.sample_log, store);
  if (!after) return after.err();
  return job_start{std::move(store), shipped.value(), resumed.value(), after.value()};
}

// What the coordinator holds for the whole run, set up before it serves.
struct coordinator_run {
  const cluster_cli& cli;
  const config& cfg;
  const job_settings& settings;
  tcp_endpoint listen;
  std::string config_text;
  std::string job_id;
  journal& jn;
  run_observer& obs;
  job_start& start;
  uint64_t epoch = 0;  // the job's lease epoch this coordinator holds (0: no --lease)
  coordinator_lease* lease = nullptr;  // with --lease: whether it may still decide
};

// The address ranks reach this host at: --advertise-addr, else the
// --listen host (`wildcard` when it listens on every interface).
std::string advertised_host(const coordinator_run& run, const std::string& wildcard) {
  if (!run.cli.advertise_addr.empty()) return run.cli.advertise_addr;
  return run.listen.host == "0.0.0.0" || run.listen.host == "*" ? wildcard : run.listen.host;
}

// /metrics, Prometheus' node discovery (GET /sd, http_sd_configs; see
// monitoring/service_discovery.hpp) and the status page (docs/monitoring.md:
// on the same port, as unauthenticated as /metrics).
status serve_pages(const coordinator_run& run, metrics& m, sd_targets& sd, status_board& board) {
  m.checkpoint_last_timestamp().SetToCurrentTime();  // "checkpoint too old" counts from the start
  m.max_steps().Set(static_cast<double>(run.settings.train.max_steps));
  m.add_route("/sd", "application/json", [&sd] { return sd.json(); });
  m.add_route("/", "text/html; charset=utf-8", [] { return status_board::page(); });
  m.add_route("/status.json", "application/json", [&board] { return board.json(unix_time_now()); });
  if (run.cli.metrics_free_port) {
    if (auto st = m.serve_on_free_port(run.cli.metrics_addr); !st) return st;
  } else if (run.cli.metrics_port > 0) {
    if (auto st = m.serve(run.cli.metrics_port, run.cli.metrics_addr); !st) return st;
  }
  sd.set_coordinator(advertised_host(run, host_name()), m.port());
  return {};
}

// The membership actor's options: the config's, and what the start found.
coordinator_options membership_options_of(const coordinator_run& run, int store_port) {
  coordinator_options copts = coordinator_options_from(run.settings.cluster, run.config_text);
  copts.store_host = advertised_host(run, "");
  copts.store_port = store_port;
  // What a plan may fall back to when a rank refuses the one resumed from.
  std::vector<int64_t> stored;
  for (const auto& c : run.start.store.list()) stored.push_back(c.step);
  copts.checkpoints = ledger_at_start(stored, run.start.resume_step);
  copts.membership.generations_after = run.start.generations_after;
  copts.checkpoint_store = run.start.store.location();
  copts.module_object = run.start.module.object;
  copts.module_digest = run.start.module.digest;
  copts.data_digests = data_file_digests(run.cfg);
  if (run.lease && run.cli.standby) {
    // One of a pair: cut off from every node, it lets the lease go to the
    // standby they can reach (docs/fault_handling.md).
    copts.orphaned = [lease = run.lease](const std::string& why) { lease->give_up(why); };
    copts.orphan_after = 2 * copts.liveness.heartbeat_timeout;
  }
  return copts;
}

// The coordinator's bridge: what arrives, and nodes' closed connections, go
// to `members`; dropped frames and strangers refused in the handshake (the
// bridge logs them, rate-limited, with their address) are counted.
std::unique_ptr<zmq_bridge> make_bridge(const coordinator_run& run, const membership_handle& members, metrics& m) {
  zmq_bridge_options bo;
  bo.job_id = run.job_id;
  bo.key = run.cli.key;
  // No ZMTP pings of the coordinator's own on the nodes' link (it answers
  // theirs). libzmq 4.3 cancels an answered ping's timer by a linear search
  // through every connection's timers: with thousands of nodes that search
  // was a fifth of its I/O thread. What the pings cleared, a connection a
  // cut left half open on this side, needs no ping: the node's own ZMTP
  // timeout closes its side and it dials again under its routing id, which
  // takes the stale pipe over (ROUTER_HANDOVER); a plan sent into the stale
  // pipe is sent again when the node's heartbeats show an older generation;
  // TCP keepalive tears an idle leftover down.
  bo.zmtp_heartbeat_ivl_ms = 0;
  return std::make_unique<zmq_bridge>(
      bo, [members](const std::string& link, const std::string& peer, pb::envelope env) { caf::anon_send(members, inbound{link, peer, std::move(env)}); },
      [&m](const std::string&, const std::string&, wire::drop_kind k) { m.wire_dropped_frames(wire::to_string(k)).Increment(); },
      [&m](const std::string&, bool, handshake_failure why, const std::string&) { m.refused_handshakes(to_string(why)).Increment(); },
      [members](const std::string&, const std::string& peer) { caf::anon_send(members, closed_atom::value, peer); });
}

// Nodes may register now: the journal and the console say where.
void announce(const coordinator_run& run, const std::string& bound, int store_port) {
  if (!run.cli.key && !is_loopback_host(run.listen.host))
    stderr_line("dtactor: warning: no job key: anyone who can reach " + bound +
                " can join, steer or stop this job (dtactor keygen, then --key on every process; docs/security.md)");
  ev::coordinator_started started;
  started.listen = bound;
  started.job_id = run.job_id;
  started.store_port = store_port;
  started.metrics_port = run.cli.metrics_port;
  started.resume_step = run.start.resume_step;
  run.jn.write(started);
  stderr_line("coordinator: job " + run.job_id + " listening on " + bound + ", waiting for " + std::to_string(run.settings.cluster.min_nodes) +
              " node(s)");
}

// For `dtactor local`, which started this process on free ports: one line,
// "ENDPOINT STATUS_PORT", then the descriptor is closed (its reader sees
// end-of-file instead when this process ends before it listens).
void report_ports(int fd, const std::string& bound, int status_port) {
  if (fd < 0) return;
  const std::string line = bound + " " + std::to_string(status_port) + "\n";
  if (::write(fd, line.data(), line.size()) != static_cast<ssize_t>(line.size()))
    stderr_line(std::string("dtactor: cannot report the bound ports to dtactor local: ") + std::strerror(errno));
  ::close(fd);
}

// The actors and the bridge to the nodes, until the job ends. Returns the
// exit code.
// The store's limits follow the largest world planned
// (rendezvous_limits_for), and its eviction keeps the newest planned (or
// adopted) generation's keys.
void follow_plans(rendezvous_store& rendezvous, const ev::event& e) {
  if (const auto* g = std::get_if<ev::generation_started>(&e)) {
    rendezvous.expect_world(g->world_size);
    rendezvous.expect_generation(g->generation);
  } else if (const auto* a = std::get_if<ev::generation_adopted>(&e)) {
    rendezvous.expect_world(a->world_size);
    rendezvous.expect_generation(a->generation);
  }
}

// What every message of this coordinator says of it: the job, the
// sender, this process's incarnation, and the lease's epoch (so that nodes
// drop a deposed coordinator's).
envelope_header header_of(const coordinator_run& run) {
  envelope_header header;
  header.job_id = run.job_id;
  header.sender = sender_id::coordinator().to_string();
  header.incarnation = wire::new_incarnation();
  header.epoch = run.epoch;
  return header;
}

// The actors' events to the rendezvous store's plans, the status page and
// the sink. Under a lease, an event waits while the last renewal is over
// half the TTL old: a leader stopped or cut off writes nothing more of the
// job (its journal, its plans, its metrics) once it runs again, since a
// standby may lead by now and its renewer ends it; a leader merely slow
// to renew (a loaded machine) goes on once it has.
event_sink events_to(coordinator_sink& sink, status_board& board, rendezvous_store& rendezvous, const coordinator_lease* lease) {
  return [&sink, &board, &rendezvous, lease](const ev::event& e) {
    if (lease) lease->wait_until_held();
    follow_plans(rendezvous, e);
    board.on(e, unix_time_now());
    sink(e);
  };
}

int run_actors(const coordinator_run& run, metrics& m, sd_targets& sd, status_board& board, rendezvous_store& rendezvous, int store_port) {
  caf::actor_system_config sys_cfg;
  configure_caf(sys_cfg, 2);
  caf::actor_system sys{sys_cfg};

  const envelope_header header = header_of(run);
  // Everything the actors report goes through this one sink.
  coordinator_sink sink(run.jn, m, run.obs, sd);
  const event_sink events = events_to(sink, board, rendezvous, run.lease);
  // Through the progress line's owner: a log line never runs into the live line.
  // Peer text in a line is escaped where it is put in; the whole line once
  // more, so that no byte from outside ever breaks or steers a log line.
  run_observer& obs = run.obs;
  const log_fn log = [&obs](const std::string& line) { obs.log("coordinator: " + printable(line, 0)); };

  // Actors send through this pointer; it is set once the bridge exists and
  // cleared before the bridge stops (actors may still be running then).
  std::unique_ptr<zmq_bridge> bridge;
  std::atomic<zmq_bridge*> bridge_ptr{nullptr};
  // Under a lease, each envelope carries the epoch held when it leaves: a
  // lapsed lease taken back holds a newer one (coordinator_lease.hpp).
  outbound out = [&bridge_ptr, lease = run.lease](const std::string& link, const std::string& peer, pb::envelope env) {
    if (lease) env.set_epoch(lease->epoch());
    if (auto* b = bridge_ptr.load()) (void)b->send(link, peer, env);
  };

  // The committer blocks on the store: it gets a thread of its own. It
  // writes manifests only; the ranks write the state.
  checkpoint_writer_options wopts;
  wopts.log = log;
  wopts.events = events;
  wopts.commit = commit_to(run.start.store);

  coordinator_options copts = membership_options_of(run, store_port);
  copts.header = header;
  copts.log = log;
  copts.events = events;

  job_options jopts = job_options_from(run.settings.train);
  jopts.header = header;
  jopts.initial_step = std::max<int64_t>(0, run.start.resume_step);
  jopts.log = log;
  jopts.events = events;

  auto writer = sys.spawn<caf::detached>(checkpoint_writer, wopts);
  auto job = sys.spawn(job_actor, jopts, writer);
  auto members = sys.spawn(membership_actor, copts, out, job);
  caf::anon_send(job, members_atom::value, members);
  caf::anon_send(writer, members_atom::value, members);
  auto stop_actors = [&] {
    caf::anon_send_exit(members, caf::exit_reason::user_shutdown);
    caf::anon_send_exit(job, caf::exit_reason::user_shutdown);
    caf::anon_send_exit(writer, caf::exit_reason::user_shutdown);
  };

  bridge = make_bridge(run, members, m);
  bridge_ptr.store(bridge.get());
  auto bound = bridge->add_router(links::nodes, run.cli.listen);
  if (!bound) {
    stop_actors();
    return fail("cannot listen on " + run.cli.listen + ": " + bound.message());
  }
  announce(run, bound.value(), store_port);
  report_ports(run.cli.announce_fd, bound.value(), m.port());

  const int code = wait_for_the_job(sys, job, run.cli);
  // The shutdowns are queued in the bridge: they go out before it closes.
  bridge->stop(std::chrono::seconds(2));
  bridge_ptr.store(nullptr);
  stop_actors();
  return code;
}

// The pages, the c10d store ranks build their communicators through (ranks
// of a generation may arrive seconds apart; it listens where --listen
// does), then the actors. Returns the exit code.
int serve_job(const coordinator_run& run) {
  const int64_t max_steps = run.settings.train.max_steps;
  metrics m(run.job_id);
  sd_targets sd(run.job_id);
  status_board board(status_options{run.job_id, max_steps, run.cli.key != nullptr});
  if (auto st = serve_pages(run, m, sd, board); !st) return fail(st.message());

  // A port the system picks as it binds: nothing can take it in between.
  auto rendezvous = rendezvous_store::start(
      0, std::max<std::chrono::milliseconds>(run.settings.cluster.collective_timeout, std::chrono::seconds(60)), run.cli.key, run.listen.host);
  if (!rendezvous) return fail(rendezvous.message());
  return run_actors(run, m, sd, board, *rendezvous.value(), rendezvous.value()->port());
}

}  // namespace

int run_coordinator(const cluster_cli& cli) {
  // Every console line of this process (its own, the actors' through the
  // progress line, the bridge's, the final result on stdout) goes through
  // one writer thread: a stdout or stderr nobody reads (a stopped terminal,
  // a slow `| tee`, ssh) drops lines, counted, instead of blocking the
  // actors that answer the nodes' heartbeats. Flushed for at most 2 s at the end.
  stderr_log_scope async_output(async_log_options{4096, "dtactor coordinator"});
  int setup_code = 0;
  auto loaded = checked_setup(cli, setup_code);
  if (!loaded) return fail(loaded.message(), setup_code);
  const checked_config job = std::move(loaded.value());
  const config& cfg = job.cfg;
  auto listen = parse_tcp_endpoint(cli.listen, "--listen", true);
  // The job's lease first: a standby waits here, before it touches the
  // run directory or the port.
  std::unique_ptr<coordinator_lease> lease;
  if (!cli.lease.empty()) {
    int lease_code = 2;
    auto taken = coordinator_lease::take(lease_settings_of(cli, job.settings), [](const std::string& l) { stderr_line("dtactor: coordinator: " + l); }, &lease_code);
    if (!taken) return fail(taken.message(), lease_code);
    lease = std::move(taken.value());
  }
  // One writer per run directory: a second coordinator (or `dtactor train`)
  // would interleave its journal and checkpoints with this one's. A crashed
  // holder's lock is free again. Under a lease, the lease is what keeps a
  // second leader out (its epoch fences every decision at the nodes): a
  // deposed leader that is alive but stopped or cut off still holds the
  // lock, and the new leader goes on without it.
  auto run_lock = file_lock::try_acquire(run_dir_lock_path(cli.run_dir), "dtactor coordinator on " + cli.listen);
  if (!run_lock && !(lease && run_lock.code() == errc::busy)) return fail(run_dir_busy_message(cli.run_dir, run_lock.err()));
  if (!run_lock)
    stderr_line("dtactor: coordinator: the run directory's lock is still held by " + printable(run_lock.message(), 200) +
                ", a deposed leader: going on under the lease (epoch " + std::to_string(lease->epoch()) + "), which fences it");
  journal jn;
  if (auto st = jn.open(cli.run_dir + "/journal.jsonl"); !st) return fail(st.message());
  const std::string config_text = cfg.to_toml();
  if (auto st = write_file_atomic(cli.run_dir + "/config.toml", {config_text}); !st) return fail(st.message());
  run_observer obs(run_observer::options{cli.run_dir, job.settings.train.max_steps, progress::stderr_is_terminal(), cli.run_dir + "/train.log"});

  int start_code = 1;
  auto start = open_job_start(cli, job, jn, &start_code);
  if (!start) return fail(start.message(), start_code);
  return serve_job(
      coordinator_run{cli, cfg, job.settings, listen.value(), config_text, job_id_for(cli.run_dir), jn, obs, start.value(), lease ? lease->epoch() : 0, lease.get()});
}

}  // namespace dtactor
