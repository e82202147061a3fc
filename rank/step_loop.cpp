#include "rank/step_loop.hpp"

#include "rank/zero3.hpp"

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
#include "rank/healing.hpp"
#include "rank/zero3.hpp"

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

step_loop::step_loop(generation_run& g, rank_state& rs, step_loop_options o) : g_(g), rs_(rs), state_(*rs.state), sync_(*rs.sync), o_(std::move(o)) {
  cadence_ = step_cadence_of(rs_.settings);
  last_ckpt_ = o_.state_checkpointed_at >= 0 && o_.state_checkpointed_at == state_.step() ? state_.step() : -1;
  alone_ = !g_.pg;
}

bool step_loop::due(int64_t every, int64_t step, int64_t window_start) const { return sync_.due(cadence_, every, step, window_start, alone_); }

bool step_loop::outer_pending() const { return sync_.outer_pending(state_); }

bool step_loop::in_flight() const { return sync_.in_flight(state_); }

generation_outcome step_loop::run() {
  if (auto ended = begin()) return *ended;
  finish_job_already_done();
  sync_.announce(g_, rs_);
  rs_.trained_gen = g_.gen;
  rs_.trained_rank = g_.rank;
  rs_.trained_world = g_.world;
  h_.window_began = clock_type::now();
  while (state_.step() < cadence_.max_steps || outer_pending()) {
    if (g_.quitting()) return generation_outcome::quit;
    if (g_.abandon_now()) return generation_outcome::next_plan;
    if (o_.stop_at_step >= 0 && state_.step() >= o_.stop_at_step && !o_.stop()) o_.request_final_stop();
    if (o_.fail_mode == fault_mode::rank_oom && o_.fail_at_step >= 0 && state_.step() >= o_.fail_at_step) inject_fault(o_.fail_mode, o_.fail_at_step);
    if (alone_ && o_.stop() && !in_flight()) return stop_here(state_.step(), o_.stop_checkpoint());
    // Alone, a newer plan (a drain: the world grows) is taken before the
    // next step: nobody to agree with, and the step's control word, sampled
    // when a step starts, would take it one step later.
    if (alone_ && o_.newer_plan() && !in_flight()) return generation_outcome::next_plan;
    if (rs_.window.replay_owed()) {
      if (auto ended = rs_.window.replay_next(g_, rs_, x_.host_sync.get())) return *ended;
      continue;
    }
    const auto t0 = clock_type::now();
    set_control();
    const int64_t attempted = state_.step();
    const int64_t window_start = sync_.window_start(state_, attempted);
    h_.r = training_state::dp_step{};
    if (!outer_pending())
      if (auto ended = inner_step()) return *ended;
    if (auto ended = after_step(attempted, window_start, t0)) return *ended;
  }
  rs_.saver->finish();
  g_.report_status(pb::rank_status::STATE_FINISHED, state_.step(), whole_params_digest());
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
  sync_.begin(state_);
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
  ready.set_group_s(g_.group_s);
  ready.set_drain_s(g_.drain_s);
  ready.set_state_bytes(g_.transfer_bytes);
  if (rs_.shards) {
    ready.set_optimizer_source(to_wire(g_.optimizer));
    ready.set_reshard_bytes(g_.reshard_bytes);
  }
  ready.set_state_transfer_s(g_.transfer_s);
  ready.set_healing(g_.healing && receives_while_training(*g_.healing));
  sync_.ready_fields(g_, ready);
  if (g_.cb.on_status) g_.cb.on_status(g_.gen, std::move(ready));
}

// The step's control (step_control.hpp) rides at the end of its last
// gradient bucket, SUM-reduced with it (no collective of its own). Every
// rank reads the same sums after the step: all switch once every rank holds
// the newer plan, all stop if any rank was asked to, at the same step
// boundary, and rank 0 writes the final checkpoint if any rank was asked
// for one. The reducer samples it again when it launches that bucket, at
// the end of backward: a plan or stop that came during the forward or
// backward pass is agreed after this step, not the next (the reducer dies with this loop's
// exchanges, so it never calls a loop that is gone).
void step_loop::set_control() {
  h_.mine = control_now();
  x_.sync().set_control(h_.mine);
  x_.sync().set_control_source([this] { return control_now(); });
}

step_control step_loop::control_now() const {
  step_control c;
  c.newer_plan = o_.newer_plan() ? 1.f : 0.f;
  c.stop = o_.stop() ? 1.f : 0.f;
  c.final_checkpoint = c.stop > 0 && o_.stop_checkpoint() ? 1.f : 0.f;
  c.writer_busy = rs_.settings.checkpoint.defer_while_writing && rs_.saver->writing() ? 1.f : 0.f;
  return c;
}

// The step's forward, backward and update (DiLoCo: an inner step of this
// rank's slice, of the world it was taken in when catching up).
generation_end step_loop::inner_step() {
  const int64_t attempted = state_.step();
  const auto [slice_rank, slice_world] = rs_.window.slice_of(attempted, g_.rank, g_.world);
  rs_.attempt = {attempted, g_.gen, slice_rank, slice_world};
  // Healing (rank/healing): a rank receiving the state computes once what
  // a forward reads of it has landed.
  if (g_.healing)
    if (auto st = forward_state_landed(*g_.healing, attempted, g_.abandon_now); !st) return g_.failed(st.message(), state_.step());
  auto r = sync_.step(g_, rs_, x_, slice_rank, slice_world);
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
  sync_.note_step(g_, rs_, attempted, slice_rank, slice_world);
  h_.r = *r;
  return std::nullopt;
}

// After a step: the strategy's exchanges, the buffers, the sums, the
// digests, the report, an injected fault; at a boundary, at_boundary.
generation_end step_loop::after_step(int64_t attempted, int64_t window_start, clock_type::time_point t0) {
  // Every rank holds the same parameters after this step (streaming: the
  // same global parameters, and nothing is in flight).
  bool boundary = false;
  if (auto ended = sync_.after_step(g_, rs_, x_, h_, cadence_, alone_, boundary)) return ended;
  const int64_t step = state_.step();
  if (boundary && !x_.moving_buffers.empty())
    if (auto ended = broadcast_buffers(step)) return ended;
  if (first_) rs_.saver->after_first_step(state_, rs_.shards, g_);
  add_step_sums(step, attempted);
  if (boundary && due(cadence_.digest_every, step, window_start))
    if (auto ended = compare_digests(step)) return ended;
  h_.acc.set_step_s(h_.acc.step_s() + std::chrono::duration<double>(clock_type::now() - t0).count());
  if (first_ || cadence_.report_due(step) || (boundary && sync_.reports_each_boundary() && !alone_)) report_step(step);
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
  h_.acc.set_samples(h_.acc.samples() + h_.r.samples);
  if (h_.r.samples > 0) {
    loss_sum_steps_ += h_.r.loss_sum / static_cast<double>(h_.r.samples);
    ++loss_steps_;
  }
  h_.acc.set_allreduce_s(h_.acc.allreduce_s() + h_.r.allreduce_s);
  h_.acc.set_allreduce_exposed_s(h_.acc.allreduce_exposed_s() + h_.r.exposed_s);
  h_.acc.set_compute_s(h_.acc.compute_s() + h_.r.compute_s);
  h_.acc.set_update_s(h_.acc.update_s() + h_.r.update_s);
  h_.acc.set_gather_s(h_.acc.gather_s() + h_.r.gather_s);
  h_.acc.set_pass_gather_s(h_.acc.pass_gather_s() + h_.r.pass_gather_s);
  if (step > attempted) h_.acc.set_steps_covered(h_.acc.steps_covered() + 1);
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
  auto d = digest();
  if (!d) return g_.failed(d.message(), step);
  const std::string digest = d.value();
  h_.acc.set_params_digest(digest);
  if (!g_.pg) return std::nullopt;
  auto agree = digests_agree(*g_.pg, digest, g_.timeout, g_.abandon_now);
  if (!agree) return g_.failed(agree.message(), step);
  if (!agree.value())
    return g_.failed("parameters differ between ranks at step " + std::to_string(step), step, pb::rank_status::FAILURE_PARAMETERS_DIFFER);
  return std::nullopt;
}

// The step report: the sums since the last one, the data reader's figures
// and the bytes this rank holds.
void step_loop::report_step(int64_t step) {
  h_.acc.set_step(step);
  h_.acc.set_global_rank(g_.rank);
  h_.acc.set_world_size(g_.world);
  h_.acc.set_loss(h_.r.samples > 0 ? h_.r.loss_sum / static_cast<double>(h_.r.samples) : 0.0);
  h_.acc.set_loss_mean(loss_steps_ > 0 ? loss_sum_steps_ / static_cast<double>(loss_steps_) : h_.acc.loss());
  loss_sum_steps_ = 0;
  loss_steps_ = 0;
  h_.acc.set_lr(state_.lr_at(step - 1));
  h_.acc.set_data_wait_s(take_data_wait_s());
  if (auto d = process_shard_reader_stats()) {
    auto* x = h_.acc.mutable_data();
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
  // train.zero = 3: the parameters resident between steps (its shards' and the root's).
  h_.acc.set_param_bytes(static_cast<uint64_t>(x_.gate ? x_.gate->resident_bytes() : state_.optimizer().param_bytes()));
  // The optimizer's gradients and the reducer's bucket buffers kept between
  // steps (zero=0/1: a second copy of every gradient; zero=2: none, its
  // buffers live only while a step's buckets are in flight).
  h_.acc.set_grad_bytes(static_cast<uint64_t>(state_.optimizer().grad_bytes() + x_.buffer_bytes()));
  h_.acc.set_optimizer_state_bytes(static_cast<uint64_t>(state_.optimizer().state_bytes() + (state_.diloco() ? state_.outer().state_bytes() : 0)));
  if (auto held = rs_.saver->buffer_bytes()) h_.acc.set_checkpoint_buffer_bytes(*held);
  if (g_.cb.on_step) g_.cb.on_step(g_.gen, h_.acc);
  h_.acc.Clear();
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
  if (due(cadence_.checkpoint_every, step, window_start) || std::exchange(checkpoint_owed_, false) || rs_.owed_checkpoint >= 0) checkpoint_at(step);
  if (h_.agreed.stop_agreed()) return stop_here(step, h_.agreed.final_checkpoint_wanted());
  if (h_.agreed.all_hold_newer_plan(g_.world)) return generation_outcome::next_plan;
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
  g_.report_status(pb::rank_status::STATE_FINISHED, step, whole_params_digest());
  return generation_outcome::stopped;
}

void step_loop::write_checkpoint() { rs_.saver->write(state_, rs_.shards, g_, eval_at_step_); }

// The parameters' digest (train.zero = 3: each unit gathered as the digest
// reaches it, and released after).
result<std::string> step_loop::digest() {
  if (!x_.gate) return state_.params_digest();
  std::string d = state_.params_digest([this](const torch::Tensor& t) { x_.gate->before_reading(t); });
  if (auto st = x_.gate->done_reading(); !st) return st.err();
  return d;
}

// The digest a rank reports when it finishes ("" when a gather failed).
std::string step_loop::whole_params_digest() {
  auto d = digest();
  return d ? d.value() : "";
}

// A checkpoint fell due (or is owed) at this boundary: written now or, with
// checkpoint.defer_while_writing, owed while some rank still stores the previous one
// (the step's control sums, the same on every rank: all defer alike; alone,
// its own writer). Then training goes on instead of waiting for that write,
// and checkpoints come as often as the store takes them. The last step's is
// never deferred (a stop's is stop_here's).
void step_loop::checkpoint_at(int64_t step) {
  const bool busy = alone_ ? rs_.saver->writing() : h_.agreed.some_writer_busy();
  if (rs_.settings.checkpoint.defer_while_writing && busy && step < cadence_.max_steps) {
    if (rs_.owed_checkpoint < 0) rs_.owed_checkpoint = step;
    if (g_.rank == 0 && !std::exchange(said_deferred_, true))
      std::fprintf(stderr,
                   "rank 0: generation %llu: checkpoint due at step %lld deferred: a rank still stores the previous one or still makes its part buffer; it is taken at the first "
                   "step boundary where none does (checkpoint.defer_while_writing; said once a generation)\n",
                   static_cast<unsigned long long>(g_.gen), static_cast<long long>(step));
    return;
  }
  const int64_t due_step = rs_.owed_checkpoint >= 0 && step < cadence_.max_steps ? rs_.owed_checkpoint : 0;
  rs_.owed_checkpoint = -1;
  rs_.saver->write(state_, rs_.shards, g_, eval_at_step_, due_step);
  last_ckpt_ = step;
}

}  // namespace dtactor
