#include "rank/state_source.hpp"

#include <cstdio>

#include "comm/communicator.hpp"
#include "model/trainer.hpp"
#include "net/plan_layout.hpp"
#include "rank/generation.hpp"
#include "rank/group_builder.hpp"
#include "rank/healing.hpp"
#include "rank/state_io.hpp"
#include "rank/sync_strategy.hpp"
#include "rank/zero.hpp"
#include "rank/zero3.hpp"

namespace dtactor {

namespace {

// Everyone holds the agreed step: nothing moves.
class own_state final : public state_source {
 public:
  generation_end take(start_context&) override { return std::nullopt; }
};

// Not everyone holds the agreed step: the state is broadcast from the root
// (in place, in chunks, over the data plane: bounded extra memory), and the
// sync strategy keeps what this rank keeps through it.
class peer_state final : public state_source {
 public:
  generation_end take(start_context& c) override {
    generation_run& g = c.g;
    const bool holds_agreed = c.rs.sync->held_step(c.state) == c.agreed.max_step;
    c.own_window = holds_agreed;
    auto after_transfer = c.rs.sync->keep_through_transfer(c.rs, holds_agreed);
    int64_t from_disk = g.source == ev::state_source::disk ? 1 : 0;
    // Moments this rank held are not the agreed step's: its windows come
    // from the reshard (replica_shards) or the checkpoint, not from these.
    // Dropped first, the layout below does not make a fresh rank's lazy
    // whole-model moments real (1.6 GB of zeros at the 202M GPT).
    if (!holds_agreed && windows_from_reshard(c.rs.settings)) c.state.drop_stale_moments();
    auto pg = transfer_group(g, c.rs);
    if (!pg) return g.failed("state transfer: " + pg.message(), c.state.step());
    auto sent = broadcast_state(*pg.value(), g.root, c.state, g.timeout, g.abandon_now, from_disk, state_transfer_streams, 64ull << 20, transfer_shm(g));
    if (!sent) return g.failed(sent.message(), c.state.step());
    after_transfer();
    if (g.rank != g.root) {
      // The generation's state came from the store when its root loaded
      // it from there (every rank says so: one story in the journal).
      g.source = from_disk ? ev::state_source::disk : ev::state_source::peer;
      c.rs.disk_step = from_disk ? c.state.step() : -1;
      g.transfer_bytes = sent->bytes;
      g.transfer_s = sent->seconds;
    }
    return std::nullopt;
  }
};

// Units built deferred (train.zero = 3: no rank held the whole model while
// it started), at the job's first step: this rank makes its own shards'
// initial values and from then on holds only those (alone: all of them);
// the rest is its holders' to make. Later, or holding nothing current,
// its shards come from their holders as always.
status make_own_initial_units(start_context& c, const shard_plan& plan) {
  if (!c.state.units_deferred() || c.state.step() != 0 || c.held_before != 0) return {};
  flat_adamw& opt = c.state.optimizer();
  const index_spans mine = c.g.pg ? plan.ranges_of(c.g.rank) : index_spans{{0, opt.total_elements()}};
  if (c.g.pg) c.state.shard_optimizer(mine);
  return make_initial_units(opt, c.state.the_task().param_units(), mine);
}

// The optimizer moments resharded to this generation's plan from whoever
// holds them at the agreed step; alone, this rank must hold all of them.
// When both holders of some shard were lost: the checkpoint source's
// fallback.
class replica_shards final : public shard_source {
 public:
  generation_end take(start_context& c, const shard_plan& plan) override {
    generation_run& g = c.g;
    flat_adamw& opt = c.state.optimizer();
    const int64_t total = opt.total_elements();
    if (auto st = make_own_initial_units(c, plan); !st) return g.failed(st.message(), c.state.step());
    std::string missing;
    if (!g.pg) {
      const auto held = opt.held_ranges();
      if (held == std::vector<std::pair<int64_t, int64_t>>{{0, total}} || !opt.sharded()) {
        c.state.shard_optimizer({{0, total}});
        c.rs.shards = plan;
        return std::nullopt;
      }
      missing = "elements outside this rank's shards";
    } else {
      const bool holds_current = c.held_before == c.state.step();
      // Sharded masters (train.zero = 3, or bf16 from zero = 1): a rank
      // keeps only its shards' parameters, and at zero = 3 in fp32 those
      // of no unit (broadcast from their holders): they move with the
      // moments. In bf16 the masters of no unit are sharded too; their
      // copies are gathered once the shards are in (rank/zero3).
      std::optional<index_spans> everywhere;
      if (masters_sharded(c.rs.settings.train)) everywhere.emplace();
      if (c.rs.settings.train.zero >= 3 && c.rs.settings.train.precision != precision_mode::bf16) {
        auto l = unit_layout_of(opt, c.state.the_task().param_units());
        if (!l) return g.failed(l.message(), c.state.step());
        everywhere = std::move(l->root);
      }
      auto peers = local_peers_of(g);
      if (!peers) return g.failed(peers.message(), c.state.step());
      auto r = reshard_optimizer(*g.pg, opt, plan, holds_current, c.state.params_mixed(), g.timeout, g.abandon_now, everywhere ? &*everywhere : nullptr,
                                 peers.value());
      if (!r) {
        (void)c.state.reset_state();  // half-moved shards: this rank holds nothing current
        return g.failed(r.message(), c.state.step());
      }
      if (r->complete) {
        c.state.clear_params_mixed();
        c.rs.shards = plan;
        g.reshard_bytes = r->bytes_in + r->bytes_out;
        if (r->moments_in > 0) g.optimizer = ev::optimizer_source::replica;
        return std::nullopt;
      }
      missing = r->missing;
    }
    return checkpoint_source::fallback(c, plan, missing);
  }
};

// Which node each global rank of the generation is on (a name per node,
// equal for ranks of one node): from the plan's layout (node_rank_runs), or
// from its ranks where a plan names them all (one made by hand).
std::vector<std::string> node_of_each_rank(const pb::generation_plan& plan, int world) {
  std::vector<std::string> nodes(static_cast<size_t>(std::max(world, 0)));
  if (const auto counts = node_rank_counts(plan, world); !counts.empty()) {
    int32_t g = 0;
    for (size_t i = 0; i < counts.size(); ++i)
      for (int32_t k = 0; k < counts[i] && g < world; ++k) nodes[static_cast<size_t>(g++)] = "node#" + std::to_string(i);
    return nodes;
  }
  for (const auto& r : plan.ranks())
    if (r.global_rank() >= 0 && r.global_rank() < world) nodes[static_cast<size_t>(r.global_rank())] = r.node_id();
  return nodes;
}

// This generation's shard plan: each shard on train.zero_replicas ranks
// of different nodes (default: as many as make sense for the nodes).
shard_plan generation_shard_plan(const start_context& c) {
  const std::vector<std::string> nodes = node_of_each_rank(c.g.plan, c.g.world);
  const int64_t want_replicas = c.rs.settings.train.zero_replicas;
  const int replicas = want_replicas > 0 ? static_cast<int>(want_replicas) : default_replicas(nodes);
  return make_shard_plan(c.state.optimizer().total_elements(), nodes, replicas);
}

}  // namespace

std::unique_ptr<state_source> choose_state_source(const start_context& c) {
  if (!c.g.pg || c.agreed.everyone_holds_it()) return std::make_unique<own_state>();
  if (heals(c)) return make_healing_state();
  return std::make_unique<peer_state>();
}

std::unique_ptr<shard_source> choose_shard_source(const start_context& c) {
  // The agreed state came from a checkpoint: each rank reads its own
  // shards from it. Agreed (the round), since the rank that read it may be
  // the only one to know (the others held that step already).
  const bool from_disk = c.g.pg ? c.agreed_from_disk : c.g.source == ev::state_source::disk;
  if (from_disk) return std::make_unique<checkpoint_source>();
  if (c.g.healing) return make_healing_shards();
  return std::make_unique<replica_shards>();
}

starting_state::starting_state(generation_run& g, rank_state& rs) : c_{g, rs, *rs.state, {}, false, {}, true, -1} {}

int64_t starting_state::held_step() const { return c_.rs.sync->held_step(c_.state); }

generation_end starting_state::agree() {
  generation_run& g = c_.g;
  training_state& state = c_.state;
  const int64_t zero = c_.rs.settings.train.zero;
  // Sharded from the first generation on (a fresh rank holds all of it), so
  // that every rank's stream has the same replicated part.
  if (zero >= 1 && !state.optimizer().sharded()) state.shard_optimizer({{0, state.optimizer().total_elements()}});
  if (g.rank == 0 && g.plan.checkpoint_step() > held_step())
    if (auto ended = checkpoint_source::replicated_part(c_)) return ended;
  if (zero >= 1)
    if (auto ended = complete_interrupted_step()) return ended;
  // Still the checkpoint's state (read in a generation a newer plan cut short).
  if (g.source == ev::state_source::local && c_.rs.disk_step >= 0 && c_.rs.disk_step == state.step()) g.source = ev::state_source::disk;
  c_.held_before = state.step();
  if (g.pg)
    if (auto ended = run_agreement()) return ended;
  if (auto ended = choose_state_source(c_)->take(c_)) return ended;
  // A checkpoint owed since an earlier generation is moot when the state
  // now is a checkpoint's (as new as it, or newer) or older than it.
  if (g.source == ev::state_source::disk || c_.rs.owed_checkpoint > state.step()) c_.rs.owed_checkpoint = -1;
  if (auto ended = c_.rs.sync->take_own_section(c_)) return ended;
  if (zero >= 1)
    if (auto ended = choose_shard_source(c_)->take(c_, generation_shard_plan(c_))) return ended;
  state.units_settled();  // made, received or loaded
  if (g.pg)
    if (auto ended = c_.rs.sync->after_agreement(g, c_.rs, c_.own_window, c_.strategy_agreed)) return ended;
  if (g.source == ev::state_source::local && state.step() == 0) g.source = ev::state_source::fresh;
  return std::nullopt;
}

// train.zero >= 1, before the agreement: the step whose gradient-norm
// allreduce failed here after other ranks completed it is finished (this
// rank's shards updated), or dropped without a group.
generation_end starting_state::complete_interrupted_step() {
  generation_run& g = c_.g;
  training_state& state = c_.state;
  if (!g.pg) {
    state.drop_interrupted_step();
    return std::nullopt;
  }
  auto finished = finish_interrupted_step(*g.pg, state, g.timeout, g.abandon_now);
  if (!finished) return g.failed(finished.message(), state.step());
  if (!*finished) return std::nullopt;
  // The samples are the attempt's, of the generation that computed them.
  const auto& attempt = c_.rs.attempt;
  if (attempt.step == state.step() - 1)
    if (auto st = c_.rs.log_samples(attempt.step, attempt.gen, attempt.rank, attempt.world); !st)
      return g.failed(st.message(), state.step(), pb::rank_status::FAILURE_DATA);
  std::fprintf(stderr,
               "rank %d: generation %llu: finished step %lld's update of this rank's shards (its gradient-norm allreduce failed here "
               "and completed on other ranks, which stepped theirs)\n",
               g.rank, static_cast<unsigned long long>(g.gen), static_cast<long long>(state.step() - 1));
  return std::nullopt;
}

// The generation's one agreement round (rank/agreement.hpp), one MAX
// allreduce of every piece's words: the state (the highest step, DiLoCo:
// anchor, any member holds and the lowest rank holding it, the root),
// whether that state is the plan's checkpoint global rank 0 read (the
// shard source), the sync strategy's words, a checkpoint still owed
// (checkpoint.defer_while_writing) from the generation before, and whether
// any rank's parameters are a mix of two steps (healing's heals).
generation_end starting_state::run_agreement() {
  generation_run& g = c_.g;
  agreement_round round;
  const auto [w0, w1] = agreement_words(held_step(), g.rank);
  const auto state_slot = round.add({w0, w1});
  const auto disk_slot = round.add({disk_word(g.source == ev::state_source::disk, held_step())});
  auto strategy_words = c_.rs.sync->agreement_words(c_.rs);
  if (!strategy_words) return g.failed(strategy_words.message(), c_.state.step());
  const auto strategy_slot = round.add(*strategy_words);
  const auto owed_slot = round.add({c_.rs.owed_checkpoint});
  const auto mixed_slot = round.add({c_.state.params_mixed() ? 1 : 0});
  if (auto st = max_allreduce(*g.pg, round.words(), deadline_in(g.timeout), g.abandon_now, "state agreement"); !st)
    return g.failed(st.message(), c_.state.step());
  const auto agreed_state = round.read(state_slot);
  c_.agreed = read_agreement(agreed_state[0], agreed_state[1]);
  c_.agreed_from_disk = agreed_from_disk(round.read(disk_slot)[0], c_.agreed);
  c_.strategy_agreed = round.read(strategy_slot);
  c_.rs.owed_checkpoint = round.read(owed_slot)[0];  // a checkpoint any rank still owes: all owe it
  c_.any_params_mixed = round.read(mixed_slot)[0] != 0;
  g.root = c_.agreed.root;
  return std::nullopt;
}

}  // namespace dtactor
