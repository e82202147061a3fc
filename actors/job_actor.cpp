#include "actors/job_actor.hpp"

#include <algorithm>

#include "base/printable.hpp"
#include "caf/stateful_actor.hpp"

namespace dtactor {

namespace {

// A typed actor sends to untyped ones (whoever waits for the end) with
// anon_send (CAF 0.17 refuses a typed send() there); nobody answers them.
using job_self = job_handle::stateful_pointer<job_actor_state>;

// The end is decided: every checkpoint forwarded so far is handled first
// (the final one arrives before the ranks' FINISHED), then the end is
// emitted, the nodes are told, and the waiters answered.
void end_job(job_self self, ev::job_ended e) {
  auto& st = self->state;
  if (st.ending) return;
  st.ending = true;
  log_line(st.opts.log,
           std::string("job ") + ev::to_string(e.how) + " at step " + std::to_string(e.step) + (e.reason.empty() ? "" : ": " + e.reason));
  auto announce = [self, e] {
    auto& st = self->state;
    emit(st.opts.events, e);
    st.ended = true;
    st.exit_code = e.exit_code;
    auto answer = [self] {
      for (const auto& w : self->state.waiters)
        if (auto a = caf::actor_cast<caf::actor>(w)) self->anon_send(a, done_atom::value, self->state.exit_code);
      self->state.waiters.clear();
    };
    if (!st.members) {
      answer();
      return;
    }
    const std::string reason = e.how == ev::outcome::finished ? "job finished" : e.how == ev::outcome::stopped ? "job stopped" : "job failed";
    self->request(st.members, std::chrono::seconds(5), shutdown_atom::value, reason, false)
        .then([=](bool) { answer(); }, [=](caf::error&) { answer(); });
  };
  if (!st.checkpoints) {
    announce();
    return;
  }
  // A checkpoint may take long to write; the job's end waits for it.
  self->request(st.checkpoints, caf::infinite, flush_atom::value).then([=](bool) { announce(); }, [=](caf::error&) { announce(); });
}

void check_finished(job_self self) {
  auto& st = self->state;
  if (st.world_size <= 0 || st.ending) return;
  // Reaching max_steps is not enough: rank 0 still evaluates and sends the
  // final checkpoint after its last step report. The job ends once every
  // rank has said FINISHED (sent after those), so nothing is cut off.
  if (static_cast<int32_t>(st.finished_ranks.size()) < st.world_size) return;
  auto e = verdict(st.finished_ranks, st.committed_step, st.opts.max_steps, st.generation, st.world_size, st.last_eval);
  end_job(self, std::move(e));
}

void fail_job(job_self self, const std::string& reason, bool resumable = true) {
  auto& st = self->state;
  ev::job_ended e;
  e.resumable = resumable;
  e.how = ev::outcome::failed;
  e.step = st.last_step;
  e.generation = st.generation;
  e.world_size = st.world_size;
  e.reason = reason;
  e.metrics = st.last_eval;
  e.exit_code = 1;
  end_job(self, std::move(e));
}

void record_step(job_self self, int32_t global_rank, int64_t step) {
  auto& st = self->state;
  if (global_rank < 0 || global_rank >= st.world_size) return;
  // The lowest step of all ranks, kept by a count of ranks per step: a
  // report costs a look-up, not a pass over the world.
  auto [it, fresh] = st.rank_steps.try_emplace(global_rank, std::max<int64_t>(0, step));
  if (!fresh) {
    if (step <= it->second) return;
    if (auto c = st.ranks_at_step.find(it->second); c != st.ranks_at_step.end() && --c->second == 0) st.ranks_at_step.erase(c);
    it->second = step;
  }
  ++st.ranks_at_step[it->second];
  if (static_cast<int32_t>(st.rank_steps.size()) < st.world_size) return;
  st.committed_step = std::max(st.committed_step, st.ranks_at_step.begin()->first);
}

ev::data_reading data_reading_of(const pb::data_reading& d) {
  ev::data_reading x;
  x.bytes_s3 = d.bytes_s3();
  x.bytes_local = d.bytes_local();
  x.cache_hits = d.cache_hits();
  x.cache_misses = d.cache_misses();
  x.shards_verified = d.shards_verified();
  x.shards_failed = d.shards_failed();
  x.read_ahead_depth = d.read_ahead_depth();
  x.cache_bytes = d.cache_bytes();
  x.cache_peak_bytes = d.cache_peak_bytes();
  return x;
}

void on_step_report(job_self self, const pb::step_report& r, const sender_id& sender) {
  auto& st = self->state;
  record_step(self, r.global_rank(), r.step());
  {
    ev::rank_usage u;
    u.global_rank = r.global_rank();
    u.node = printable(r.node_id().empty() ? sender.node_name() : r.node_id());  // a metric label: printable
    u.cpu_s = r.cpu_s();
    u.rss_bytes = r.rss_bytes();
    u.peak_rss_bytes = r.peak_rss_bytes();
    u.process_age_s = r.process_age_s();
    u.data_wait_s = r.data_wait_s() / std::max(1, r.steps_covered());
    u.param_bytes = r.param_bytes();
    u.grad_bytes = r.grad_bytes();
    u.optimizer_state_bytes = r.optimizer_state_bytes();
    u.checkpoint_buffer_bytes = r.checkpoint_buffer_bytes();
    if (r.has_data()) u.data = data_reading_of(r.data());
    u.step = r.step();
    emit(st.opts.events, u);
  }
  if (r.outer_steps() > 0 && r.global_rank() == 0)
    emit(st.opts.events, outer_step_of(r, st.generation, st.world_size));
  auto done = st.steps.add(r, st.generation, st.world_size);
  if (!done) return;
  if (auto rec = complete_generation(st.recovery, done->step, done->world_size, self->clock().now())) emit(st.opts.events, *rec);
  st.last_step = std::max(st.last_step, done->step);
  emit(st.opts.events, *done);
}

// A step of the generation drained from, completed after the next plan.
void on_drained_step_report(job_self self, const pb::step_report& r) {
  auto& st = self->state;
  auto done = st.drained_steps.add(r, st.drained_from, st.drained_world);
  if (!done) return;
  st.last_step = std::max(st.last_step, done->step);
  emit(st.opts.events, *done);
}

void on_rank_status(job_self self, const inbound& in) {
  auto& st = self->state;
  const auto& s = in.env.rank_status();
  switch (s.status()) {
    case pb::rank_status::STATE_FINISHED:
      record_step(self, s.global_rank(), s.step());
      st.last_step = std::max(st.last_step, s.step());
      st.finished_ranks[s.global_rank()] = s.detail();
      check_finished(self);
      break;
    case pb::rank_status::STATE_READY:
      if (in.env.generation() == st.recovery.generation)
        if (auto r = note_ready(st.recovery, s)) emit(st.opts.events, *r);
      break;
    case pb::rank_status::STATE_FAILED:
    case pb::rank_status::STATE_EXITED: {
      if (st.ending) break;  // ranks ending after the job did
      // Recorded; the membership actor re-plans (a new generation without
      // the lost rank, or the same members re-formed).
      const bool failed = s.status() == pb::rank_status::STATE_FAILED;
      const std::string detail = printable(s.detail(), printable_max_detail_chars);
      ev::rank_down down;
      down.failed = failed;
      down.rank = s.global_rank();
      down.local_rank = s.local_rank();
      down.node = printable(in.from.node_name());
      down.detail = detail;
      down.exit_code = s.exit_code();
      down.step = s.step();
      down.generation = in.env.generation();
      if (s.spare_takes_over()) down.spare = true;
      emit(st.opts.events, down);
      // No new generation can fix ranks whose parameters diverged, a loss
      // that became NaN, or data that cannot be read.
      if (failed && (s.failure() == pb::rank_status::FAILURE_PARAMETERS_DIFFER || s.failure() == pb::rank_status::FAILURE_DATA ||
                     s.failure() == pb::rank_status::FAILURE_DIVERGED))
        fail_job(self, "rank " + std::to_string(s.global_rank()) + ": " + detail);
      break;
    }
    default:
      break;
  }
}

void on_eval(job_self self, const pb::eval_report& e) {
  auto& st = self->state;
  ev::eval_done d;
  d.step = e.step();
  d.duration_s = e.duration_s();
  for (const auto& [k, v] : e.metrics()) d.metrics[k] = v;
  for (const auto& x : e.examples()) d.examples.push_back(printable(x, 4096));  // model output, already one line
  st.last_eval = d.metrics;
  st.last_eval_step = d.step;
  emit(st.opts.events, d);
}

// The job's result is complete: every rank took the last step, every part
// of the final checkpoint is stored, and the final evaluation is reported.
// What is left (ranks saying FINISHED, exiting) needs no node.
bool result_complete(const job_actor_state& st) {
  return st.opts.max_steps > 0 && st.committed_step >= st.opts.max_steps && st.last_eval_step >= st.opts.max_steps &&
         static_cast<int32_t>(st.final_parts.size()) >= st.world_size;
}

// A node lost once the result is complete ends the job with it. A new
// generation would load the final checkpoint, commit it again and evaluate
// again, and a node lost at the very end (as on a machine loaded past its
// cores) would make the job's end flap.
void on_lost(job_self self, const std::string& node_id, double detected_after_s) {
  auto& st = self->state;
  ++st.nodes_lost;
  log_line(st.opts.log, "job: node '" + node_id + "' lost after " + std::to_string(detected_after_s) + " s of silence");
  if (st.ending || !result_complete(st)) return;
  log_line(st.opts.log, "job: the final checkpoint and evaluation are done; the job ends without node '" + node_id + "'");
  end_job(self, verdict(st.finished_ranks, st.committed_step, st.opts.max_steps, st.generation, st.world_size, st.last_eval));
}

void stop_job(job_self self, const std::string& reason) {
  auto& st = self->state;
  if (st.stopping || st.ending) return;
  st.stopping = true;
  emit(st.opts.events, ev::job_stopping{reason});
  log_line(st.opts.log, reason + "; stopping the ranks after a final checkpoint");
  // Nothing is training: nothing to checkpoint, nobody to wait for.
  auto end_now = [self](const std::string& why) {
    ev::job_ended e;
    e.how = ev::outcome::stopped;
    e.step = self->state.committed_step;
    e.reason = why;
    e.final_checkpoint = false;
    end_job(self, std::move(e));
  };
  if (st.members) {
    self->send(st.members, stop_atom::value);
    // No node connected (every one left or was lost): no rank will answer.
    self->request(st.members, std::chrono::seconds(5), shutdown_atom::value, reason, true)
        .then([end_now, reason](bool told) { if (!told) end_now(reason + "; no node is connected"); }, [](caf::error&) {});
  }
  if (st.generation == 0 || !st.members) {
    end_now(reason);
    return;
  }
  self->delayed_send(self, st.opts.stop_timeout, stop_due_atom::value);
}

// A newer generation's plan starts its recovery record and clears the
// per-generation state. Returns the committed step (where the plan starts).
int64_t on_plan(job_self self, const plan& p) {
  auto& st = self->state;
  if (p.generation > st.generation) {
    st.superseded = std::move(st.recovery);
    st.recovery = begin_generation(p.generation, st.generation == 0, p.adopted ? plan_cause::adopted : p.cause, p.drain, self->clock().now(),
                                   st.last_step, st.generation == 0 ? 0 : std::max(0, st.world_size - p.world_size));
    st.drained_from = p.drain ? st.generation : 0;
    st.drained_world = st.world_size;
    st.drained_steps = std::move(st.steps);  // the reports of its steps in flight so far
    st.generation = p.generation;
    st.world_size = p.world_size;
    st.nodes = p.nodes;
    st.rank_steps.clear();
    st.ranks_at_step.clear();
    st.finished_ranks.clear();
    st.final_parts.clear();
    st.steps.clear();
  }
  return st.committed_step;
}

// A READY of the generation just superseded, arriving after the next plan:
// it steers nothing, but where that generation's state came from is still
// journaled (a state it read from disk is where the next one's came from).
bool late_restore(job_self self, const inbound& in) {
  auto& st = self->state;
  if (st.ended || in.env.body_case() != pb::envelope::kRankStatus || in.env.rank_status().status() != pb::rank_status::STATE_READY) return false;
  if (in.env.generation() == st.generation || in.env.generation() != st.superseded.generation || st.superseded.generation == 0) return false;
  if (auto r = note_ready(st.superseded, in.env.rank_status())) emit(st.opts.events, *r);
  ++st.stale_reports;
  return true;
}

// A rank's report, fenced by generation, to its handler.
void on_inbound(job_self self, inbound& in) {
  auto& st = self->state;
  if (late_restore(self, in)) return;
  // Fencing: reports from another generation than the current one are
  // dropped (a zombie can neither steer the job nor commit state); parts
  // of a checkpoint, and steps, of the generation this one drained from
  // are the same line of state.
  const bool drained = st.drained_from != 0 && in.env.generation() == st.drained_from && !st.ended;
  if (drained && in.env.has_step_report()) {
    on_drained_step_report(self, in.env.step_report());
    return;
  }
  const bool drained_part = in.env.has_checkpoint_written() && drained;
  if ((in.env.generation() != st.generation && !drained_part) || st.ended) {
    ++st.stale_reports;
    return;
  }
  switch (in.env.body_case()) {
    case pb::envelope::kStepReport:
      on_step_report(self, in.env.step_report(), in.from);
      break;
    case pb::envelope::kRankStatus:
      on_rank_status(self, in);
      break;
    case pb::envelope::kEvalReport:
      on_eval(self, in.env.eval_report());
      break;
    case pb::envelope::kCheckpointWritten:
      if (const auto& w = in.env.checkpoint_written(); st.opts.max_steps > 0 && w.step() >= st.opts.max_steps && w.error().empty() && w.parts_size() > 0)
        st.final_parts.insert(w.global_rank());
      if (st.checkpoints) self->send(st.checkpoints, std::move(in));
      break;
    case pb::envelope::kJobError:
      emit(st.opts.events, ev::job_error{printable(in.from.node_name()), printable(in.env.job_error().message(), printable_max_detail_chars)});
      break;
    default:
      ++st.stale_reports;
      break;
  }
}

// The stop's deadline passed with ranks still running: the job ends
// stopped, without its final checkpoint.
void on_stop_due(job_self self) {
  auto& st = self->state;
  if (st.ending) return;
  ev::job_ended e;
  e.how = ev::outcome::stopped;
  e.step = st.committed_step;
  e.generation = st.generation;
  e.world_size = st.world_size;
  e.reason = "not every rank stopped within " + std::to_string(std::chrono::duration_cast<std::chrono::seconds>(st.opts.stop_timeout).count()) +
             " s of the stop";
  e.final_checkpoint = false;
  end_job(self, std::move(e));
}

// The sender hears done with the exit code when the job has ended (now,
// or later).
void on_wait(job_self self) {
  auto& st = self->state;
  auto who = self->current_sender();
  if (st.ended) {
    if (auto a = caf::actor_cast<caf::actor>(who)) self->anon_send(a, done_atom::value, st.exit_code);
    return;
  }
  st.waiters.push_back(caf::actor_cast<caf::actor_addr>(who));
}

}  // namespace

job_handle::behavior_type job_actor(job_self self, job_options opts, checkpoint_writer_handle checkpoints) {
  self->state.committed_step = opts.initial_step;
  self->state.last_step = opts.initial_step;
  self->state.opts = std::move(opts);
  self->state.checkpoints = std::move(checkpoints);
  return {
      [=](members_atom, membership_handle members) { self->state.members = std::move(members); },
      // -1: the job is ending, send no plan.
      [=](plan_atom, const plan& p) -> int64_t { return self->state.ending ? int64_t{-1} : on_plan(self, p); },
      [=](inbound& in) { on_inbound(self, in); },
      [=](stop_atom, const std::string& reason) { stop_job(self, reason); },
      [=](fail_atom, const std::string& reason) { fail_job(self, reason, false); },
      [=](stop_due_atom) { on_stop_due(self); },
      [=](wait_atom) { on_wait(self); },
      [=](lost_atom, const std::string& node_id, double detected_after_s) { on_lost(self, node_id, detected_after_s); },
  };
}

}  // namespace dtactor
