#include "rank/state_source.hpp"

#include <cstdio>

#include "checkpoint.pb.h"
#include "comm/communicator.hpp"
#include "model/trainer.hpp"
#include "rank/agreement.hpp"
#include "rank/generation.hpp"
#include "rank/state_io.hpp"
#include "rank/sync_strategy.hpp"
#include "rank/zero.hpp"
#include "storage/checkpoint_store.hpp"

namespace dtactor {

starting_state::starting_state(generation_run& g, rank_state& rs) : g_(g), rs_(rs), state_(*rs.state) {}

int64_t starting_state::held_step() const { return rs_.sync->held_step(state_); }

// What a generation loads of a checkpoint (load), and what
// the load found.
struct starting_state::checkpoint_load {
  int64_t step = -1;  // the plan's choice
  load_which which = load_which::all;
  bool own_section = false;  // DiLoCo: this rank's own section instead of `which`
  pb::checkpoint_meta meta;  // its manifest, once read
  uint64_t bytes_read = 0;   // of parts
  bool loaded = false;       // own_section: the checkpoint has one for this rank
};

// The generation's starting state: the newest disk checkpoint when the plan
// carries one (everyone was lost, or the job resumes) and global rank 0
// holds nothing newer; then the highest step any member holds, taken from
// the lowest rank holding it. Returns nothing to go on, or the outcome that
// ends the generation.
generation_end starting_state::agree() {
  // Sharded from the first generation on (a fresh rank holds all of it), so
  // that every rank's stream has the same replicated part.
  if (rs_.cfg->get_int("train.zero") >= 1 && !state_.optimizer().sharded()) state_.shard_optimizer({{0, state_.optimizer().total_elements()}});
  const bool diloco = state_.diloco();
  if (g_.rank == 0 && g_.plan.checkpoint_step() > held_step())
    if (auto ended = from_plan_checkpoint()) return ended;
  if (rs_.cfg->get_int("train.zero") >= 2)
    if (auto ended = finish_zero2_step()) return ended;
  const int64_t held_before = state_.step();  // what this rank holds before any transfer
  bool own_window = true;                     // DiLoCo: this rank goes on with its own window (it held the agreed anchor)
  if (g_.pg)
    if (auto ended = take_agreed_state(own_window)) return ended;
  if (diloco && g_.pg && g_.rank != 0 && g_.source == ev::state_source::disk && !own_window)
    if (auto ended = worker_section_from_checkpoint()) return ended;
  if (rs_.cfg->get_int("train.zero") >= 1)
    if (auto ended = shard_state(held_before == state_.step())) return ended;
  if (g_.pg)
    if (auto ended = rs_.sync->after_agreement(g_, rs_, own_window, strategy_agreed_)) return ended;
  if (g_.source == ev::state_source::local && state_.step() == 0) g_.source = ev::state_source::fresh;
  return std::nullopt;
}

// Nobody alive holds state (agree, global rank 0): the checkpoint the
// plan names, read from the store by this rank itself. Sharded (train.zero
// >= 1): its replicated part only; every rank reads its own shards after
// the agreement (shard_state).
generation_end starting_state::from_plan_checkpoint() {
  checkpoint_load l;
  l.step = g_.plan.checkpoint_step();
  l.which = rs_.cfg->get_int("train.zero") >= 1 ? load_which::replicated : load_which::all;
  if (auto ended = load(l)) return ended;
  g_.source = ev::state_source::disk;
  rs_.window.clear_catch_up();
  if (state_.diloco()) rs_.window.from_checkpoint(oldest_fragment_anchor(state_.outer()), state_.step(), 0, l.meta.world_size());
  return std::nullopt;
}

// train.zero >= 2, before the agreement: the step whose gradient-norm
// allreduce failed here after other ranks completed it is finished (this
// rank's shards updated), or dropped without a group.
generation_end starting_state::finish_zero2_step() {
  if (!g_.pg) {
    state_.drop_interrupted_step();
  } else {
    auto finished = finish_interrupted_step(*g_.pg, state_, g_.timeout, g_.abandon_now);
    if (!finished) return g_.failed(finished.message(), state_.step());
    // The samples are the attempt's, of the generation that computed them.
    if (*finished && rs_.attempt.step == state_.step() - 1)
      if (auto st = rs_.log_samples(rs_.attempt.step, rs_.attempt.gen, rs_.attempt.rank, rs_.attempt.world); !st)
        return g_.failed(st.message(), state_.step(), pb::rank_status::FAILURE_DATA);
    if (*finished)
      std::fprintf(stderr,
                   "rank %d: generation %llu: finished step %lld's update of this rank's shards (its gradient-norm allreduce failed here "
                   "and completed on other ranks, which stepped theirs)\n",
                   g_.rank, static_cast<unsigned long long>(g_.gen), static_cast<long long>(state_.step() - 1));
  }
  return std::nullopt;
}

// The generation's one agreement round (rank/agreement.hpp), one MAX
// allreduce of every piece's words: the state (the highest step, DiLoCo:
// anchor, any member holds and the lowest rank holding it, the root),
// whether that state is the plan's checkpoint global rank 0 read (the
// optimizer shards' source), and the sync strategy's words. When not
// everyone holds the agreed state, it is broadcast from the root, and the
// strategy keeps what this rank keeps through it. `own_window` (DiLoCo):
// whether this rank keeps its window's own progress.
generation_end starting_state::take_agreed_state(bool& own_window) {
  agreement_round round;
  const auto [w0, w1] = agreement_words(held_step(), g_.rank);
  const auto state_slot = round.add({w0, w1});
  const auto disk_slot = round.add({disk_word(g_.source == ev::state_source::disk, held_step())});
  auto strategy_words = rs_.sync->agreement_words(rs_);
  if (!strategy_words) return g_.failed(strategy_words.message(), state_.step());
  const auto strategy_slot = round.add(*strategy_words);
  if (auto st = max_allreduce(*g_.pg, round.words(), deadline_in(g_.timeout), g_.abandon_now, "state agreement"); !st)
    return g_.failed(st.message(), state_.step());
  const auto agreed_state = round.read(state_slot);
  const auto a = read_agreement(agreed_state[0], agreed_state[1]);
  agreed_from_disk_ = agreed_from_disk(round.read(disk_slot)[0], a);
  strategy_agreed_ = round.read(strategy_slot);
  g_.root = a.root;
  if (a.everyone_holds_it()) return std::nullopt;
  const bool holds_agreed = held_step() == a.max_step;
  own_window = holds_agreed;
  auto after_transfer = rs_.sync->keep_through_transfer(rs_, holds_agreed);
  // In place, in chunks, over the data plane (bounded extra memory).
  int64_t from_disk = g_.source == ev::state_source::disk ? 1 : 0;
  auto sent = broadcast_state(*g_.pg, g_.root, state_, g_.timeout, g_.abandon_now, from_disk);
  if (!sent) return g_.failed(sent.message(), state_.step());
  after_transfer();
  if (g_.rank != g_.root) {
    // The generation's state came from the store when its root loaded
    // it from there (every rank says so: one story in the journal).
    g_.source = from_disk ? ev::state_source::disk : ev::state_source::peer;
    g_.transfer_bytes = sent->bytes;
    g_.transfer_s = sent->seconds;
  }
  return std::nullopt;
}

// DiLoCo, a generation whose state came from a checkpoint (global rank 0
// read it and sent it to all): a rank other than 0 takes its own inner
// state (parameters, buffers, inner moments) from its section of the
// checkpoint when there is one, so that a resume at the same world size is
// exact; without one (a checkpoint of fewer workers, or diloco_workers =
// first) it goes on with rank 0's.
generation_end starting_state::worker_section_from_checkpoint() {
  checkpoint_load l;
  l.step = g_.plan.checkpoint_step();
  l.own_section = true;
  if (auto ended = load(l)) return ended;
  if (l.loaded) state_.state_loaded(l.meta.step());
  // Its own section: its own slices of the checkpoint's window; else rank 0's.
  rs_.window.from_checkpoint(oldest_fragment_anchor(state_.outer()), state_.step(), l.loaded ? g_.rank : 0, l.meta.world_size());
  return std::nullopt;
}

// The one path of every checkpoint load: open the plan's store, read the
// manifest of the step the plan names, check that it fits this job, then
// read what the load planner names for this rank (rank/state_io's
// load_checkpoint and load_worker_section, storage/checkpoint_plan).
generation_end starting_state::load(checkpoint_load& l) {
  const std::string name = manifest_name(l.step);
  const std::string where = g_.plan.checkpoint_store() + "/" + name;
  auto store = checkpoint_store::open_readonly(g_.plan.checkpoint_store(), rs_.cfg->get_string("checkpoint.s3_endpoint"));
  if (!store) return g_.failed("checkpoint store: " + store.message(), state_.step());
  auto meta = store->read_manifest(name);
  if (!meta)
    return g_.checkpoint_unusable(l.step, "checkpoint " + where + ": " + meta.message(), meta.code() == errc::corrupt_checkpoint, state_.step());
  if (auto st = check_checkpoint_compatible(meta.value(), *rs_.cfg, where); !st)
    return g_.checkpoint_unusable(l.step, st.message(), true, state_.step());
  status st;
  if (l.own_section) {
    auto section = load_worker_section(state_, store.value(), meta.value(), g_.rank);
    if (!section) st = section.err();
    l.loaded = section && *section;
  } else {
    st = load_checkpoint(state_, store.value(), meta.value(), l.which, &l.bytes_read);
    l.loaded = st.ok();
  }
  if (!st) return g_.checkpoint_unusable(l.step, "checkpoint " + where + ": " + st.message(), st.code() == errc::corrupt_checkpoint, state_.step());
  l.meta = std::move(meta.value());
  return std::nullopt;
}

// train.zero >= 1, after the agreement: this generation's shard plan, and
// every rank's optimizer moments resharded to it from whoever holds them at
// the agreed step. When both holders of some shard were lost, the newest
// committed checkpoint: global rank 0 loads it whole and the others take
// their shards from it.
generation_end starting_state::shard_state(bool holds_current) {
  flat_adamw& opt = state_.optimizer();
  const int64_t total = opt.total_elements();
  std::vector<std::string> nodes(static_cast<size_t>(g_.world));
  for (const auto& r : g_.plan.ranks())
    if (r.global_rank() >= 0 && r.global_rank() < g_.world) nodes[static_cast<size_t>(r.global_rank())] = r.node_id();
  const int64_t want_replicas = rs_.cfg->get_int("train.zero_replicas");
  const int replicas = want_replicas > 0 ? static_cast<int>(want_replicas) : default_replicas(nodes);
  auto plan = make_shard_plan(total, nodes, replicas);
  // The agreed state came from a checkpoint: each rank reads its own
  // shards from it. Agreed (take_agreed_state), since the rank that read it
  // may be the only one to know (the others held that step already).
  const bool from_disk = g_.pg ? agreed_from_disk_ : g_.source == ev::state_source::disk;
  if (from_disk) return shards_from_checkpoint(plan, g_.plan.checkpoint_step());
  std::string missing;
  if (!g_.pg) {
    // Alone: this rank must hold everything.
    const auto held = opt.held_ranges();
    if (held == std::vector<std::pair<int64_t, int64_t>>{{0, total}} || !opt.sharded()) {
      state_.shard_optimizer({{0, total}});
      rs_.shards = plan;
      return std::nullopt;
    }
    missing = "elements outside this rank's shards";
  } else {
    auto r = reshard_optimizer(*g_.pg, opt, plan, holds_current, state_.params_mixed(), g_.timeout, g_.abandon_now);
    if (!r) {
      (void)state_.reset_state();  // half-moved shards: this rank holds nothing current
      return g_.failed(r.message(), state_.step());
    }
    if (r->complete) {
      state_.clear_params_mixed();
      rs_.shards = plan;
      g_.reshard_bytes = r->bytes_in + r->bytes_out;
      if (r->moments_in > 0) g_.optimizer = ev::optimizer_source::replica;
      return std::nullopt;
    }
    missing = r->missing;
  }
  return shards_from_fallback(plan, missing);
}

// Some optimizer state is lost with its holders (shard_state: `missing`):
// back to the checkpoint the plan names for that (the coordinator's choice,
// never this rank's). Global rank 0 reads its replicated part and sends it
// to all; then every rank reads its own shards.
generation_end starting_state::shards_from_fallback(const shard_plan& plan, const std::string& missing) {
  std::fprintf(stderr, "rank %d: generation %llu: optimizer state of %s was held only by lost ranks; resuming from the plan's checkpoint\n", g_.rank,
               static_cast<unsigned long long>(g_.gen), missing.c_str());
  // With none committed, the job starts over from step 0 (every step is
  // lost, and the journal's recovery says so): failing instead would fail
  // the same way in every generation after.
  const int64_t fallback = g_.plan.has_fallback_checkpoint_step() ? g_.plan.fallback_checkpoint_step() : -1;
  bool have_checkpoint = fallback >= 0;
  if (g_.rank == 0 && have_checkpoint) {
    checkpoint_load l;
    l.step = fallback;
    l.which = load_which::replicated;
    if (auto ended = load(l)) return ended;
  } else if (g_.rank == 0) {
    std::fprintf(stderr,
                 "rank 0: generation %llu: the plan names no checkpoint to go back to (none is committed in %s that no rank refused): "
                 "the job starts over from step 0\n",
                 static_cast<unsigned long long>(g_.gen), g_.plan.checkpoint_store().c_str());
    if (auto st = state_.reset_state(); !st) return g_.failed("starting over: " + st.message(), state_.step());
  } else {
    (void)state_.reset_state();
  }
  g_.source = ev::state_source::disk;
  if (g_.pg) {
    int64_t from_disk = have_checkpoint ? 1 : 0;
    auto sent = broadcast_state(*g_.pg, 0, state_, g_.timeout, g_.abandon_now, from_disk);
    if (!sent) return g_.failed(sent.message(), state_.step());
    g_.root = 0;
    have_checkpoint = from_disk != 0;
  }
  if (!have_checkpoint) {
    // reset_state() zeroed every rank's moments: a fresh optimizer.
    state_.shard_optimizer(plan.ranges_of(g_.rank));
    state_.clear_params_mixed();
    rs_.shards = plan;
    g_.source = ev::state_source::fresh;
    g_.optimizer = ev::optimizer_source::restart;
    return std::nullopt;
  }
  return shards_from_checkpoint(plan, fallback);
}

// Every rank of a generation whose state came from the checkpoint at `step`
// (the plan's: global rank 0 loaded it and sent it to all): its own shards'
// moments, read from the parts that hold them (each part whole, its
// checksum checked), not the whole checkpoint.
generation_end starting_state::shards_from_checkpoint(const shard_plan& plan, int64_t step) {
  if (step != state_.step())
    return g_.failed("the agreed state is at step " + std::to_string(state_.step()) + ", the plan's checkpoint at step " + std::to_string(step),
                     state_.step());
  state_.shard_optimizer(plan.ranges_of(g_.rank));
  checkpoint_load l;
  l.step = step;
  l.which = load_which::shards;
  if (auto ended = load(l)) return ended;
  std::fprintf(stderr, "rank %d: generation %llu: optimizer shards read from the checkpoint at step %lld: %llu of its %llu bytes\n", g_.rank,
               static_cast<unsigned long long>(g_.gen), static_cast<long long>(state_.step()), static_cast<unsigned long long>(l.bytes_read),
               static_cast<unsigned long long>(l.meta.state_bytes()));
  state_.clear_params_mixed();
  rs_.shards = plan;
  g_.optimizer = ev::optimizer_source::checkpoint;
  g_.reshard_bytes = l.bytes_read;
  return std::nullopt;
}

}  // namespace dtactor
