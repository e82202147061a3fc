#include "rank/diloco_window.hpp"

#include <algorithm>
#include <cstdio>

#include "comm/communicator.hpp"
#include "comm/exchange_spec.hpp"
#include "data/sample_log.hpp"
#include "model/trainer.hpp"
#include "rank/agreement.hpp"
#include "rank/exchange_choice.hpp"
#include "rank/generation.hpp"
#include "rank/state_source.hpp"
#include "rank/step_policy.hpp"
#include "rank/sync_strategy.hpp"

namespace dtactor {

int64_t oldest_fragment_anchor(const outer_optimizer& o) {
  int64_t start = o.fragment_anchor(0);
  for (size_t f = 1; f < o.fragments().size(); ++f) start = std::min(start, o.fragment_anchor(f));
  return start;
}

void diloco_window::note_slice(int64_t start, window_slice s) {
  if (slices_anchor_ != start) {
    window_slices_.erase(std::remove_if(window_slices_.begin(), window_slices_.end(), [&](const window_slice& x) { return x.step < start; }),
                         window_slices_.end());
    slices_anchor_ = start;
  }
  window_slices_.push_back(std::move(s));
}

void diloco_window::from_checkpoint(int64_t start, int64_t step, int rank, int world) {
  window_slices_.clear();
  replays_.clear();
  slices_anchor_ = start;
  for (int64_t s = start; s < step; ++s) window_slices_.push_back({s, rank, std::max(1, world), {}});
}

void diloco_window::forget() {
  window_slices_.clear();
  replays_.clear();
  slices_anchor_ = -1;
}

std::pair<int, int> diloco_window::slice_of(int64_t step, int rank, int world) const {
  for (const auto& c : catch_up_)
    if (step < c.until) return {c.rank, c.world};
  return {rank, world};
}

result<std::vector<int64_t>> diloco_window::agreement_words(const rank_state& rs) const {
  training_state& state = *rs.state;
  const int64_t anchor = state.outer().anchor();
  const auto window = window_word(anchor, state.step());
  if (!window)
    return make_error("the DiLoCo window from step " + std::to_string(anchor) + " to " + std::to_string(state.step()) +
                      " cannot be agreed: a window holds fewer than " + std::to_string(int64_t{1} << window_offset_bits) +
                      " inner steps (train.sync_every)");
  return std::vector<int64_t>{*window, static_cast<int64_t>(rs.trained_gen)};
}

generation_end diloco_window::agree(generation_run& g, rank_state& rs, bool own_window, const std::vector<int64_t>& agreed) {
  training_state& state = *rs.state;
  // The workers go on from the furthest step any of them holding the
  // agreed anchor reached in the window (no one's inner steps are undone);
  // one behind catches up on the steps its peers took, or skips them
  // (below). Agreed in the generation's one round (agreement_words).
  const int64_t furthest = furthest_of_window_word(agreed.at(0));
  const uint64_t newest_trained = static_cast<uint64_t>(agreed.at(1));
  g.window_steps = furthest - state.outer().anchor();
  // A rank that kept its window and trained in the generation its peers
  // took those steps in catches up on its own slices of that generation's
  // world (no collective runs between boundaries, so it can): its samples
  // of those steps are trained once, as if nothing had happened. With
  // hosts as workers (their ranks step together through the host's
  // reducer) and without such a generation, it skips them.
  // (Steps it was still catching up on in that generation keep the
  // slicing of theirs.)
  const int64_t own = state.step();
  while (!catch_up_.empty() && catch_up_.front().until <= own) catch_up_.erase(catch_up_.begin());
  const bool catch_up =
      own_window && furthest > own && rs.trained_world > 0 && rs.trained_gen == newest_trained && rs.settings.modes.diloco_worker != diloco_worker_kind::host;
  if (catch_up) {
    if (catch_up_.empty() || catch_up_.back().until < furthest) catch_up_.push_back({furthest, rs.trained_rank, rs.trained_world});
  } else {
    catch_up_.clear();
    g.skipped_steps = furthest - own;
    state.skip_to(furthest);
  }
  return replay_owed_slices(g, rs, furthest);
}

// Ranks as workers, after the agreement on the furthest step: the slices of
// the window's steps (the oldest fragment anchor to furthest) that no
// survivor trained or will train catching up were a lost worker's (trained
// and gone with it, or never reached). They are found from what every
// survivor holds, in two MAX allreduces (each step's world size, then which
// fragments of each slice someone holds), dealt round-robin over the new
// world and trained again before the next boundary (training_state::
// train_step with a replayed_slice), so that every sample of the window
// reaches every fragment's next outer step once. Streaming: a slice of a
// step before fragment f's anchor is in f already (the lost worker's
// pseudo-gradient was in that exchange), so it is owed to the other
// fragments only. Every rank computes the same list.
generation_end diloco_window::replay_owed_slices(generation_run& g, rank_state& rs, int64_t furthest) {
  training_state& state = *rs.state;
  const outer_optimizer& outer = state.outer();
  replays_.clear();
  const window_span w{oldest_fragment_anchor(outer), furthest};
  if (w.len() <= 0) return std::nullopt;
  std::vector<int64_t> anchors;
  for (size_t f = 0; f < outer.fragments().size(); ++f) anchors.push_back(outer.fragment_anchor(f));
  const auto held = held_slices(window_slices_, catch_up_, state.step(), w);
  const char* what = "agreement on the window's slices";
  // 1. Each step's world size (the world its peers took it in); 2. which
  // fragments of each slice (of that step's world only) someone holds.
  auto worlds = slice_world_words(held, w);
  if (auto st = max_allreduce(*g.pg, worlds, deadline_in(g.timeout), g.abandon_now, what); !st) return g.failed(st.message(), state.step());
  auto bits = slice_fragment_words(held, w, worlds, static_cast<int64_t>(anchors.size()));
  if (auto st = max_allreduce(*g.pg, bits, deadline_in(g.timeout), g.abandon_now, what); !st) return g.failed(st.message(), state.step());
  // Who replays: the workers, each rank (or, with hosts as workers, each
  // host: its ranks together, each a part of the slice), round-robin in
  // the order of their lowest rank. With hosts, the leaders are marked in
  // one more allreduce (a host of one rank is a worker of its own).
  replay_unit u{g.world, g.rank, 0, 1};
  if (rs.settings.modes.diloco_worker == diloco_worker_kind::host) {
    const bool host = host_worker(g, rs);
    const int leader = host ? g.exchange.host_members.front() : g.rank;
    std::vector<int64_t> leaders(static_cast<size_t>(g.world), 0);
    leaders[static_cast<size_t>(leader)] = 1;
    if (auto st = max_allreduce(*g.pg, leaders, deadline_in(g.timeout), g.abandon_now, what); !st) return g.failed(st.message(), state.step());
    count_units(leaders, leader, u);
    if (host) {
      const auto& m = g.exchange.host_members;
      u.parts = static_cast<int>(m.size());
      u.part = static_cast<int>(std::find(m.begin(), m.end(), g.rank) - m.begin());
    }
  }
  auto dealt = deal_owed_slices(w, worlds, bits, anchors, u);
  replays_ = std::move(dealt.mine);
  g.replayed_slices = dealt.owed;
  return std::nullopt;
}

void diloco_window::announce(const generation_run& g, training_state& state) const {
  if (!state.diloco()) return;
  const auto gen = static_cast<unsigned long long>(g.gen);
  if (g.skipped_steps > 0 || g.window_steps > 0)
    std::fprintf(stderr, "rank %d: generation %llu: DiLoCo window goes on at step %lld, %lld step(s) after its anchor (this rank skipped %lld)\n",
                 g.rank, gen, static_cast<long long>(state.step()), static_cast<long long>(g.window_steps), static_cast<long long>(g.skipped_steps));
  if (!catch_up_.empty())
    std::fprintf(stderr, "rank %d: generation %llu: DiLoCo: catching up on steps %lld to %lld (its peers took them), on its own slices of them\n",
                 g.rank, gen, static_cast<long long>(state.step()), static_cast<long long>(catch_up_.back().until - 1));
  if (!replays_.empty())
    std::fprintf(stderr,
                 "rank %d: generation %llu: DiLoCo: %lld slice(s) of the window's steps %lld to %lld were held by no survivor (a lost worker's); "
                 "this rank trains %zu of them again before the boundary%s\n",
                 g.rank, gen, static_cast<long long>(g.replayed_slices), static_cast<long long>(oldest_fragment_anchor(state.outer())),
                 static_cast<long long>(state.outer().anchor() + g.window_steps - 1), replays_.size(),
                 replays_.front().parts > 1 ? " (its host's ranks together, each a part of every slice)" : "");
}

generation_end diloco_window::replay_next(generation_run& g, rank_state& rs, grad_sync* host_sync) {
  training_state& state = *rs.state;
  const window_slice x = replays_.front();
  const bool by_host = x.parts > 1 && host_sync;
  auto rr = state.train_step(step_context::replay_of(x.rank, x.world, {x.step, x.fragments, by_host ? x.part : 0, by_host ? x.parts : 1},
                                                     by_host ? host_sync : nullptr));
  if (!rr) return g.failed(rr.message(), state.step());
  // A host's replay is one line, its first rank's, of the whole slice.
  if (x.part == 0) {
    const auto whole = state.order().rank_slice(x.step, x.rank, x.world);
    if (auto st = rs.log_samples(x.step, g.gen, x.rank, x.world, x.fragments, x.parts > 1 ? &whole : nullptr); !st)
      return g.failed(st.message(), state.step(), pb::rank_status::FAILURE_DATA);
  }
  note_slice(oldest_fragment_anchor(state.outer()), x);
  replays_.erase(replays_.begin());
  return std::nullopt;
}

namespace {

// Streaming DiLoCo: one reducer a fragment (its parameters only). Only
// with host workers and an overlap do the fragments go over the process
// group: the host's per-step reducer uses the segment while a fragment is
// in flight.
void fragment_reducers(const generation_run& g, training_state& state, exchanges& x) {
  std::vector<torch::Tensor> trained;
  for (auto& p : state.the_task().module()->parameters())
    if (p.requires_grad()) trained.push_back(p);
  grad_sync_options fo = x.options;
  if (x.fragments_off_shm) {
    fo.exchange.transport = exchange_transport::process_group;
    fo.shm = nullptr;
    fo.hosts = c10::intrusive_ptr<c10d::ProcessGroup>();
  }
  for (const auto& fr : state.outer().fragments()) {
    std::vector<torch::Tensor> part(trained.begin() + static_cast<std::ptrdiff_t>(fr.first_param),
                                    trained.begin() + static_cast<std::ptrdiff_t>(fr.first_param + fr.params));
    x.syncs.push_back(std::make_unique<grad_sync>(std::move(part), g.pg, fo));
  }
}

// train.diloco_worker = host: the ranks of a host are one worker,
// synchronous inside through the host's segment; or why this rank is a
// worker of its own.
void host_reducer(const generation_run& g, training_state& state, bool host_workers, exchanges& x) {
  if (host_workers) {
    grad_sync_options ho;
    ho.bucket_bytes = x.options.bucket_bytes;
    ho.spin_wait = x.options.spin_wait;
    ho.timeout = x.options.timeout;
    ho.abandon = x.options.abandon;
    ho.shm = g.exchange.shm;
    ho.exchange.transport = exchange_transport::host;
    x.host_sync = std::make_unique<grad_sync>(state.the_task().module()->parameters(), c10::intrusive_ptr<c10d::ProcessGroup>(), ho);
  } else {
    x.host_workers_why_not = g.exchange.host_ranks <= 1   ? "this rank is alone on its host"
                             : g.exchange.why_not.empty() ? "no shared memory"
                                                          : g.exchange.why_not;
  }
}

// train.sync = diloco: inner steps without a collective; at each boundary
// the outer step (its exchange carries the step control), and only there
// what needs every rank to hold the same parameters (buffers, digests,
// evaluation, checkpoints, stop, switch). Streaming: one exchange a
// fragment, maybe overlapped with the next steps.
class sync_diloco final : public sync_strategy {
 public:
  int64_t held_step(training_state& state) const override { return state.outer().anchor(); }
  std::function<void()> keep_through_transfer(rank_state& rs, bool holds_agreed) override;
  result<std::vector<int64_t>> agreement_words(const rank_state& rs) const override { return rs.window.agreement_words(rs); }
  generation_end after_agreement(generation_run& g, rank_state& rs, bool own_window, const std::vector<int64_t>& agreed) override {
    return rs.window.agree(g, rs, own_window, agreed);
  }
  void begin(training_state& state) override { state.outer().drop_flight(); }
  void announce(const generation_run& g, rank_state& rs) const override { rs.window.announce(g, *rs.state); }
  void ready_fields(const generation_run& g, pb::rank_status& ready) const override {
    ready.set_window_steps(g.window_steps);
    ready.set_skipped_steps(g.skipped_steps);
    ready.set_replayed_slices(g.replayed_slices);
  }
  bool outer_pending(training_state& state) const override { return state.outer().due(state.step()) || state.outer().lands(state.step()); }
  bool in_flight(training_state& state) const override { return state.outer().in_flight().has_value(); }
  int64_t window_start(training_state& state, int64_t) const override { return state.outer().anchor(); }
  bool due(const step_cadence& c, int64_t every, int64_t step, int64_t window_start, bool alone) const override {
    if (alone) return c.due(every, step);
    if (step >= c.max_steps) return true;
    return every > 0 && step / every > window_start / every;
  }
  void add_reducers(const generation_run& g, rank_state& rs, exchanges& x) override {
    training_state& state = *rs.state;
    const bool host_workers = host_worker(g, rs);
    x.streaming = state.outer().streaming();
    x.fragments_off_shm = x.streaming && host_workers && state.outer().options().overlap > 0;
    if (x.streaming)
      fragment_reducers(g, state, x);
    else
      x.syncs.push_back(std::make_unique<grad_sync>(state.the_task().module()->parameters(), g.pg, x.options));
    if (rs.settings.modes.diloco_worker == diloco_worker_kind::host && g.world > 1) host_reducer(g, state, host_workers, x);
  }
  result<training_state::dp_step> step(const generation_run& g, rank_state& rs, exchanges& x, int slice_rank, int slice_world) override {
    if (x.host_sync) return rs.state->train_step(step_context::diloco_host(g.rank, g.world, *x.host_sync, g.exchange.host_members));
    return rs.state->train_step(step_context::diloco_inner(slice_rank, slice_world));
  }
  // With a group, the window's slices are noted (diloco_window::agree).
  void note_step(const generation_run& g, rank_state& rs, int64_t attempted, int slice_rank, int slice_world) override {
    if (g.pg) rs.window.note_slice(oldest_fragment_anchor(rs.state->outer()), {attempted, slice_rank, slice_world, {}});
  }
  generation_end after_step(generation_run& g, rank_state& rs, exchanges& x, step_in_hand& h, const step_cadence& c, bool alone,
                            bool& boundary) override {
    boundary = false;
    if (auto ended = outer_steps(g, rs, x, h, c.max_steps, boundary)) return ended;
    if (alone && !rs.state->outer().in_flight().has_value()) boundary = true;
    return std::nullopt;
  }
  bool reports_each_boundary() const override { return true; }
  bool writes_worker_sections(const job_modes& modes, int world) const override {
    return world > 1 && modes.checkpoint_workers == diloco_checkpoint_workers::all;
  }
  // Global rank 0 read the checkpoint and sent its state to all; the
  // others take their own inner state from their sections.
  generation_end take_own_section(start_context& c) override {
    if (c.g.pg && c.g.rank != 0 && c.g.source == ev::state_source::disk && !c.own_window) return checkpoint_source::worker_section(c);
    return std::nullopt;
  }

 private:
  static void record(const outer_step_result& o, exchanges& x, step_in_hand& h);
  generation_end outer_steps(generation_run& g, rank_state& rs, exchanges& x, step_in_hand& h, int64_t max_steps, bool& boundary);
};

std::function<void()> sync_diloco::keep_through_transfer(rank_state& rs, bool holds_agreed) {
  training_state& state = *rs.state;
  if (!holds_agreed)
    return [&rs, &state] {
      torch::NoGradGuard no_grad;
      state.outer().reset_to_global();
      state.state_loaded(state.outer().anchor());
      rs.window.forget();
    };
  auto kept = std::make_shared<std::vector<std::pair<torch::Tensor, torch::Tensor>>>();  // (live, copy)
  const int64_t own_step = state.step(), own_inner_steps = state.optimizer().steps_taken();
  {
    torch::NoGradGuard no_grad;
    for (auto& st : state.state_tensors())
      if (st.name.rfind("outer/", 0) != 0) kept->emplace_back(st.t, st.t.clone());
  }
  return [kept, &state, own_step, own_inner_steps] {
    torch::NoGradGuard no_grad;
    for (auto& [live, copy] : *kept) live.copy_(copy);
    state.state_loaded(own_step);
    state.optimizer().set_steps_taken(own_inner_steps);
  };
}

void sync_diloco::record(const outer_step_result& o, exchanges& x, step_in_hand& h) {
  using clock_type = std::chrono::steady_clock;
  h.r.allreduce_s += o.exchange_s;
  h.r.exposed_s += o.exposed_s;
  h.acc.set_outer_steps(h.acc.outer_steps() + 1);
  h.acc.set_outer_payload_bytes(h.acc.outer_payload_bytes() + static_cast<uint64_t>(o.payload_bytes));
  h.acc.set_outer_exchange_s(h.acc.outer_exchange_s() + o.exchange_s);
  h.acc.set_pseudo_grad_norm(o.pseudo_grad_norm);
  h.acc.set_outer_inner_steps(static_cast<uint64_t>(o.inner_steps));
  h.acc.set_outer_window_s(std::chrono::duration<double>(clock_type::now() - h.window_began).count());
  h.window_began = clock_type::now();
  h.agreed = x.syncs[o.fragment]->control();
}

// After a step: the exchange in flight that lands now, then the fragments
// due (each exchange carries the step control). `boundary` is set when one
// landed: every rank then holds the same global parameters.
generation_end sync_diloco::outer_steps(generation_run& g, rank_state& rs, exchanges& x, step_in_hand& h, int64_t max_steps, bool& boundary) {
  training_state& state = *rs.state;
  std::vector<size_t> landed_fragments;
  auto ex = state.outer().after_inner_step(
      state.step(), max_steps, [&x](size_t f) -> grad_sync& { return *x.syncs[f]; }, h.mine,
      [&](const outer_step_result& o) {
        if (!o.landed) return;
        record(o, x, h);
        landed_fragments.push_back(o.fragment);
        boundary = true;
      });
  if (!ex) return g.failed(ex.message(), state.step());
  // data.sample_log: this rank's lines before the landed pseudo-gradient's
  // step are in that fragment of the global parameters.
  if (rs.samples_log)
    for (size_t f : landed_fragments)
      if (auto st =
              rs.samples_log->append_synced(state.outer().fragment_anchor(f), g.gen, g.rank, g.world,
                                            state.outer().streaming() ? static_cast<int>(f) : -1, static_cast<int>(state.outer().fragments().size()));
          !st)
        return g.failed(st.message(), state.step(), pb::rank_status::FAILURE_DATA);
  return std::nullopt;
}

}  // namespace

std::unique_ptr<sync_strategy> make_sync_diloco() { return std::make_unique<sync_diloco>(); }

}  // namespace dtactor
