#include "monitoring/goodput.hpp"

#include <algorithm>

namespace dtactor {

void goodput_book::touch(double t) {
  if (!(t > 0)) return;
  if (first_t_ == 0) begin_session(t);
  last_t_ = std::max(last_t_, t);
}

void goodput_book::begin_session(double t) {
  if (waiting_since_ > 0) waiting_ += std::max(0.0, last_t_ - waiting_since_);
  waiting_since_ = 0;
  if (first_t_ == 0) first_t_ = t;
  last_t_ = std::max(last_t_, t);
  cluster_session_ = false;
  session_stepped_ = false;
  mark_t_ = t;
  waiting_at_mark_ = waiting_;
  generation_.reset();
  gen_last_step_ = 0;
  gen_stepped_ = false;
  pending_recovery_ = 0;
}

double goodput_book::since_mark(double t) {
  const double s = std::max(0.0, t - mark_t_ - (waiting_ - waiting_at_mark_));
  mark_t_ = std::max(mark_t_, t);
  waiting_at_mark_ = waiting_;
  return s;
}

void goodput_book::add(double t, const ev::journal_event& e) {
  if (std::holds_alternative<ev::coordinator_started>(e)) {
    begin_session(t);
    cluster_session_ = true;
    return;
  }
  if (std::holds_alternative<ev::job_started>(e) && !cluster_session_) {
    begin_session(t);
    return;
  }
  std::visit([&](const auto& x) { on(t, x); }, e);
}

void goodput_book::on(double t, const ev::step_completed& e) {
  touch(t);
  const uint64_t gen = e.generation.value_or(0);
  if (generation_ != gen) {  // a generation planned before this book's session (adopted)
    generation_ = gen;
    gen_last_step_ = e.step - 1;
    gen_stepped_ = false;
  }
  // Steps at or below one already counted were computed again (a resume
  // from before them): recovery, not progress.
  const int64_t from = std::max(gen_last_step_, credited_through_);
  const double fresh = static_cast<double>(std::max<int64_t>(0, e.step - from));
  const double again = static_cast<double>(std::max<int64_t>(0, std::min(e.step, from) - gen_last_step_));
  double credit = 0;
  if (e.step_s > 0) {
    credit = e.step_s * fresh;
    recovery_ += e.step_s * again;
    last_step_s_ = e.step_s;
  } else if (gen_stepped_) {
    credit = std::max(0.0, t - mark_t_);
  }
  productive_ += credit;
  credited_through_ = std::max(credited_through_, e.step);
  last_credit_ = credit;
  if (!session_stepped_) {
    start_ += std::max(0.0, since_mark(t) - credit);
    session_stepped_ = true;
    pending_recovery_ = 0;
  } else if (!gen_stepped_) {
    // duration_s ran to the end of the generation's first step, counted above.
    recovery_ += std::max(0.0, pending_recovery_ - (e.step_s > 0 ? e.step_s : credit));
    pending_recovery_ = 0;
  }
  mark_t_ = std::max(mark_t_, t);
  waiting_at_mark_ = waiting_;
  gen_last_step_ = e.step;
  gen_stepped_ = true;
}

void goodput_book::on(double t, const ev::generation_started& e) {
  touch(t);
  if (waiting_since_ > 0) waiting_ += std::max(0.0, t - waiting_since_);
  waiting_since_ = 0;
  // Before the session's first step, the time is the start's.
  last_gap_ = session_stepped_ ? since_mark(t) : 0.0;
  recovery_ += last_gap_;
  generation_ = e.generation;
  gen_last_step_ = e.start_step;
  gen_stepped_ = false;
  pending_recovery_ = 0;
}

void goodput_book::on(double t, const ev::job_waiting&) {
  touch(t);
  if (waiting_since_ == 0) waiting_since_ = t;
}

void goodput_book::on(double t, const ev::recovery_done& e) {
  touch(t);
  if (!session_stepped_) return;
  if (generation_ == e.generation && !gen_stepped_ && e.resumed_step > gen_last_step_) {
    // The survivors held steps no line reported (completed before the
    // failure, after the last line): progress, out of the detection time.
    const double held = static_cast<double>(std::max<int64_t>(0, e.resumed_step - credited_through_)) * last_step_s_;
    const double moved = std::min(held, last_gap_);
    productive_ += moved;
    recovery_ -= moved;
    last_gap_ -= moved;
    credited_through_ = std::max(credited_through_, e.resumed_step);
    gen_last_step_ = e.resumed_step;
  }
  if (gen_stepped_ && generation_ == e.generation)  // its first step's line came first
    recovery_ += std::max(0.0, e.duration_s - last_credit_);
  else
    pending_recovery_ = e.duration_s;
}

void goodput_book::on(double t, const ev::checkpoint_saved& e) {
  touch(t);
  checkpoint_ += std::max(0.0, e.stall_s);
}

void goodput_book::on(double t, const ev::eval_done& e) {
  touch(t);
  eval_ += std::max(0.0, e.duration_s);
  // Training waits for an evaluation: the time since the last step line is
  // the evaluation's (and other), never a later plan's detection time.
  if (session_stepped_) {
    mark_t_ = std::max(mark_t_, t);
    waiting_at_mark_ = waiting_;
  }
}

ev::goodput goodput_book::figures(double now) const {
  ev::goodput g;
  const double end = std::max(now, last_t_);
  g.wall_s = first_t_ > 0 ? std::max(0.0, end - first_t_) : 0.0;
  g.productive_s = productive_;
  g.start_s = start_;
  g.recovery_s = recovery_;
  g.waiting_s = waiting_ + (waiting_since_ > 0 ? std::max(0.0, end - waiting_since_) : 0.0);
  g.checkpoint_s = checkpoint_;
  g.eval_s = eval_;
  const double counted = g.productive_s + g.start_s + g.recovery_s + g.waiting_s + g.checkpoint_s + g.eval_s;
  g.other_s = std::max(0.0, g.wall_s - counted);
  g.ratio = g.wall_s > 0 ? std::clamp(g.productive_s / g.wall_s, 0.0, 1.0) : 0.0;
  return g;
}

}  // namespace dtactor
