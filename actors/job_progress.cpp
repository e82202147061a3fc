#include "actors/job_progress.hpp"

#include <algorithm>
#include <set>

#include "actors/wire_enums.hpp"

namespace dtactor {

std::optional<ev::step_completed> step_table::add(const pb::step_report& r, uint64_t generation, int32_t world_size) {
  auto& w = rows_[r.step()];
  w.world = world_size;
  w.steps = std::max(1, r.steps_covered());
  ++w.reports;
  w.loss_weighted += r.loss() * static_cast<double>(r.samples());
  w.loss_mean_weighted += r.loss_mean() * static_cast<double>(r.samples());
  w.samples += r.samples();
  w.max_step_s = std::max(w.max_step_s, r.step_s());
  w.allreduce_s = std::max(w.allreduce_s, r.allreduce_s());
  w.exposed_s = std::max(w.exposed_s, r.allreduce_exposed_s());
  w.compute_s = std::max(w.compute_s, r.compute_s());
  w.update_s = std::max(w.update_s, r.update_s());
  w.gather_s = std::max(w.gather_s, r.gather_s());
  w.pass_gather_s = std::max(w.pass_gather_s, r.pass_gather_s());
  w.lr = r.lr();
  if (w.reports < w.world) return std::nullopt;
  ev::step_completed out;
  out.step = r.step();
  out.world_size = w.world;
  out.generation = generation;
  out.loss = w.samples > 0 ? w.loss_weighted / static_cast<double>(w.samples) : 0.0;
  if (w.samples > 0) out.loss_avg = w.loss_mean_weighted / static_cast<double>(w.samples);
  out.lr = w.lr;
  out.samples = w.samples;
  out.samples_per_s = w.max_step_s > 0 ? static_cast<double>(w.samples) / w.max_step_s : 0.0;
  const double per_step = 1.0 / w.steps;
  out.step_s = w.max_step_s * per_step;
  out.allreduce_s = w.allreduce_s * per_step;
  out.allreduce_exposed_s = w.exposed_s * per_step;
  if (w.compute_s > 0) out.compute_s = w.compute_s * per_step;
  if (w.update_s > 0) out.update_s = w.update_s * per_step;
  if (w.gather_s > 0) out.gather_s = w.gather_s * per_step;
  if (w.pass_gather_s > 0) out.pass_gather_s = w.pass_gather_s * per_step;
  rows_.erase(rows_.begin(), rows_.upper_bound(r.step()));
  return out;
}

ev::outer_step outer_step_of(const pb::step_report& r, uint64_t generation, int32_t world_size) {
  ev::outer_step e;
  e.step = r.step();
  e.generation = generation;
  e.world_size = world_size;
  e.inner_steps = static_cast<int64_t>(r.outer_inner_steps());
  e.payload_bytes = r.outer_payload_bytes() / r.outer_steps();
  e.exchange_s = r.outer_exchange_s() / static_cast<double>(r.outer_steps());
  e.window_s = r.outer_window_s();
  e.pseudo_grad_norm = r.pseudo_grad_norm();
  return e;
}

recovery_record begin_generation(uint64_t generation, bool first, plan_cause cause, bool drain, clock_time now, int64_t steps_before, int lost_workers) {
  recovery_record rec;
  rec.lost_workers = lost_workers;
  rec.generation = generation;
  rec.cause = first && cause != plan_cause::restart && cause != plan_cause::adopted ? plan_cause::start : cause;
  rec.drain = drain;
  rec.planned = now;
  rec.steps_before = steps_before;
  return rec;
}

std::optional<ev::checkpoint_restored> note_ready(recovery_record& rec, const pb::rank_status& s) {
  rec.resumed_step = std::max(rec.resumed_step, s.step());
  if (const auto os = from_wire(s.optimizer_source())) {
    if (!rec.optimizer || static_cast<int>(*os) > static_cast<int>(*rec.optimizer)) rec.optimizer = *os;
    rec.reshard_bytes += s.reshard_bytes();
  }
  if (s.status() == pb::rank_status::STATE_READY) {
    rec.ready_s = std::max(rec.ready_s.value_or(0.0), s.switch_s());
    rec.drain_s = std::max(rec.drain_s, s.drain_s());
    rec.group_s = std::max(rec.group_s, s.group_s());
    rec.state_s = std::max(rec.state_s, std::max(0.0, s.switch_s() - s.group_s()));
  }
  if (s.from_spare()) ++rec.spare_ranks;
  if (s.has_window_steps())
    rec.window_steps = std::max(rec.window_steps.value_or(0), s.window_steps());
  if (s.has_window_steps() && s.replayed_slices() > 0)
    rec.replayed_slices = std::max(rec.replayed_slices.value_or(0), s.replayed_slices());
  const auto origin = from_wire(s.state_source());
  if (!origin || (*origin != ev::state_source::peer && *origin != ev::state_source::disk) || rec.restored_logged) return std::nullopt;
  const ev::state_source src = *origin;
  rec.restored_logged = true;
  ev::checkpoint_restored r;
  r.step = s.step();
  r.source = src;
  r.generation = rec.generation;
  r.root = s.state_root();
  if (src == ev::state_source::peer && s.state_bytes() > 0) {
    r.bytes = s.state_bytes();
    r.transfer_s = s.state_transfer_s();
    if (s.state_transfer_s() > 0) r.gb_per_s = static_cast<double>(s.state_bytes()) / s.state_transfer_s() / 1e9;
    if (s.healing()) r.while_training = true;
  }
  return r;
}

std::optional<ev::recovery_done> complete_generation(recovery_record& rec, int64_t step, int32_t world_size, clock_time now) {
  if (rec.done) return std::nullopt;
  rec.done = true;
  if (rec.cause == plan_cause::start || rec.cause == plan_cause::adopted || rec.cause == plan_cause::none) return std::nullopt;
  ev::recovery_done d;
  d.generation = rec.generation;
  d.world_size = world_size;
  d.cause = rec.cause;
  d.drain = rec.drain;
  // Without a READY report (a rank that was already at its step), the
  // generation resumed from the step before the first one it completed.
  d.resumed_step = rec.resumed_step >= 0 ? rec.resumed_step : step - 1;
  d.lost_steps = std::max<int64_t>(0, rec.steps_before - d.resumed_step);
  d.duration_s = std::chrono::duration<double>(now - rec.planned).count();
  d.optimizer = rec.optimizer;
  if (rec.optimizer) d.reshard_bytes = rec.reshard_bytes;
  // DiLoCo: a lost worker's inner steps since the anchor went with it (the
  // survivors' window position stands for its own).
  if (rec.window_steps) d.lost_inner_steps = *rec.window_steps * rec.lost_workers;
  d.replayed_slices = rec.replayed_slices;
  if (rec.spare_ranks > 0) d.spare_ranks = rec.spare_ranks;
  if (rec.ready_s) {
    d.ready_s = *rec.ready_s;
    // A group is built once its slowest rank got there: the build is what
    // the slowest plan-to-group took beyond the slowest drain.
    d.drain_s = rec.drain_s;
    d.group_s = std::max(0.0, rec.group_s - rec.drain_s);
    d.state_s = rec.state_s;
    d.first_step_s = std::max(0.0, d.duration_s - *rec.ready_s);
  }
  return d;
}

ev::job_ended verdict(const std::map<int32_t, std::string>& digests, int64_t step, int64_t max_steps, uint64_t generation, int32_t world_size,
                      const std::map<std::string, double>& last_eval) {
  ev::job_ended e;
  e.step = step;
  e.generation = generation;
  e.world_size = world_size;
  e.metrics = last_eval;
  std::set<std::string> distinct;
  for (const auto& [rank, d] : digests) distinct.insert(d);
  if (!distinct.empty()) e.params_digest = *distinct.begin();
  e.how = step < max_steps ? ev::outcome::stopped : ev::outcome::finished;
  if (distinct.size() > 1) {
    e.digests_differ = true;
    e.reason = "ranks finished with different parameters";
    e.exit_code = 1;
  }
  return e;
}

}  // namespace dtactor
