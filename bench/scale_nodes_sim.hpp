// The scale bench's simulated nodes (bench/scale_nodes.cpp): one process
// plays K nodes. The protocol a node speaks is in scale_nodes.cpp; their
// sockets, redials and the commands on stdin in scale_nodes_sockets.cpp.
#pragma once

#include <sys/epoll.h>
#include <sys/resource.h>
#include <unistd.h>
#include <zmq.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>
#include <zmq.hpp>

#include "base/job_key.hpp"
#include "base/printable.hpp"
#include "base/unix_time.hpp"
#include "bench/scale_nodes_args.hpp"
#include "bench/scale_nodes_relay.hpp"
#include "dtactor/config.hpp"
#include "job/settings.hpp"
#include "net/redial_backoff.hpp"
#include "net/wire.hpp"

namespace dtactor::scale_sim {


using steady = std::chrono::steady_clock;
using ms = std::chrono::milliseconds;
// In an epoll event's data: a node's monitor, or its DEALER to its relay,
// not its DEALER to the coordinator; the relay listener; stdin.
constexpr uint64_t monitor_bit = uint64_t{1} << 62;
constexpr uint64_t relay_bit = uint64_t{1} << 61;
constexpr uint64_t listener_tag = UINT64_MAX - 1;
constexpr uint64_t stdin_tag = UINT64_MAX;

enum class phase : uint8_t { registering, member, stopped };

struct sim_node {
  std::string id;
  std::string source;
  void* socket = nullptr;
  int fd = -1;  // ZMQ_FD, watched by epoll
  void* monitor = nullptr;  // its socket monitor's PAIR (shed_redial_max_ms > 0)
  std::string endpoint;
  std::optional<dtactor::redial_backoff> redial;
  std::optional<std::chrono::steady_clock::time_point> redial_at;
  uint64_t incarnation = 0;
  uint64_t rank_incarnation = 0;
  phase ph = phase::registering;
  bool silent = false;
  bool closed = false;
  bool running = false;  // a plan named it
  uint64_t generation = 0;
  int32_t node_rank = -1;  // register_ack's
  int32_t global_rank = -1;
  int32_t world = 0;
  int64_t last_step = 0;
  int64_t report_slot = 0;  // wall-clock slot of the plan or the last report
  uint64_t hb_seq = 0;
  uint32_t register_attempt = 0;
  ms asked_every{0};  // the coordinator's heartbeat interval for it (0: the job's)
  steady::time_point last_beat{};
  steady::time_point ack_asked{};
  steady::time_point next_tick{};
  steady::time_point next_register{};
  steady::time_point last_heard{};
  double last_sent_unix = 0;
  scale_sim::relay_member relay;
  bool relay_answered = false;  // since its relay DEALER was dialled
};

struct counters {
  uint64_t sent = 0, send_failed = 0, received = 0, dropped = 0;
  uint64_t registers = 0, re_registers = 0, refusals = 0, plans = 0, reports = 0;
  uint64_t redials_held = 0;  // connections shut before their handshake, redialled after a backoff
  scale_sim::relay_counters relay;
};

// A node's routing id, its DEALER to the coordinator's and to its relay's alike.
inline std::string routing_id(const sim_node& n) { return sender_id::of_node(n.id).to_string() + "/" + std::to_string(n.incarnation); }

inline double steady_s(steady::time_point t) { return std::chrono::duration<double>(t.time_since_epoch()).count(); }

inline void print_line(const nlohmann::json& j) {
  std::fputs((j.dump() + "\n").c_str(), stdout);
  std::fflush(stdout);
}

class simulator {
 public:
  simulator(sim_options o, job_key key) : o_(std::move(o)), key_(std::move(key)) {}
  int run();

 private:
  status open_sockets();
  void close_sockets();
  void open_socket(sim_node& n, size_t index);
  scale_sim::dealer_settings dealer_settings() const { return {o_.zmtp_heartbeat_ms, o_.reconnect_max_ms, o_.immediate}; }
  void loop();
  void read_stdin();
  void drain(size_t index);
  void drain_monitor(size_t index);
  void open_monitor(sim_node& n, size_t index);
  void redial_due(sim_node& n, steady::time_point now);
  void on_envelope(sim_node& n, const pb::envelope& env, size_t frame_bytes);
  void on_register_ack(sim_node& n, const pb::register_ack& ack);
  void on_plan(sim_node& n, const pb::generation_plan& plan, size_t frame_bytes);
  void timers(steady::time_point now);
  void tick(sim_node& n, steady::time_point now);
  void enter_registering(sim_node& n, steady::time_point now);
  void send_register(sim_node& n);
  void send_heartbeat(sim_node& n, steady::time_point now);
  void send_rank_status(sim_node& n, pb::rank_status::state s);
  void send_step_report(sim_node& n, int64_t slot);
  void send(sim_node& n, const pb::envelope& env);
  pb::envelope node_envelope(const sim_node& n) const;
  pb::envelope rank_envelope(const sim_node& n) const;
  void take_liveness(const std::string& config_toml);
  ms register_cap() const;
  void command(const std::string& line);
  void stop_nodes(const std::string& how, int count, bool relays_only);
  void print_stats();
  // Heartbeat relays (node_agent_relay.cpp's functions of the same names).
  void take_relay(sim_node& n, const pb::relay_assignment& a, steady::time_point now);
  void on_coordinator_ack(sim_node& n, const pb::heartbeat_ack& ack);
  void on_relay_answer(sim_node& n, const pb::envelope& env);
  bool given_up_relay(sim_node& n, steady::time_point now);
  void send_to_relay(sim_node& n, const pb::envelope& env, steady::time_point now);
  void drain_relay(size_t index);
  void on_member_beat(const std::string& peer, const pb::envelope& env);
  sim_node* group_relay(int32_t node_rank);
  void drain_touched();
  void answer_members();  // the member beats waiting on the listener
  liveness_options liveness() const {
    liveness_options l;
    l.heartbeat_interval = interval_;
    l.heartbeat_timeout = timeout_;
    return l;
  }

  sim_options o_;
  job_key key_;
  zmq::context_t context_;
  void* ctx_ = nullptr;  // context_'s
  int epoll_ = -1;
  std::vector<sim_node> nodes_;
  std::vector<uint64_t> touched_;  // sockets sent to since their last drain (a node's index, | relay_bit: its relay DEALER)
  std::minstd_rand random_{std::random_device{}()};
  ms interval_{100};                // liveness_options' defaults, as a node starts
  ms timeout_{1000};
  int32_t relay_group_size_ = 64;  // cluster.relay_group_size
  std::string parsed_config_;      // the config text the three above came from
  scale_sim::relay_listener listener_;
  scale_sim::relay_sockets relay_sockets_;            // what relay DEALERs open with
  std::unordered_map<int32_t, size_t> group_relays_;  // group -> the node here last told it relays that group
  std::string job_id_;
  counters c_;
  std::string stdin_buf_;
  bool quit_ = false;
};

}  // namespace dtactor::scale_sim
