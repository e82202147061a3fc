#include "rank/step_loop.hpp"

#include <malloc.h>
#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <utility>

#include "actors/wire_enums.hpp"
#include "comm/communicator.hpp"
#include "data/data_shards.hpp"
#include "data/data_wait.hpp"
#include "data/sample_log.hpp"
#include "rank/checkpoint_saver.hpp"
#include "rank/generation.hpp"

namespace dtactor {

namespace {

// True when every rank holds the same parameters (digest min == max).
result<bool> digests_agree(c10d::ProcessGroup& pg, const std::string& hex, std::chrono::milliseconds timeout, const abandon_fn& abandon) {
  const int64_t v = static_cast<int64_t>(std::stoull(hex, nullptr, 16));
  // MAX of (v, -v) gives max and -min in one collective.
  std::vector<int64_t> words{v, -v};
  if (auto st = max_allreduce(pg, words, deadline_in(timeout), abandon, "parameter digest comparison"); !st) return st.err();
  return words[0] == -words[1];
}

}  // namespace

void inject_fault(fault_mode mode, int64_t at_step) {
  std::fprintf(stderr, "dtactor: fault injection at step %lld: %s\n", static_cast<long long>(at_step), to_string(mode).c_str());
  std::fflush(stderr);
  const pid_t node = ::getppid();
  switch (mode) {
    case fault_mode::crash:
      ::kill(node, SIGKILL);
      ::raise(SIGKILL);
      break;
    case fault_mode::hang:
      ::kill(node, SIGSTOP);
      ::raise(SIGSTOP);
      break;
    case fault_mode::leave:
      ::kill(node, SIGTERM);
      break;
    case fault_mode::rank_crash:
    case fault_mode::rank_oom:
      ::raise(SIGKILL);
      break;
  }
}

step_loop::step_loop(generation_run& g, rank_state& rs, step_loop_options o) : g_(g), rs_(rs), state_(*rs.state), o_(std::move(o)) {
  cadence_ = step_cadence_of(*rs_.cfg);
  last_ckpt_ = o_.state_checkpointed_at >= 0 && o_.state_checkpointed_at == state_.step() ? state_.step() : -1;
  // train.sync = diloco: inner steps without a collective; at each boundary
  // the outer step (its exchange carries the step control), and only there
  // what needs every rank to hold the same parameters (buffers, digests,
  // evaluation, checkpoints, stop, switch).
  diloco_ = state_.diloco();
  alone_ = !g_.pg;
}

bool step_loop::due(int64_t every, int64_t step, int64_t window_start) const {
  if (!diloco_ || alone_) return cadence_.due(every, step);
  if (step >= cadence_.max_steps) return true;
  return every > 0 && step / every > window_start / every;
}

// Something of DiLoCo's left to do at this step: a fragment due, or an
// exchange in flight that lands now.
bool step_loop::outer_pending() const { return diloco_ && (state_.outer().due(state_.step()) || state_.outer().lands(state_.step())); }

bool step_loop::in_flight() const { return diloco_ && state_.outer().in_flight().has_value(); }

generation_outcome step_loop::run() {
  if (auto ended = begin()) return *ended;
  finish_job_already_done();
  rs_.window.announce(g_, state_);
  rs_.trained_gen = g_.gen;
  rs_.trained_rank = g_.rank;
  rs_.trained_world = g_.world;
  const bool replay_on = diloco_ && g_.pg;  // the window's slices are noted (diloco_window::agree)
  window_began_ = clock_type::now();
  while (state_.step() < cadence_.max_steps || outer_pending()) {
    if (g_.quitting()) return generation_outcome::quit;
    if (g_.abandon_now()) return generation_outcome::next_plan;
    if (o_.stop_at_step >= 0 && state_.step() >= o_.stop_at_step && !o_.stop()) o_.request_final_stop();
    if (o_.fail_mode == fault_mode::rank_oom && o_.fail_at_step >= 0 && state_.step() >= o_.fail_at_step) inject_fault(o_.fail_mode, o_.fail_at_step);
    if (alone_ && o_.stop() && !in_flight()) return stop_here(state_.step(), o_.stop_checkpoint());
    if (rs_.window.replay_owed()) {
      if (auto ended = rs_.window.replay_next(g_, rs_, x_.host_sync.get())) return *ended;
      continue;
    }
    const auto t0 = clock_type::now();
    set_control();
    const int64_t attempted = state_.step();
    const int64_t window_start = diloco_ ? state_.outer().anchor() : attempted;
    r_ = training_state::dp_step{};
    if (!outer_pending())
      if (auto ended = inner_step(replay_on)) return *ended;
    if (!diloco_) agreed_ = x_.sync().control();
    if (auto ended = after_step(attempted, window_start, t0)) return *ended;
  }
  rs_.saver->finish();
  g_.report_status(pb::rank_status::STATE_FINISHED, state_.step(), state_.params_digest());
  return generation_outcome::finished;
}

// The job's last step is done but this generation started after it (the
// old rank 0 may have died before its final evaluation and checkpoint
// reached the coordinator): the new rank 0 sends both.
void step_loop::finish_job_already_done() {
  if (state_.step() < cadence_.max_steps || outer_pending() || last_ckpt_ == state_.step()) return;
  if (g_.rank == 0) send_eval();
  write_checkpoint();
}

// Before the first step of a generation: the exchanges, the gradients and
// DiLoCo's flight cleared, memory handed back, READY, the part writer.
generation_end step_loop::begin() {
  if (auto st = choose_exchanges(g_, rs_, x_); !st) return g_.failed(st.message(), state_.step());
  // Whatever the last generation left in the gradients is a partial step,
  // and an exchange it left in flight is gone with its reducers.
  state_.zero_grad();
  if (state_.diloco()) state_.outer().drop_flight();
  // What set-up freed goes back to the kernel now: the module's own
  // parameter tensors once the optimizer copied them into its flat buffers
  // (16 MB each for a GPT layer's MLP), the shards a reshard handed over.
  // The rank keeps a step's freed buffers on its heap (app/rank.cpp's
  // malloc settings), so without this they stayed resident between the
  // heap's live blocks: 4 bytes a parameter a rank (the 340M GPT at world 4,
  // train.zero = 2: 6.0 GB a rank and out of memory; 4.7 GB with this).
  ::malloc_trim(0);
  report_ready();
  rs_.saver->prepare(state_, rs_.shards, g_);
  return std::nullopt;
}

// How this generation's gradients travel, shown in the rank's READY status.
void step_loop::report_ready() {
  const std::string transport = describe_transport(g_, x_, rs_);
  if (g_.world > 1) std::fprintf(stderr, "rank %d: generation %llu: %s\n", g_.rank, static_cast<unsigned long long>(g_.gen), transport.c_str());
  auto ready = status_of(pb::rank_status::STATE_READY, g_.rank, g_.local, state_.step(), transport);
  ready.set_state_source(to_wire(g_.source));
  ready.set_state_root(g_.root);
  ready.set_switch_s(now_s() - g_.offered_at);
  ready.set_state_bytes(g_.transfer_bytes);
  if (rs_.shards) {
    ready.set_optimizer_source(to_wire(g_.optimizer));
    ready.set_reshard_bytes(g_.reshard_bytes);
  }
  ready.set_state_transfer_s(g_.transfer_s);
  if (state_.diloco()) {
    ready.set_window_steps(g_.window_steps);
    ready.set_skipped_steps(g_.skipped_steps);
    ready.set_replayed_slices(g_.replayed_slices);
  }
  if (g_.cb.on_status) g_.cb.on_status(g_.gen, std::move(ready));
}

// The step's control (step_control.hpp) rides at the end of its first
// gradient bucket, SUM-reduced with it (no collective of its own). Every
// rank reads the same sums after the step: all switch once every rank holds
// the newer plan, all stop if any rank was asked to, at the same step
// boundary, and rank 0 writes the final checkpoint if any rank was asked
// for one.
void step_loop::set_control() {
  mine_ = step_control{};
  mine_.newer_plan = o_.newer_plan() ? 1.f : 0.f;
  mine_.stop = o_.stop() ? 1.f : 0.f;
  mine_.final_checkpoint = mine_.stop > 0 && o_.stop_checkpoint() ? 1.f : 0.f;
  x_.sync().set_control(mine_);
}

// The step's forward, backward and update (DiLoCo: an inner step of this
// rank's slice, of the world it was taken in when catching up).
generation_end step_loop::inner_step(bool replay_on) {
  const int64_t attempted = state_.step();
  const auto [slice_rank, slice_world] = rs_.window.slice_of(attempted, g_.rank, g_.world);
  rs_.attempt = {attempted, g_.gen, slice_rank, slice_world};
  result<training_state::dp_step> r = training_state::dp_step{};
  if (x_.host_sync)
    r = state_.inner_step_host(g_.rank, g_.world, *x_.host_sync, g_.exchange.host_members);
  else
    r = diloco_ ? state_.inner_step(slice_rank, slice_world) : state_.train_step_dp(g_.rank, g_.world, x_.sync());
  // Applied (with ZeRO, to this rank's shards even when the all-gather
  // after it failed): the step is in the audit log before anything else.
  if (state_.step() > attempted)
    if (auto st = rs_.log_samples(attempted, g_.gen, slice_rank, slice_world); !st)
      return g_.failed(st.message(), state_.step(), pb::rank_status::FAILURE_DATA);
  if (!r) return g_.failed(r.message(), state_.step());
  // No generation can fix a loss that became NaN or infinite.
  if (r->samples > 0 && !std::isfinite(r->loss_sum))
    return g_.failed("loss became " + std::to_string(r->loss_sum / static_cast<double>(r->samples)) + " at step " + std::to_string(state_.step()) +
                         "; lower train.lr, keep train.grad_clip on, or resume from an earlier checkpoint",
                     state_.step(), pb::rank_status::FAILURE_DIVERGED);
  if (replay_on) rs_.window.note_slice(oldest_fragment_anchor(state_.outer()), {attempted, slice_rank, slice_world, {}});
  r_ = *r;
  return std::nullopt;
}

// DiLoCo after a step: the exchange in flight that lands now, then the
// fragments due (each exchange carries the step control). `boundary` is set
// when one landed: every rank then holds the same global parameters.
generation_end step_loop::outer_steps(bool& boundary) {
  std::vector<size_t> landed_fragments;
  auto record = [&](const training_state::outer_step_result& o) {
    landed_fragments.push_back(o.fragment);
    r_.allreduce_s += o.exchange_s;
    r_.exposed_s += o.exposed_s;
    acc_.set_outer_steps(acc_.outer_steps() + 1);
    acc_.set_outer_payload_bytes(acc_.outer_payload_bytes() + static_cast<uint64_t>(o.payload_bytes));
    acc_.set_outer_exchange_s(acc_.outer_exchange_s() + o.exchange_s);
    acc_.set_pseudo_grad_norm(o.pseudo_grad_norm);
    acc_.set_outer_inner_steps(static_cast<uint64_t>(o.inner_steps));
    acc_.set_outer_window_s(std::chrono::duration<double>(clock_type::now() - window_began_).count());
    window_began_ = clock_type::now();
    agreed_ = x_.syncs[o.fragment]->control();
    boundary = true;
  };
  bool landed = false;
  if (state_.outer().lands(state_.step())) {
    auto o = state_.outer_land(*x_.syncs[*state_.outer().in_flight()]);
    if (!o) return g_.failed(o.message(), state_.step());
    record(*o);
    landed = true;
  }
  const auto due = state_.outer().due_fragments(state_.step());
  for (size_t f : due) {
    // Overlapped only when it is the one exchange of this step and the job
    // goes on: a boundary never leaves an exchange in flight.
    const bool overlap = state_.outer().options().overlap > 0 && state_.step() < cadence_.max_steps && due.size() == 1 && !landed;
    x_.syncs[f]->set_control(mine_);
    auto o = state_.outer_launch(f, *x_.syncs[f], overlap);
    if (!o) return g_.failed(o.message(), state_.step());
    if (o->landed) record(*o);
  }
  // data.sample_log: this rank's lines before the landed pseudo-gradient's
  // step are in that fragment of the global parameters.
  if (rs_.samples_log)
    for (size_t f : landed_fragments)
      if (auto st = rs_.samples_log->append_synced(state_.outer().fragment_anchor(f), g_.gen, g_.rank, g_.world,
                                                   state_.outer().streaming() ? static_cast<int>(f) : -1,
                                                   static_cast<int>(state_.outer().fragments().size()));
          !st)
        return g_.failed(st.message(), state_.step(), pb::rank_status::FAILURE_DATA);
  return std::nullopt;
}

// After a step: DiLoCo's outer exchanges, the buffers, the sums, the
// digests, the report, an injected fault; at a boundary, at_boundary.
generation_end step_loop::after_step(int64_t attempted, int64_t window_start, clock_type::time_point t0) {
  // Every rank holds the same parameters after this step (streaming: the
  // same global parameters, and nothing is in flight).
  bool boundary = !diloco_;
  if (diloco_)
    if (auto ended = outer_steps(boundary)) return ended;
  if (diloco_ && alone_ && !state_.outer().in_flight().has_value()) boundary = true;
  const int64_t step = state_.step();
  if (boundary && !x_.moving_buffers.empty())
    if (auto ended = broadcast_buffers(step)) return ended;
  add_step_sums(step, attempted);
  if (boundary && due(cadence_.digest_every, step, window_start))
    if (auto ended = compare_digests(step)) return ended;
  acc_.set_step_s(acc_.step_s() + std::chrono::duration<double>(clock_type::now() - t0).count());
  if (first_ || cadence_.report_due(step) || (boundary && diloco_ && !alone_)) report_step(step);
  if (o_.fail_at_step >= 0 && step >= o_.fail_at_step && !rs_.injected && o_.fail_mode != fault_mode::rank_oom) {
    rs_.injected = true;
    inject_fault(o_.fail_mode, o_.fail_at_step);
  }
  if (boundary) return at_boundary(step, window_start);
  if (alone_) {
    eval_owed_ = eval_owed_ || cadence_.eval_due(step);
    checkpoint_owed_ = checkpoint_owed_ || cadence_.checkpoint_due(step);
  }
  return std::nullopt;
}

// The step's figures into the report's sums.
void step_loop::add_step_sums(int64_t step, int64_t attempted) {
  acc_.set_samples(acc_.samples() + r_.samples);
  if (r_.samples > 0) {
    loss_sum_steps_ += r_.loss_sum / static_cast<double>(r_.samples);
    ++loss_steps_;
  }
  acc_.set_allreduce_s(acc_.allreduce_s() + r_.allreduce_s);
  acc_.set_allreduce_exposed_s(acc_.allreduce_exposed_s() + r_.exposed_s);
  acc_.set_compute_s(acc_.compute_s() + r_.compute_s);
  acc_.set_update_s(acc_.update_s() + r_.update_s);
  acc_.set_gather_s(acc_.gather_s() + r_.gather_s);
  if (step > attempted) acc_.set_steps_covered(acc_.steps_covered() + 1);
}

// Rank 0's moving buffers to every rank (at a synchronisation boundary).
generation_end step_loop::broadcast_buffers(int64_t step) {
  c10d::BroadcastOptions bo;
  bo.rootRank = 0;
  torch::NoGradGuard no_grad;
  for (const auto& b : x_.moving_buffers) {
    std::vector<torch::Tensor> t{b};
    if (auto st = wait_work(g_.pg->broadcast(t, bo), deadline_in(g_.timeout), g_.abandon_now, "buffer broadcast"); !st)
      return g_.failed(st.message(), step);
  }
  return std::nullopt;
}

// The parameters' digest, compared across the ranks: a rank that drifted
// ends the job rather than train on silently.
generation_end step_loop::compare_digests(int64_t step) {
  const std::string digest = state_.params_digest();
  acc_.set_params_digest(digest);
  if (!g_.pg) return std::nullopt;
  auto agree = digests_agree(*g_.pg, digest, g_.timeout, g_.abandon_now);
  if (!agree) return g_.failed(agree.message(), step);
  if (!agree.value()) return g_.failed("parameters differ between ranks at step " + std::to_string(step), step, pb::rank_status::FAILURE_PARAMETERS_DIFFER);
  return std::nullopt;
}

// The step report: the sums since the last one, the data reader's figures
// and the bytes this rank holds.
void step_loop::report_step(int64_t step) {
  acc_.set_step(step);
  acc_.set_global_rank(g_.rank);
  acc_.set_world_size(g_.world);
  acc_.set_loss(r_.samples > 0 ? r_.loss_sum / static_cast<double>(r_.samples) : 0.0);
  acc_.set_loss_mean(loss_steps_ > 0 ? loss_sum_steps_ / static_cast<double>(loss_steps_) : acc_.loss());
  loss_sum_steps_ = 0;
  loss_steps_ = 0;
  acc_.set_lr(state_.lr_at(step - 1));
  acc_.set_data_wait_s(take_data_wait_s());
  if (auto d = process_shard_reader_stats()) {
    auto* x = acc_.mutable_data();
    x->set_bytes_s3(d->bytes_read_s3);
    x->set_bytes_local(d->bytes_read_local);
    x->set_cache_hits(d->cache_hits);
    x->set_cache_misses(d->cache_misses);
    x->set_shards_verified(d->shards_verified);
    x->set_shards_failed(d->shards_failed);
    x->set_read_ahead_depth(d->read_ahead_depth);
    x->set_cache_bytes(d->cache_used_bytes);
    x->set_cache_peak_bytes(d->cache_peak_bytes);
  }
  acc_.set_param_bytes(static_cast<uint64_t>(state_.optimizer().param_bytes()));
  // The optimizer's gradients and the reducer's bucket buffers kept between
  // steps (zero=0/1: a second copy of every gradient; zero=2: none, its
  // buffers live only while a step's buckets are in flight).
  acc_.set_grad_bytes(static_cast<uint64_t>(state_.optimizer().grad_bytes() + x_.buffer_bytes()));
  acc_.set_optimizer_state_bytes(static_cast<uint64_t>(state_.optimizer().state_bytes() + (state_.diloco() ? state_.outer().state_bytes() : 0)));
  if (auto held = rs_.saver->buffer_bytes()) acc_.set_checkpoint_buffer_bytes(*held);
  if (g_.cb.on_step) g_.cb.on_step(g_.gen, acc_);
  acc_.Clear();
  first_ = false;
}

// At a boundary (every rank holds the same parameters): the evaluation and
// the checkpoint that fell due, then the agreed stop or switch.
generation_end step_loop::at_boundary(int64_t step, int64_t window_start) {
  eval_at_step_.clear();
  // Every rank evaluates (their parameters are identical, so are the
  // results): a rank left waiting in the next collective while rank 0
  // evaluated alone would hit the collective timeout on a long
  // evaluation. Rank 0 reports.
  const bool eval_now = due(cadence_.eval_every, step, window_start) || std::exchange(eval_owed_, false);
  if (eval_now && step < cadence_.max_steps) {
    const double took = send_eval();
    if (auto ended = meet_after_eval(took)) return ended;
  } else if (eval_now) {
    send_eval();  // the last step: nothing collective follows but the digests' comparison, already done
  }
  if (due(cadence_.checkpoint_every, step, window_start) || std::exchange(checkpoint_owed_, false)) {
    write_checkpoint();
    last_ckpt_ = step;
  }
  if (agreed_.stop_agreed()) return stop_here(step, agreed_.final_checkpoint_wanted());
  if (agreed_.all_hold_newer_plan(g_.world)) return generation_outcome::next_plan;
  return std::nullopt;
}

double step_loop::send_eval() {
  const auto e0 = clock_type::now();
  auto ev = state_.evaluate();
  eval_at_step_ = ev.metrics;
  const double took = std::chrono::duration<double>(clock_type::now() - e0).count();
  if (g_.rank == 0 && g_.cb.on_eval) g_.cb.on_eval(g_.gen, eval_report_of(state_.step(), ev.metrics, ev.examples, took));
  return took;
}

// After an evaluation every rank ran: ranks finish it at different times (a
// loaded machine, a busier host), and the first would otherwise wait for
// the last in the next step's collective, under the collective timeout. They
// meet here instead, with room for the evaluation's own length. Dead peers
// are still noticed by the heartbeats (a newer plan abandons the wait).
generation_end step_loop::meet_after_eval(double eval_s) {
  if (!g_.pg) return std::nullopt;
  const auto room = std::chrono::milliseconds(static_cast<int64_t>(std::max(60.0, 10 * eval_s) * 1000));
  std::vector<torch::Tensor> t{torch::zeros({1})};
  if (auto st = wait_work(g_.pg->allreduce(t), deadline_in(g_.timeout + room), g_.abandon_now, "meeting after the evaluation"); !st)
    return g_.failed(st.message(), state_.step());
  return std::nullopt;
}

// Stops at `step` (all ranks agreed, or alone): a final checkpoint when
// asked for one, every part stored, then STATE_FINISHED.
generation_outcome step_loop::stop_here(int64_t step, bool final_checkpoint) {
  if (final_checkpoint && last_ckpt_ != step) write_checkpoint();
  rs_.saver->finish();
  g_.report_status(pb::rank_status::STATE_FINISHED, step, state_.params_digest());
  return generation_outcome::stopped;
}

void step_loop::write_checkpoint() { rs_.saver->write(state_, rs_.shards, g_, eval_at_step_); }

}  // namespace dtactor
