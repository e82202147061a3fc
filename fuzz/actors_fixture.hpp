#pragma once
// The coordinator, node and rank actors as the fuzz targets (coordinator,
// node_agent, rank_actor) and the seed writer (make_seeds.cpp) build them:
// one set of options, so that the seeds recorded from an in-process run
// replay against the same actors. CAF's test coordinator runs them
// (tests/actor_test_util.hpp); no LibTorch, no sockets.
#include <memory>
#include <optional>
#include <string>

#include "actors/job_actor.hpp"
#include "actors/liveness.hpp"
#include "actors/membership_actor.hpp"
#include "actors/node_agent.hpp"
#include "actors/rank_actor.hpp"
#include "app/coordinator_sink.hpp"
#include "dtactor/config.hpp"
#include "fuzz/fuzz_util.hpp"
#include "fuzz/memory_store.hpp"
#include "storage/checkpoint_store.hpp"
#include "tests/actor_test_util.hpp"

namespace dtactor::fuzz {

inline constexpr const char* job_id = "job-fuzz";
inline constexpr int32_t ranks_per_node = 2;

// The job: two nodes to start, a few steps, an evaluation and a checkpoint
// on the way.
inline const config& job_config() {
  static const config cfg = [] {
    auto c = config::parse_toml(
        "[train]\nmax_steps = 12\n[eval]\nevery_steps = 6\n[checkpoint]\nevery_steps = 6\n[cluster]\nmin_nodes = 2\nmax_nodes = 4\n",
        "fuzz");
    if (!c) fail(c.message().c_str());
    return c.value();
  }();
  return cfg;
}

inline envelope_header coordinator_header() {
  envelope_header h;
  h.job_id = job_id;
  h.sender = sender_id::coordinator().to_string();
  h.incarnation = 77;
  return h;
}

// The coordinator's three actors, its event sink (journal, metrics,
// progress, service discovery) and a checkpoint store in memory. Frames
// from a node go to `members` as inbound{links::nodes, peer, env}.
struct coordinator_actors {
  test_support::caf_fixture& fx;
  std::shared_ptr<memory_store> objects = std::make_shared<memory_store>();
  checkpoint_store store = checkpoint_store::over(objects, checkpoint_policy{});
  journal jn;
  metrics m{job_id};
  run_observer obs{run_observer::options{"", 12, false, ""}};
  sd_targets sd{job_id};
  coordinator_sink sink{jn, m, obs, sd};
  membership_handle members;
  job_handle job;
  checkpoint_writer_handle writer;

  coordinator_actors(test_support::caf_fixture& f, outbound out, const std::string& journal_path = "/dev/null") : fx(f) {
    if (!jn.open(journal_path)) fail("cannot open the journal");
    sd.set_coordinator("127.0.0.1", 9400);
    m.add_route("/sd", "application/json", [this] { return sd.json(); });
    checkpoint_writer_options wopts;
    wopts.events = sink.as_sink();
    wopts.commit = [this](pb::checkpoint_meta meta) -> result<saved_checkpoint> {
      auto done = store.commit(std::move(meta));
      if (!done) return done.err();
      return saved_checkpoint{done->location, static_cast<int64_t>(done->bytes), 0.0, {}};
    };
    coordinator_options copts = coordinator_options_from(cluster_settings_of(job_config()).value(), job_config().to_toml());
    copts.header = coordinator_header();
    copts.store_host = "127.0.0.1";
    copts.store_port = 29500;
    copts.checkpoint_store = objects->location();
    copts.events = sink.as_sink();
    job_options jopts = job_options_from(train_settings_of(job_config()).value());
    jopts.header = copts.header;
    jopts.events = sink.as_sink();
    writer = fx.spawn(checkpoint_writer, wopts);
    job = fx.spawn(job_actor, jopts, writer);
    members = fx.spawn(membership_actor, copts, std::move(out), job);
    caf::anon_send(job, members_atom::value, members);
    caf::anon_send(writer, members_atom::value, members);
  }
  ~coordinator_actors() {
    // Before the sink and the store they write to go.
    caf::anon_send_exit(members, caf::exit_reason::user_shutdown);
    caf::anon_send_exit(job, caf::exit_reason::user_shutdown);
    caf::anon_send_exit(writer, caf::exit_reason::user_shutdown);
    fx.run();
  }
  // What Prometheus reads: /metrics and /sd.
  void scrape() {
    (void)m.render();
    (void)sd.json();
  }
};

// A node agent's options as app/node.cpp sets them (its heartbeat settings
// from the config in register_ack).
inline node_agent_options node_options(const std::string& node_id) {
  node_agent_options o;
  o.node_id = dtactor::node_id{node_id};
  o.advertise_addr = "10.0.0.2";
  o.hostname = node_id;
  o.nproc = ranks_per_node;
  o.header.sender = sender_id::of_node(node_id).to_string();
  o.header.incarnation = 42;
  o.liveness_from_config = liveness_options_from_text<config>;
  o.annotate_report = [node_id](const std::string&, pb::step_report& r) { r.set_node_id(node_id); };
  return o;
}

// Rank processes as messages: pids from `first_pid` on, exits sent to the
// agent. `on_spawn` (may be empty) starts whatever stands for the process.
class fake_launcher : public process_launcher {
 public:
  explicit fake_launcher(int32_t first_pid) : next_pid_(first_pid) {}
  node_agent_handle agent;
  std::function<void(int32_t local_rank, int32_t pid)> on_spawn;
  std::map<int32_t, int32_t> running;  // pid -> local rank
  result<int32_t> spawn(int32_t local_rank) override {
    const int32_t pid = next_pid_++;
    running[pid] = local_rank;
    if (on_spawn) on_spawn(local_rank, pid);
    return pid;
  }
  void terminate(int32_t pid) override { exit(pid, 143); }
  void kill(int32_t pid) override { exit(pid, 137); }
  void exit(int32_t pid, int32_t code) {
    if (running.erase(pid)) caf::anon_send(agent, rank_exit_atom::value, pid, code);
  }

 private:
  int32_t next_pid_;
};

inline rank_actor_options rank_options(const std::string& node_id, int32_t local_rank, int32_t pid, std::function<void(pb::envelope)> send,
                                       std::function<std::unique_ptr<rank_work>(rank_work_callbacks)> make_work) {
  rank_actor_options o;
  o.header.sender = sender_id::of_rank(node_id, local_rank).to_string();
  o.header.incarnation = 9 + static_cast<uint64_t>(pid);
  o.node_id = node_id;
  o.local_rank = local_rank;
  o.pid = pid;
  o.send = std::move(send);
  o.make_work = std::move(make_work);
  return o;
}

// The clock, from a record's payload: its first two bytes in milliseconds
// (100 when shorter), at most 5 s a record.
inline std::chrono::milliseconds clock_step(const std::string& payload) {
  const unsigned ms = payload.size() >= 2 ? static_cast<uint8_t>(payload[0]) | static_cast<uint8_t>(payload[1]) << 8 : 100;
  return std::chrono::milliseconds(ms % 5000);
}

}  // namespace dtactor::fuzz
