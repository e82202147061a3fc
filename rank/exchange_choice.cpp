#include "rank/exchange_choice.hpp"

#include "comm/exchange_spec.hpp"
#include "model/trainer.hpp"
#include "rank/generation.hpp"
#include "rank/zero.hpp"
#include "rank/zero_sync.hpp"

namespace dtactor {

int64_t exchanges::buffer_bytes() const {
  int64_t n = 0;
  for (const auto& s : syncs) n += s->buffer_bytes();
  return n + (host_sync ? host_sync->buffer_bytes() : 0);
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
  // train.zero = 2: each rank receives only its shards' summed gradients,
  // straight into the optimizer's gradient windows; the clipping norm is
  // the sum of the primaries' partial sums (one small allreduce a step).
  x.zero2 = rs.shards && g.pg && g.world > 1 && s.train.zero >= 2;
  if (x.zero2) go.zero2 = zero2_of(state.optimizer(), *rs.shards);
  const bool host_workers = host_worker(g, rs);
  x.streaming = state.diloco() && state.outer().streaming();
  x.fragments_off_shm = x.streaming && host_workers && state.outer().options().overlap > 0;
  if (x.streaming)
    fragment_reducers(g, state, x);
  else
    x.syncs.push_back(std::make_unique<grad_sync>(state.the_task().module()->parameters(), g.pg, go));
  // train.zero >= 1: the reducer's parameter sync (the all-gather after
  // the update, zero=2's norm), over the path the ranks' places allow.
  x.sync().set_parameter_sync(zero_sync_for(x.sync(), g.exchange, state.optimizer(), rs.shards ? &*rs.shards : nullptr,
                                            {g.pg, x.zero2, g.timeout, g.abandon_now, go.spin_wait, g.backend}));
  if (state.diloco() && rs.settings.modes.diloco_worker == diloco_worker_kind::host && g.world > 1) host_reducer(g, state, host_workers, x);
  if (g.pg && state.the_task().buffers_change_in_training())
    for (auto& b : state.the_task().module()->buffers()) x.moving_buffers.push_back(b);
  return {};
}

namespace {

std::string describe_shards(const generation_run& g, const exchanges& x, const shard_plan& sp) {
  return "; optimizer state" + std::string(x.zero2 ? " and gradients" : "") + " sharded (train.zero=" + std::to_string(x.zero2 ? 2 : 1) +
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
  if (rs.shards && g.world > 1) transport += describe_shards(g, x, *rs.shards);
  if (state.diloco() && g.world > 1) transport = describe_diloco(g, x, state, rs.settings.train, std::move(transport));
  return transport;
}

}  // namespace dtactor
