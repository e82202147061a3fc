#pragma once
// The coordinator's status page: what a person opens to see the job (GET /
// on the metrics port) and the same data as JSON (GET /status.json). Fed by
// the coordinator's events (job/events.hpp) through its sink; read by the
// HTTP workers. Every method is thread-safe.
//
// It shows the job's state, generation and world size; the step and
// samples/s with the last minutes as a chart; the members (node, host,
// ranks, state, heartbeat age, the last step each rank reported); the
// recoveries (cause, detection, duration, steps lost); the checkpoints; and
// the last errors, one line each. With a job key (`keyed`), hosts,
// checkpoint locations and error texts are left out: the page is
// unauthenticated, and a stranger who reaches the port learns the job's
// progress and shape, not where its machines and data are.
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "job/events.hpp"

namespace dtactor {

struct status_options {
  std::string job_id;
  int64_t max_steps = 0;
  bool keyed = false;
  double history_s = 600;  // how far back the chart goes
};

class status_board {
 public:
  explicit status_board(status_options o);

  // One event, at unix time `now`.
  void on(const ev::event& e, double now);
  // /status.json at unix time `now`.
  std::string json(double now) const;
  // The page (HTML, CSS and script inline; it polls /status.json).
  static const std::string& page();

  // The job's state as the page names it.
  enum class job_state { starting, waiting, training, recovering, stopping, finished, stopped, failed };
  enum class member_state { joining, standby, training, draining, lost, quarantined };
  static const char* to_string(job_state s);
  static const char* to_string(member_state s);

 private:
  struct member {
    std::string host;
    int32_t node_rank = -1, nproc = 0, ready_ranks = 0;
    member_state state = member_state::joining;
    double heard_at = 0;  // unix time of its last heartbeat as last reported
    double left_at = 0;   // lost, quarantined or drained: when (forgotten after a while)
    std::map<int32_t, int64_t> rank_steps;  // global rank -> last step reported
  };
  struct point {
    double t = 0, samples_per_s = 0, loss = 0;
    int64_t step = 0;
    int32_t world = 0;
  };
  struct recovery {
    double t = 0, detected_s = -1, duration_s = 0;
    std::string cause, node;
    int64_t resumed_step = 0, lost_steps = 0;
    int32_t world = 0;
  };
  struct checkpoint {
    double t = 0, seconds = 0;
    int64_t step = 0;
    uint64_t bytes = 0;
    std::string location;
  };
  struct error_line {
    double t = 0;
    std::string text;
  };

  template <class T>
  void handle(const T&, double) {}
  void handle(const ev::members_view& e, double now);
  void handle(const ev::node_joined& e, double now);
  void handle(const ev::node_lost& e, double now);
  void handle(const ev::node_left& e, double now);
  void handle(const ev::node_quarantined& e, double now);
  void handle(const ev::job_waiting& e, double now);
  void handle(const ev::generation_started& e, double now);
  void handle(const ev::generation_adopted& e, double now);
  void handle(const ev::rank_usage& e, double now);
  void handle(const ev::step_completed& e, double now);
  void handle(const ev::eval_done& e, double now);
  void handle(const ev::recovery_done& e, double now);
  void handle(const ev::rank_down& e, double now);
  void handle(const ev::job_error& e, double now);
  void handle(const ev::checkpoint_saved& e, double now);
  void handle(const ev::checkpoint_failed& e, double now);
  void handle(const ev::checkpoint_refused& e, double now);
  void handle(const ev::job_stopping& e, double now);
  void handle(const ev::job_ended& e, double now);
  void error(double now, const std::string& text);
  void forget_departed(double now);

  status_options opts_;
  mutable std::mutex mu_;
  double started_ = 0;
  job_state state_ = job_state::starting;
  uint64_t generation_ = 0;
  int32_t world_ = 0;
  int64_t step_ = 0;
  double loss_ = 0, samples_per_s_ = 0;
  std::map<std::string, double> eval_;
  int64_t eval_step_ = -1;
  std::string end_reason_;
  std::map<std::string, member> members_;
  std::deque<point> series_;
  std::deque<recovery> recoveries_;
  std::map<std::string, double> pending_detection_;  // node -> detected_after_s of its loss, until a recovery reports
  std::deque<checkpoint> checkpoints_;
  std::deque<error_line> errors_;
  int recoveries_total_ = 0;
  int64_t lost_steps_total_ = 0;
};

}  // namespace dtactor
