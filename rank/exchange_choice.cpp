#include "rank/exchange_choice.hpp"

#include <cstdio>

#include "comm/exchange_spec.hpp"
#include "model/trainer.hpp"
#include "rank/generation.hpp"
#include "rank/healing.hpp"
#include "rank/sync_strategy.hpp"
#include "rank/zero.hpp"
#include "rank/zero_sync.hpp"
#include "rank/zero3.hpp"

namespace dtactor {

int64_t exchanges::buffer_bytes() const {
  int64_t n = 0;
  for (const auto& s : syncs) n += s->buffer_bytes();
  return n + (host_sync ? host_sync->buffer_bytes() : 0);
}

exchanges::~exchanges() {
  for (gate_slot* slot : gated) {
    slot->gate.reset();
    slot->unit = -1;
  }
}

namespace {

// The world's segment when every rank is on one host; each host's when
// the hosts each hold every shard (the same on every rank: a function of
// the plan and the hosts); else the group.
gather_route gather_route_for(const generation_run& g, const shard_plan& plan) {
  const exchange_plan& x = g.exchange;
  if (!x.hierarchical && x.gather) {
    std::vector<int> all(static_cast<size_t>(g.world));
    for (int r = 0; r < g.world; ++r) all[static_cast<size_t>(r)] = r;
    return gather_route::through(x.gather, std::move(all), false);
  }
  if (x.hierarchical && x.host_gathers && hosts_cover_every_shard(plan, x.host_groups))
    return gather_route::through(x.gather, x.host_members, true);
  return gather_route::over_group();
}

// copies_resident's gathers come between steps, when the gradients'
// segment is free: through it where zero_sync_for's all-gather would go.
gather_route copies_route_for(const generation_run& g, exchanges& x, const shard_plan& plan) {
  const exchange_plan& p = g.exchange;
  if (x.sync().uses_shm() && !x.sync().hierarchical() && p.shm) {
    std::vector<int> all(static_cast<size_t>(g.world));
    for (int r = 0; r < g.world; ++r) all[static_cast<size_t>(r)] = r;
    return gather_route::through(p.shm, std::move(all), false);
  }
  if (p.hierarchical && hosts_cover_every_shard(plan, p.host_groups)) return gather_route::through(p.shm, p.host_members, true);
  return gather_route::over_group();
}

// Sharded masters (settings.hpp's masters_sharded), for this generation.
// train.zero = 3: the task's units gated (their parameters released now,
// gathered as each runs), the root gathered after each update (and now,
// after a checkpoint's shards). bf16 at zero = 1 or 2: the masters outside
// this rank's shards released now, the bf16 copies gathered whole now and
// after each update. The norm as zero_sync_for's.
status gate_units(const generation_run& g, rank_state& rs, exchanges& x) {
  training_state& state = *rs.state;
  const unit_policy policy = rs.settings.train.zero >= 3 ? unit_policy::each_pass : unit_policy::copies_resident;
  auto units = state.the_task().param_units();
  auto layout = unit_layout_of(state.optimizer(), units);
  if (!layout) return layout.err();
  gather_route route = policy == unit_policy::each_pass ? gather_route_for(g, *rs.shards) : copies_route_for(g, x, *rs.shards);
  x.gate = std::make_shared<unit_gatherer>(g.pg, state.optimizer(), *rs.shards, layout_for(std::move(layout.value()), policy), g.timeout,
                                           g.abandon_now, std::move(route), rs.settings.cluster.spin_wait, policy);
  x.sync().set_parameter_sync(zero3_sync(x.sync().take_parameter_sync(), x.gate, g.backend));
  if (policy == unit_policy::each_pass)
    for (size_t i = 0; i < units.size(); ++i) {
      units[i].slot->gate = x.gate;
      units[i].slot->unit = static_cast<int>(i);
      x.gated.push_back(units[i].slot);
    }
  // Healing (copies_resident only: rank/healing): every rank's copies are
  // current already, and the masters it gives up may still be read by the
  // moves: their pages go back once the moves landed.
  if (g.healing) {
    after_landing(*g.healing, [gate = x.gate] { gate->reshard(); });
    return {};
  }
  x.gate->reshard();
  // Shards read from a checkpoint (rank/checkpoint_source): each rank read
  // only its own, so the parameters of no unit, which every rank keeps,
  // come from their primaries, as after an update; so do their bf16
  // copies whenever their masters are sharded (root_sharded).
  if (g.optimizer == ev::optimizer_source::checkpoint || policy == unit_policy::copies_resident || x.gate->root_sharded())
    return x.gate->after_update();
  return {};
}

}  // namespace

status choose_exchanges(const generation_run& g, rank_state& rs, exchanges& x) {
  training_state& state = *rs.state;
  const job_settings& s = rs.settings;
  const exchange_spec spec = exchange_spec_of(s.cluster);
  grad_sync_options& go = x.options;
  go.bucket_bytes = s.cluster.bucket_kb * 1024;
  go.spin_wait = s.cluster.spin_wait;
  go.timeout = g.timeout;
  go.abandon = g.abandon_now;
  go.carry_control = true;
  go.exchange = spec;
  go.exchange.transport = transport_for(spec, g.exchange);
  go.shm = g.exchange.shm;
  go.hosts = g.exchange.hosts;
  go.recycled = rs.buckets;
  // train.zero = 2: each rank receives only its shards' summed gradients,
  // straight into the optimizer's gradient windows; the clipping norm is
  // the sum of the primaries' partial sums (one small allreduce a step).
  x.zero2 = rs.shards && g.pg && g.world > 1 && s.train.zero >= 2;
  if (x.zero2) go.zero2 = zero2_of(state.optimizer(), *rs.shards);
  // The sync strategy's reducers: one, or DiLoCo's (a fragment's each,
  // and the host's with hosts as workers).
  rs.sync->add_reducers(g, rs, x);
  // What the reducers did not take is another layout's. A world of one
  // has no buckets: they wait for the world to grow again (a survivor
  // alone after a loss, joined by a replacement), as large as when it was.
  if (g.world > 1) rs.buckets->clear();
  // train.zero >= 1: the reducer's parameter sync (the all-gather after
  // the update, the norm from the shards), over the path the ranks' places
  // allow. The norm's allreduce runs at every level from 1, where every
  // rank also holds the whole gradient: it is the step's commit (no rank
  // steps its shards unless every rank completed the gradient exchange),
  // which the interrupted-step rule builds on (rank/zero).
  x.sync().set_parameter_sync(zero_sync_for(x.sync(), g.exchange, state.optimizer(), rs.shards ? &*rs.shards : nullptr,
                                            {g.pg, true, g.timeout, g.abandon_now, go.spin_wait, g.backend}));
  if (rs.shards && g.pg && g.world > 1 && masters_sharded(s.train))
    if (auto st = gate_units(g, rs, x); !st) return st;
  if (g.pg && state.the_task().buffers_change_in_training())
    for (auto& b : state.the_task().module()->buffers()) x.moving_buffers.push_back(b);
  return {};
}

namespace {

std::string describe_shards(const generation_run& g, const exchanges& x, const shard_plan& sp) {
  const bool params = x.gate && x.gate->policy() == unit_policy::each_pass;
  const int level = params ? 3 : x.zero2 ? 2 : 1;
  const std::string what = std::string(x.gate && !params ? " (the float32 masters too)" : "") +
                           (params ? ", gradients and parameters" : x.zero2 ? " and gradients" : "");
  return "; optimizer state" + what + " sharded (train.zero=" + std::to_string(level) +
         "): this rank holds " + std::to_string(sp.held_elements(g.rank)) + " of " + std::to_string(sp.total) + " elements, " +
         std::to_string(sp.shards.empty() ? 0 : sp.shards[0].holders.size()) + " holder(s) a shard, " + std::to_string(g.reshard_bytes) +
         " bytes moved, parameters gathered " + (x.sync().parameter_sync() ? x.sync().parameter_sync()->describe() : "over " + g.backend);
}

// The same transport carries the pseudo-gradients, once a window.
std::string describe_diloco(const generation_run& g, const exchanges& x, training_state& state, const train_settings& train, std::string transport) {
  const auto at = transport.find("gradients");
  if (at != std::string::npos) transport.replace(at, 9, "pseudo-gradients");
  const auto& oo = state.outer().options();
  std::string how = "train.sync_every=" + std::to_string(train.sync_every);
  const size_t fragments = x.streaming ? x.syncs.size() : 0;
  if (fragments > 0)
    how += ", " + std::to_string(fragments) + " fragments, overlap " + std::to_string(oo.overlap) + " step(s), mix " +
           std::to_string(oo.mix).substr(0, 4);
  if (x.host_sync)
    how += ", workers are hosts: " + std::to_string(g.exchange.host_ranks) + " ranks here, synchronous over shared memory every step";
  else if (!x.host_workers_why_not.empty())
    how += ", train.diloco_worker = host but this rank is a worker of its own (" + x.host_workers_why_not + ")";
  return "DiLoCo (" + how + "): " + transport + ", window at step " + std::to_string(state.step()) + " of anchor " +
         std::to_string(state.outer().anchor());
}

}  // namespace

std::string describe_transport(const generation_run& g, const exchanges& x, rank_state& rs) {
  training_state& state = *rs.state;
  std::string transport;
  if (g.world > 1 && (x.sync().uses_shm() || x.sync().hierarchical())) {
    transport = g.exchange.describe(g.backend);
  } else if (g.world > 1) {
    std::string why = g.exchange.why_not;
    if (x.fragments_off_shm) why = "overlapped fragments leave the host's segment to the host's per-step reducer";
    if (why.empty() && (g.exchange.shm || g.exchange.hierarchical)) why = "the gradients are not all float32, or do not fit the segment";
    transport = "gradients over " + g.backend + (why.empty() ? "" : " (no shared memory: " + why + ")");
  }
  if (g.world > 1) {
    int64_t reused = x.host_sync ? x.host_sync->reused_bytes() : 0;
    for (const auto& s : x.syncs) reused += s->reused_bytes();
    if (reused > 0) {
      char size[32];
      if (reused >= (1 << 20))
        std::snprintf(size, sizeof(size), "%.1f MiB", static_cast<double>(reused) / (1 << 20));
      else
        std::snprintf(size, sizeof(size), "%.1f KiB", static_cast<double>(reused) / (1 << 10));
      transport += "; bucket buffers kept from before (" + std::string(size) + ")";
    }
  }
  if (rs.shards && g.world > 1) transport += describe_shards(g, x, *rs.shards);
  if (state.diloco() && g.world > 1) transport = describe_diloco(g, x, state, rs.settings.train, std::move(transport));
  return transport;
}

}  // namespace dtactor
