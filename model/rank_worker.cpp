#include "model/rank_worker.hpp"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstring>
#include <sstream>

#include "checkpoint.pb.h"
#include "model/trainer.hpp"
#include "runtime/blas_info.hpp"
#include "runtime/communicator.hpp"
#include "runtime/grad_sync.hpp"

namespace dtactor {

namespace {

using clock_type = std::chrono::steady_clock;

pb::rank_status status_of(pb::rank_status::state s, int rank, int local_rank, int64_t step, const std::string& detail) {
  pb::rank_status st;
  st.set_status(s);
  st.set_global_rank(rank);
  st.set_local_rank(local_rank);
  st.set_step(step);
  st.set_detail(detail);
  return st;
}

// Broadcasts a byte string from `root` to every rank (length first).
std::string broadcast_bytes(c10d::ProcessGroup& pg, int root, const std::string& bytes) {
  auto len = torch::tensor({static_cast<int64_t>(bytes.size())}, torch::kInt64);
  std::vector<torch::Tensor> lt{len};
  c10d::BroadcastOptions bo;
  bo.rootRank = root;
  pg.broadcast(lt, bo)->wait();
  const int64_t n = lt[0].item<int64_t>();
  auto buf = torch::empty({n}, torch::kUInt8);
  if (pg.getRank() == root) std::memcpy(buf.data_ptr(), bytes.data(), bytes.size());
  std::vector<torch::Tensor> bt{buf};
  pg.broadcast(bt, bo)->wait();
  return std::string(static_cast<const char*>(buf.data_ptr()), static_cast<size_t>(n));
}

std::map<std::string, std::string> sections_of(const pb::checkpoint_data& d) {
  std::map<std::string, std::string> out;
  for (const auto& s : d.sections()) out[s.name()] = s.data();
  return out;
}

pb::checkpoint_data to_checkpoint_data(int64_t step, const std::vector<std::pair<std::string, std::string>>& sections) {
  pb::checkpoint_data d;
  d.set_step(step);
  for (const auto& [name, data] : sections) {
    auto* s = d.add_sections();
    s->set_name(name);
    s->set_data(data);
  }
  return d;
}

// True when every rank holds the same parameters (digest min == max).
bool digests_agree(c10d::ProcessGroup& pg, const std::string& hex) {
  const int64_t v = static_cast<int64_t>(std::stoull(hex, nullptr, 16));
  std::vector<torch::Tensor> lo{torch::tensor({v}, torch::kInt64)}, hi{torch::tensor({v}, torch::kInt64)};
  c10d::AllreduceOptions mn, mx;
  mn.reduceOp = c10d::ReduceOp::MIN;
  mx.reduceOp = c10d::ReduceOp::MAX;
  pg.allreduce(lo, mn)->wait();
  pg.allreduce(hi, mx)->wait();
  return lo[0].item<int64_t>() == hi[0].item<int64_t>();
}

}  // namespace

int global_rank_in(const pb::generation_plan& plan, const std::string& node_id, int local_rank) {
  for (const auto& r : plan.ranks())
    if (r.node_id() == node_id && r.local_rank() == local_rank) return r.global_rank();
  return -1;
}

rank_worker::rank_worker(rank_worker_options opts, rank_worker_callbacks cb) : opts_(std::move(opts)), cb_(std::move(cb)) {}

rank_worker::~rank_worker() {
  request_stop();
  join();
}

void rank_worker::join() {
  if (thread_.joinable()) thread_.join();
}

bool rank_worker::start(const pb::generation_plan& plan) {
  if (running_.exchange(true)) return false;
  join();
  stop_.store(false);
  thread_ = std::thread([this, plan] {
    run(plan);
    running_.store(false);
  });
  return true;
}

void rank_worker::run(pb::generation_plan plan) {
  const int rank = global_rank_in(plan, opts_.node_id, opts_.local_rank);
  const int world = plan.world_size();
  const int local = opts_.local_rank;
  auto fail = [&](const std::string& why, int64_t step) {
    if (cb_.on_status) cb_.on_status(status_of(pb::rank_status::STATE_FAILED, rank, local, step, why));
  };
  if (rank < 0) return fail("rank " + std::to_string(local) + " of node " + opts_.node_id + " is not in generation " +
                            std::to_string(plan.generation()), plan.start_step());
  try {
    auto parsed = config::parse_toml(plan.config_toml(), "generation plan");
    if (!parsed) return fail(parsed.message(), plan.start_step());
    config cfg = std::move(parsed.value());
    // Ranks sharing a machine share its cores.
    if (cfg.get_int("train.threads") == 0) {
      const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
      const int n = opts_.threads > 0 ? opts_.threads : std::max(1, hw / std::max(1, opts_.local_world));
      (void)cfg.set("train.threads", std::to_string(n));
    }
    configure_threads(cfg);

    // Gloo uses one timeout for building the group (all ranks must arrive)
    // and for every collective; the group gets the longer rendezvous bound,
    // and the step's allreduces are bounded by grad_sync's own deadline.
    const auto timeout = std::chrono::milliseconds(cfg.get_int("cluster.collective_timeout_ms"));
    const auto rendezvous_timeout = std::max<std::chrono::milliseconds>(timeout, std::chrono::seconds(60));
    c10::intrusive_ptr<c10d::ProcessGroup> pg;
    if (world > 1) {
      c10d::TCPStoreOptions so;
      so.port = static_cast<uint16_t>(plan.store_port());
      so.isServer = false;
      so.waitWorkers = false;
      so.timeout = rendezvous_timeout;
      auto store = c10::make_intrusive<c10d::TCPStore>(plan.store_host().empty() ? opts_.default_store_host : plan.store_host(), so);
      communicator_options co;
      co.backend = cfg.get_string("cluster.backend");
      co.timeout = rendezvous_timeout;
      co.generation = plan.generation();
      co.hostname = opts_.advertise_addr.empty() ? "127.0.0.1" : opts_.advertise_addr;
      auto made = make_process_group(store, rank, world, co);
      if (!made) return fail(made.message(), plan.start_step());
      pg = made.value();
    }

    auto created = training_state::create(cfg);
    if (!created) return fail(created.message(), plan.start_step());
    training_state& state = *created.value();

    // The committed state: from the plan's checkpoint on the root, then
    // broadcast from the root over the new group.
    const int root = plan.state_root() >= 0 ? plan.state_root() : 0;
    if (rank == root && !plan.checkpoint().empty()) {
      pb::checkpoint_data d;
      if (!d.ParseFromString(plan.checkpoint())) return fail("the plan's checkpoint does not parse", plan.start_step());
      if (auto st = state.load_sections(sections_of(d), d.step()); !st) return fail(st.message(), plan.start_step());
    }
    if (pg && (plan.state_root() >= 0 || !plan.checkpoint().empty())) {
      std::string blob;
      if (rank == root) to_checkpoint_data(state.step(), state.save_sections()).SerializeToString(&blob);
      blob = broadcast_bytes(*pg, root, blob);
      if (rank != root) {
        pb::checkpoint_data d;
        if (!d.ParseFromString(blob)) return fail("state broadcast from the root does not parse", plan.start_step());
        if (auto st = state.load_sections(sections_of(d), d.step()); !st) return fail(st.message(), plan.start_step());
      }
    }
    if (state.step() != plan.start_step()) {
      return fail("plan resumes at step " + std::to_string(plan.start_step()) + " but no state source was given", plan.start_step());
    }

    grad_sync_options go;
    go.bucket_bytes = cfg.get_int("cluster.bucket_kb") * 1024;
    go.timeout = timeout;
    grad_sync sync(state.the_task().module()->parameters(), pg, go);

    if (cb_.on_status) cb_.on_status(status_of(pb::rank_status::STATE_READY, rank, local, state.step(), ""));

    const int64_t max_steps = cfg.get_int("train.max_steps");
    const int64_t eval_every = cfg.get_int("eval.every_steps");
    const int64_t ckpt_every = cfg.get_int("checkpoint.every_steps");
    const int64_t digest_every = cfg.get_int("cluster.digest_every_steps");
    const int64_t report_every = cfg.get_int("train.log_every_steps");
    std::map<std::string, double> eval_at_step;
    pb::step_report acc;  // sums since the last report
    while (state.step() < max_steps) {
      if (stop_.load()) return;
      const auto t0 = clock_type::now();
      auto r = state.train_step_dp(rank, world, sync);
      if (!r) return fail(r.message(), state.step());
      const int64_t step = state.step();
      acc.set_samples(acc.samples() + r->samples);
      acc.set_allreduce_s(acc.allreduce_s() + r->allreduce_s);
      acc.set_allreduce_exposed_s(acc.allreduce_exposed_s() + r->exposed_s);
      acc.set_steps_covered(acc.steps_covered() + 1);
      if ((digest_every > 0 && step % digest_every == 0) || step == max_steps) {
        const std::string digest = state.params_digest();
        acc.set_params_digest(digest);
        if (pg && !digests_agree(*pg, digest)) return fail("parameters differ between ranks at step " + std::to_string(step), step);
      }
      acc.set_step_s(acc.step_s() + std::chrono::duration<double>(clock_type::now() - t0).count());
      if (step % report_every == 0 || step == max_steps) {
        acc.set_step(step);
        acc.set_global_rank(rank);
        acc.set_world_size(world);
        acc.set_loss(r->samples > 0 ? r->loss_sum / static_cast<double>(r->samples) : 0.0);
        acc.set_lr(state.lr_at(step - 1));
        if (cb_.on_step) cb_.on_step(acc);
        acc.Clear();
      }

      eval_at_step.clear();
      // Every rank evaluates (their parameters are identical, so are the
      // results): a rank left waiting in the next collective while rank 0
      // evaluated alone would hit the collective timeout on a long
      // evaluation. Rank 0 reports.
      if ((eval_every > 0 && step % eval_every == 0) || step == max_steps) {
        const auto e0 = clock_type::now();
        auto ev = state.evaluate();
        eval_at_step = ev.metrics;
        if (rank == 0) {
          pb::eval_report er;
          er.set_step(step);
          for (const auto& [k, v] : ev.metrics) (*er.mutable_metrics())[k] = v;
          for (const auto& ex : ev.examples) er.add_examples(ex);
          er.set_duration_s(std::chrono::duration<double>(clock_type::now() - e0).count());
          if (cb_.on_eval) cb_.on_eval(er);
        }
      }
      if (rank == 0 && ((ckpt_every > 0 && step % ckpt_every == 0) || step == max_steps)) {
        auto d = to_checkpoint_data(step, state.save_sections());
        d.set_meta(state.checkpoint_meta(eval_at_step, plan.generation()).SerializeAsString());
        if (cb_.on_checkpoint) cb_.on_checkpoint(std::move(d));
      }
    }
    if (cb_.on_status) cb_.on_status(status_of(pb::rank_status::STATE_FINISHED, rank, local, state.step(), state.params_digest()));
  } catch (const std::exception& e) {
    std::string what = e.what();
    fail(what.substr(0, what.find('\n')), plan.start_step());
  }
}

}  // namespace dtactor
