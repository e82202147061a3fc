#pragma once
// Goodput: the share of wall time since a job started that went into
// training steps, and what the rest went to. The one definition, fed the
// journal's events in order with their times (unix seconds): the
// coordinator's sink feeds it live (its `goodput` journal line and the
// dtactor_goodput_* gauges), `dtactor report` feeds it the journal.
// Pure: no clock reads, no I/O.
//
// Buckets (seconds; docs/monitoring.md, "Goodput"):
// - productive: the steps every rank completed, each as long as the slowest
//   rank measured it (step_s, per step, times the steps a `step` line
//   covers: since the previous line of the same generation, or since the
//   generation's start_step, or since recovery_done's resumed_step), each
//   step once: a step computed again (a resume from before it) counts as
//   recovery. Steps the survivors resumed from that no line reported (done
//   after the last line, before the failure) move from recovery to
//   productive at the latest step_s. A line without step_s (`dtactor
//   train`, older journals) counts the time since the previous line of its
//   generation.
// - start: from a session's start to its first completed step, less that
//   step's productive time and any waiting for a floor.
// - recovery: for each generation planned after the session's first step,
//   from the last step line (or evaluation) before its plan to its plan (detection,
//   planning; less waiting for a floor), plus recovery_done's duration_s
//   less the generation's first step's productive time (rendezvous, state,
//   the first step's delivery).
// - waiting: from job_waiting (fewer nodes than cluster.floor_nodes) to the
//   next plan.
// - checkpoint: checkpoint_saved's stall_s (training held at the boundary).
// - eval: eval's duration_s.
// - other: wall less all of the above, never below 0 (reporting latency,
//   the end of the job after its last step, a session's downtime).
// wall: from the first session's start to the latest event; ratio:
// productive / wall, in [0, 1] (0 before any wall time).
#include <cstdint>
#include <optional>

#include "job/journal_events.hpp"

namespace dtactor {

class goodput_book {
 public:
  // A process that writes the journal started (coordinator_started, or
  // job_started outside a coordinator's session).
  void begin_session(double t);
  // One journal event at time t; events the book does not count only move
  // the wall clock. A coordinator_started (or a first job_started) begins a
  // session.
  void add(double t, const ev::journal_event& e);
  // The figures as of time `now` (>= the latest event's time moves the wall on).
  ev::goodput figures(double now) const;
  // As of the latest event.
  ev::goodput figures() const { return figures(last_t_); }
  bool started() const { return first_t_ > 0; }

  void on(double t, const ev::step_completed& e);
  void on(double t, const ev::generation_started& e);
  void on(double t, const ev::job_waiting& e);
  void on(double t, const ev::recovery_done& e);
  void on(double t, const ev::checkpoint_saved& e);
  void on(double t, const ev::eval_done& e);

 private:
  template <class E>
  void on(double t, const E&) {  // an event that only moves the wall clock
    touch(t);
  }
  void touch(double t);
  // Since the mark, less the waiting for a floor since then; moves the mark to t.
  double since_mark(double t);

  double first_t_ = 0, last_t_ = 0;
  bool cluster_session_ = false;  // the session began with coordinator_started
  bool session_stepped_ = false;  // a step completed in the current session
  // The time up to which the session's time outside steps is accounted
  // for (its start, then its latest step line or plan), and waiting_ then.
  double mark_t_ = 0, waiting_at_mark_ = 0;
  std::optional<uint64_t> generation_;  // of the latest plan or step
  int64_t gen_last_step_ = 0;  // the latest step of that generation (its start_step before one)
  bool gen_stepped_ = false;
  double pending_recovery_ = 0;  // recovery_done's duration_s, until its generation's first step line
  double last_credit_ = 0;       // the latest step line's productive seconds
  double last_step_s_ = 0;       // the latest step line's step_s
  int64_t credited_through_ = 0;  // the highest step counted as productive
  double last_gap_ = 0;          // the detection time counted at the latest plan
  double waiting_since_ = 0;     // 0: not waiting
  double productive_ = 0, start_ = 0, recovery_ = 0, waiting_ = 0, checkpoint_ = 0, eval_ = 0;
};

}  // namespace dtactor
