#include "rank/group_builder.hpp"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "base/process.hpp"
#include "comm/communicator.hpp"
#include "comm/peer_moves.hpp"
#include "comm/rendezvous_client.hpp"
#include "comm/shm_group.hpp"
#include "comm/step_control.hpp"
#include "model/trainer.hpp"
#include "rank/generation.hpp"

namespace dtactor {

// What the helper thread needs, copied: it may outlive the generation (the
// generation keeps a copy, for the side groups it builds).
struct group_request {
  communicator_options co;
  std::string host;
  uint16_t port = 0;
  int rank = 0, world = 1;
  std::chrono::milliseconds timeout{0};
  std::shared_ptr<const job_key> key;
  bool want_shm = false;
  // train.zero = 3: the units' gathers get segments of their own
  // (join_gather_segments).
  bool gather_segment = false;
  // Gradient floats (+ the control words) a shared-memory slot must hold,
  // the largest bucket's, and the ring's.
  int64_t shm_floats = 0, largest_floats = 0, ring_floats = 0;
};

namespace {

struct build {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::optional<result<c10::intrusive_ptr<c10d::ProcessGroup>>> r;
  exchange_plan exchange;
};

// The largest bucket is at most a bucket's worth and the largest parameter
// (a bucket closes once it holds bucket_kb).
void size_shm(group_request& q, training_state& state, const cluster_settings& cluster) {
  int64_t shm_floats = step_control::words, largest_param = 0;
  for (const auto& p : state.the_task().module()->parameters())
    if (p.requires_grad()) {
      shm_floats += p.numel();
      largest_param = std::max<int64_t>(largest_param, p.numel());
    }
  q.shm_floats = shm_floats;
  q.largest_floats = cluster.bucket_kb * 256 + largest_param + step_control::words;
  q.ring_floats = cluster.shm_ring_mb * (int64_t{1} << 18);
}

// On the helper thread: the rendezvous, the group, the exchange plan.
void make_group(const group_request& q, build& b) {
  result<c10::intrusive_ptr<c10d::ProcessGroup>> r = make_error("not built");
  try {
    auto store = c10::make_intrusive<rendezvous_client>(q.host, q.port, q.timeout, q.key);
    r = make_process_group(store, q.rank, q.world, q.co);
    if (r.ok() && q.want_shm) {
      auto ex = setup_exchange(c10::make_intrusive<c10d::PrefixStore>("g" + std::to_string(q.co.generation) + "/exchange", store), q.rank, q.world,
                               q.shm_floats, q.co, host_key(), q.largest_floats, q.ring_floats);
      // train.zero = 3: slots of the ring's bound (a gather goes in rounds
      // of half of it).
      const int64_t gather_floats = std::min<int64_t>(q.shm_floats, q.ring_floats > 0 ? q.ring_floats : int64_t{16} << 20);
      if (ex && q.gather_segment)
        if (auto st = join_gather_segments(store, q.rank, q.world, gather_floats, q.co.generation, ex.value()); !st) ex = st.err();
      if (!ex)
        r = ex.err();
      else {
        std::lock_guard<std::mutex> lock(b.mu);
        b.exchange = std::move(ex.value());
      }
    }
  } catch (const rendezvous_error& e) {
    // The store's own errors name it already.
    const std::string what = e.what_without_backtrace();
    r = make_error(what.substr(0, what.find('\n')));
  } catch (const std::exception& e) {
    std::string what = e.what();
    what = what.substr(0, what.find('\n'));
    r = make_error("rendezvous store at " + q.host + ":" + std::to_string(q.port) + ": " + what);
  }
  std::lock_guard<std::mutex> lock(b.mu);
  b.r = std::move(r);
  b.done = true;
  b.cv.notify_all();
}

// Waits for the helper thread's build: nothing once it is done, else the
// outcome (quit, a newer plan) that abandons it.
generation_end wait_for_build(generation_run& g, build& b) {
  std::unique_lock<std::mutex> lock(b.mu);
  while (!b.done) {
    if (g.quitting()) return generation_outcome::quit;
    if (g.newer_plan_waiting()) return generation_outcome::next_plan;
    b.cv.wait_for(lock, std::chrono::milliseconds(5));
  }
  return std::nullopt;
}

}  // namespace

generation_end build_group(generation_run& g, rank_state& rs, const group_endpoint& at) {
  const job_settings& s = rs.settings;
  group_request q;
  q.timeout = std::max<std::chrono::milliseconds>(g.timeout, std::chrono::seconds(60));
  q.co.backend = rs.settings.modes.backend;
  q.co.timeout = q.timeout;
  q.co.generation = g.gen;
  q.co.hostname = at.advertise_addr.empty() ? "127.0.0.1" : at.advertise_addr;
  q.host = g.plan.store_host().empty() ? at.default_store_host : g.plan.store_host();
  q.port = static_cast<uint16_t>(g.plan.store_port());
  q.rank = g.rank;
  q.world = g.world;
  q.key = at.key;
  size_shm(q, *rs.state, s.cluster);
  const comm_backend backend = resolve_backend(q.co);
  g.backend = std::string(to_string(backend));
  q.want_shm = s.cluster.shm_allreduce && backend == comm_backend::gloo;
  q.gather_segment = s.train.zero >= 3;
  auto b = std::make_shared<build>();
  std::thread([b, q] { make_group(q, *b); }).detach();
  if (auto end = wait_for_build(g, *b)) return end;
  if (!b->r->ok()) return g.failed(b->r->message(), rs.state->step());
  g.pg = b->r->value();
  g.group = std::make_shared<const group_request>(q);
  rs.parked.push_back(g.pg);  // outlives this generation (see rank_state::parked)
  g.exchange = b->exchange;
  if (g.exchange.hosts) rs.parked.push_back(g.exchange.hosts);
  g.group_s = now_s() - g.offered_at;
  return std::nullopt;
}

result<c10::intrusive_ptr<c10d::ProcessGroup>> build_side_group(generation_run& g, rank_state& rs, const std::string& name, int streams) {
  if (!g.group) return make_error("no group of this generation to build beside");
  group_request q = *g.group;
  q.co.name = "g" + std::to_string(g.gen) + "/" + name;
  q.co.streams = streams;
  q.want_shm = false;
  auto b = std::make_shared<build>();
  std::thread([b, q] { make_group(q, *b); }).detach();
  if (wait_for_build(g, *b)) return make_error("the " + name + " group was abandoned: a newer generation replaces this one");
  if (b->r->ok()) rs.parked.push_back(b->r->value());  // as the generation's own group
  return *b->r;
}

shm_group* transfer_shm(const generation_run& g) { return g.exchange.shm && !g.exchange.hierarchical ? g.exchange.shm.get() : nullptr; }

result<c10::intrusive_ptr<c10d::ProcessGroup>> transfer_group(generation_run& g, rank_state& rs) {
  if (!g.group || resolve_backend(g.group->co) != comm_backend::gloo) return g.pg;
  // Built once a generation (a peer's state and then a checkpoint's
  // broadcast may both come): a second group under the same name would
  // meet the first one's keys in the store.
  if (!g.transfer_pg) {
    auto built = build_side_group(g, rs, "state", state_transfer_streams);
    if (!built) return built;
    g.transfer_pg = built.value();
  }
  return g.transfer_pg;
}

result<const local_peers*> local_peers_of(generation_run& g) {
  if (!g.pg) return static_cast<const local_peers*>(nullptr);
  if (!g.peers) {
    auto agreed = local_peers::agree(*g.pg, deadline_in(g.timeout), g.abandon_now);
    if (!agreed) return agreed.err();
    g.peers = std::make_shared<const local_peers>(std::move(agreed.value()));
  }
  return g.peers.get();
}

}  // namespace dtactor
