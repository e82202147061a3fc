#include "model/rank_worker.hpp"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <sstream>

#include "checkpoint.pb.h"
#include "model/trainer.hpp"
#include "runtime/blas_info.hpp"
#include "runtime/communicator.hpp"
#include "runtime/grad_sync.hpp"
#include "runtime/shm_group.hpp"

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

using abandon_fn = std::function<bool()>;

clock_type::time_point deadline_in(std::chrono::milliseconds d) { return clock_type::now() + d; }

// Broadcasts a byte string from `root` to every rank (length first).
result<std::string> broadcast_bytes(c10d::ProcessGroup& pg, int root, const std::string& bytes, std::chrono::milliseconds timeout,
                                    const abandon_fn& abandon) {
  auto len = torch::tensor({static_cast<int64_t>(bytes.size())}, torch::kInt64);
  std::vector<torch::Tensor> lt{len};
  c10d::BroadcastOptions bo;
  bo.rootRank = root;
  if (auto st = wait_work(pg.broadcast(lt, bo), deadline_in(timeout), abandon, "state broadcast (length)"); !st) return st.err();
  const int64_t n = lt[0].item<int64_t>();
  auto buf = torch::empty({n}, torch::kUInt8);
  if (pg.getRank() == root) std::memcpy(buf.data_ptr(), bytes.data(), bytes.size());
  std::vector<torch::Tensor> bt{buf};
  if (auto st = wait_work(pg.broadcast(bt, bo), deadline_in(timeout), abandon, "state broadcast"); !st) return st.err();
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
result<bool> digests_agree(c10d::ProcessGroup& pg, const std::string& hex, std::chrono::milliseconds timeout, const abandon_fn& abandon) {
  const int64_t v = static_cast<int64_t>(std::stoull(hex, nullptr, 16));
  // MAX of (v, -v) gives max and -min in one collective.
  std::vector<torch::Tensor> t{torch::tensor({v, -v}, torch::kInt64)};
  c10d::AllreduceOptions mx;
  mx.reduceOp = c10d::ReduceOp::MAX;
  if (auto st = wait_work(pg.allreduce(t, mx), deadline_in(timeout), abandon, "parameter digest comparison"); !st) return st.err();
  return t[0][0].item<int64_t>() == -t[0][1].item<int64_t>();
}

double now_s() { return std::chrono::duration<double>(clock_type::now().time_since_epoch()).count(); }

}  // namespace

int global_rank_in(const pb::generation_plan& plan, const std::string& node_id, int local_rank) {
  for (const auto& r : plan.ranks())
    if (r.node_id() == node_id && r.local_rank() == local_rank) return r.global_rank();
  return -1;
}

// What the training thread keeps across generations.
struct rank_worker::impl {
  std::optional<config> cfg;
  std::unique_ptr<training_state> state;
  // Groups of earlier generations: an abandoned collective may still run on
  // their threads, and a group's destructor waits for it. Kept until the
  // process ends (it ends with _exit).
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> parked;
  bool injected = false;
  // Neither train.threads nor --threads-per-rank fixed the thread count:
  // each generation splits the machine's cores over the ranks it plans there.
  bool auto_threads = false;
  int threads = 0;
};

rank_worker::rank_worker(rank_worker_options opts, rank_worker_callbacks cb)
    : opts_(std::move(opts)), cb_(std::move(cb)), impl_(std::make_unique<impl>()) {
  thread_ = std::thread([this] {
    // Named for top/perf (it would inherit the spawning CAF thread's name).
    ::pthread_setname_np(::pthread_self(), "dtactor-train");
    run();
    done_.store(true);
    cv_.notify_all();
  });
}

rank_worker::~rank_worker() {
  quit();
  if (thread_.joinable()) thread_.join();
  // Leaked on purpose: a parked group's destructor waits for its abandoned
  // collective (up to the Gloo timeout), and the process is ending anyway.
  for (auto& pg : impl_->parked) (void)pg.release();
}

bool rank_worker::offer(const pb::generation_plan& plan) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (any_offered_ && plan.generation() <= offered_gen_.load()) return false;
    any_offered_ = true;
    pending_ = plan;
    pending_at_ = now_s();
    offered_gen_.store(std::max(offered_gen_.load(), plan.generation()));
    if (!plan.drain() && plan.generation() > 0) abort_gen_.store(plan.generation());
  }
  cv_.notify_all();
  return true;
}

void rank_worker::request_stop(bool checkpoint) {
  if (checkpoint) stop_checkpoint_.store(true);
  stop_.store(true);
  cv_.notify_all();
}

void rank_worker::quit() {
  quit_.store(true);
  cv_.notify_all();
}

bool rank_worker::join_for(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return done_.load(); })) return false;
  lock.unlock();
  if (thread_.joinable()) thread_.join();
  return true;
}

bool rank_worker::abandon(uint64_t gen) const { return quit_.load() || abort_gen_.load() > gen; }

bool rank_worker::take_plan(uint64_t after, bool warm_up, pb::generation_plan& out, double& offered_at) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return quit_.load() || (pending_ && (warm_up || pending_->generation() > after)); });
  if (quit_.load()) return false;
  out = std::move(*pending_);
  offered_at = pending_at_;
  pending_.reset();
  return true;
}

void rank_worker::run() {
  const int local = opts_.local_rank;
  auto status = [&](uint64_t gen, pb::rank_status::state s, int rank, int64_t step, const std::string& detail) {
    if (cb_.on_status) cb_.on_status(gen, status_of(s, rank, local, step, detail));
  };
  pb::generation_plan plan;
  double offered_at = 0;
  if (!take_plan(0, true, plan, offered_at)) return;
  auto& im = *impl_;
  try {
    auto parsed = config::parse_toml(plan.config_toml(), "generation plan");
    if (!parsed) return status(plan.generation(), pb::rank_status::STATE_FAILED, -1, 0, parsed.message());
    config cfg = std::move(parsed.value());
    // Ranks sharing a machine share its cores: until a plan says how many
    // ranks run here, this node's.
    if (cfg.get_int("train.threads") == 0) {
      const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
      im.auto_threads = opts_.threads <= 0;
      const int n = opts_.threads > 0 ? opts_.threads : std::max(1, hw / std::max(1, opts_.local_world));
      (void)cfg.set("train.threads", std::to_string(n));
    }
    im.threads = static_cast<int>(cfg.get_int("train.threads"));
    configure_threads(cfg);
    auto created = training_state::create(cfg);
    if (!created) return status(plan.generation(), pb::rank_status::STATE_FAILED, -1, 0, created.message());
    im.state = std::move(created.value());
    im.cfg = std::move(cfg);
  } catch (const std::exception& e) {
    std::string what = e.what();
    return status(plan.generation(), pb::rank_status::STATE_FAILED, -1, 0, what.substr(0, what.find('\n')));
  }
  status(0, pb::rank_status::STATE_IDLE, -1, im.state->step(), "warmed up");

  uint64_t current = 0;
  for (;;) {
    if (plan.generation() > current) {
      current = plan.generation();
      const auto o = run_generation(plan, offered_at);
      if (o == outcome::quit) return;
      if (o == outcome::next_plan) {
        // A newer plan is waiting: take it without blocking.
        if (!take_plan(current, false, plan, offered_at)) return;
        continue;
      }
    }
    if (!take_plan(current, false, plan, offered_at)) return;
  }
}

rank_worker::outcome rank_worker::run_generation(const pb::generation_plan& plan, double offered_at) {
  auto& im = *impl_;
  training_state& state = *im.state;
  const config& cfg = *im.cfg;
  const uint64_t gen = plan.generation();
  const int local = opts_.local_rank;
  const int rank = global_rank_in(plan, opts_.node_id, local);
  const int world = plan.world_size();
  auto status = [&](pb::rank_status::state s, int64_t step, const std::string& detail) {
    if (cb_.on_status) cb_.on_status(gen, status_of(s, rank, local, step, detail));
  };
  const abandon_fn abandon_now = [this, gen] { return abandon(gen); };
  auto failed = [&](const std::string& why, int64_t step, pb::rank_status::failure_kind kind = pb::rank_status::FAILURE_UNSPECIFIED) {
    if (quitting()) return outcome::quit;
    // Abandoned for a newer plan: not a failure of this generation.
    if (abandon(gen)) return outcome::next_plan;
    auto s = status_of(pb::rank_status::STATE_FAILED, rank, local, step, why);
    s.set_failure(kind);
    if (cb_.on_status) cb_.on_status(gen, std::move(s));
    return outcome::failed;
  };
  if (rank < 0) {
    // Not in this generation (this node leaves, or this rank was left out).
    status(pb::rank_status::STATE_IDLE, state.step(), "not in generation " + std::to_string(gen));
    return outcome::idle;
  }
  if (im.auto_threads) {
    // Nodes started by hand on one machine each think they own it; the plan
    // counts every rank of the generation on this machine.
    int host_ranks = 0;
    for (const auto& a : plan.ranks())
      if (a.node_id() == opts_.node_id && a.local_rank() == local) host_ranks = a.host_ranks();
    const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    const int n = host_ranks > 0 ? std::max(1, hw / host_ranks) : im.threads;
    if (n != im.threads) {
      (void)im.cfg->set("train.threads", std::to_string(n));
      configure_threads(*im.cfg);
      im.threads = n;
    }
  }
  try {
    const auto timeout = std::chrono::milliseconds(cfg.get_int("cluster.collective_timeout_ms"));
    const auto rendezvous_timeout = std::max<std::chrono::milliseconds>(timeout, std::chrono::seconds(60));

    // The group, built on a helper thread: a newer plan (or quit) abandons
    // a rendezvous that waits for a member who will never come.
    c10::intrusive_ptr<c10d::ProcessGroup> pg;
    std::shared_ptr<shm_group> shm;
    std::string shm_why, backend;
    if (world > 1) {
      struct build {
        std::mutex mu;
        std::condition_variable cv;
        bool done = false;
        std::optional<result<c10::intrusive_ptr<c10d::ProcessGroup>>> r;
        std::shared_ptr<shm_group> shm;  // set when every rank is on this host (cluster.shm_allreduce)
        std::string shm_why;
      };
      auto b = std::make_shared<build>();
      communicator_options co;
      co.backend = cfg.get_string("cluster.backend");
      co.timeout = rendezvous_timeout;
      co.generation = gen;
      co.hostname = opts_.advertise_addr.empty() ? "127.0.0.1" : opts_.advertise_addr;
      const std::string host = plan.store_host().empty() ? opts_.default_store_host : plan.store_host();
      const auto port = static_cast<uint16_t>(plan.store_port());
      // Gradient floats (+ the 2 control words) a shared-memory slot must hold.
      int64_t shm_floats = 2;
      for (const auto& p : state.the_task().module()->parameters())
        if (p.requires_grad()) shm_floats += p.numel();
      backend = resolve_backend(co);
      const bool want_shm = cfg.get_bool("cluster.shm_allreduce") && backend == "gloo";
      std::thread([b, co, host, port, rank, world, rendezvous_timeout, want_shm, shm_floats] {
        result<c10::intrusive_ptr<c10d::ProcessGroup>> r = make_error("not built");
        try {
          c10d::TCPStoreOptions so;
          so.port = port;
          so.isServer = false;
          so.waitWorkers = false;
          so.timeout = rendezvous_timeout;
          auto store = c10::make_intrusive<c10d::TCPStore>(host, so);
          r = make_process_group(store, rank, world, co);
          if (r.ok() && want_shm) {
            auto prefixed = c10::make_intrusive<c10d::PrefixStore>("g" + std::to_string(co.generation) + "/shm", store);
            std::string why;
            auto joined = shm_group::join(*prefixed, rank, world, shm_floats, &why);
            if (!joined) r = joined.err();
            else {
              std::lock_guard<std::mutex> lock(b->mu);
              b->shm = joined.value();
              b->shm_why = why;
            }
          }
        } catch (const std::exception& e) {
          std::string what = e.what();
          r = make_error("c10d store at " + host + ":" + std::to_string(port) + ": " + what.substr(0, what.find('\n')));
        }
        std::lock_guard<std::mutex> lock(b->mu);
        b->r = std::move(r);
        b->done = true;
        b->cv.notify_all();
      }).detach();
      std::unique_lock<std::mutex> lock(b->mu);
      while (!b->done) {
        if (quitting()) return outcome::quit;
        if (newer_plan_waiting(gen)) return outcome::next_plan;
        b->cv.wait_for(lock, std::chrono::milliseconds(5));
      }
      if (!b->r->ok()) return failed(b->r->message(), state.step());
      pg = b->r->value();
      im.parked.push_back(pg);  // outlives this generation (see impl::parked)
      shm = b->shm;
      shm_why = b->shm_why;
    }

    // The newest disk checkpoint, when the coordinator sent one (everyone
    // was lost, or the job resumes): global rank 0 takes it unless it holds
    // newer state itself.
    std::string source = "local";
    if (rank == 0 && !plan.checkpoint().empty()) {
      pb::checkpoint_data d;
      if (!d.ParseFromString(plan.checkpoint())) return failed("the plan's checkpoint does not parse", state.step());
      if (d.step() > state.step()) {
        if (auto st = state.load_sections(sections_of(d), d.step()); !st) return failed(st.message(), state.step());
        source = "disk";
      }
    }

    // Agreement: the highest step any member holds, and the lowest rank
    // holding it (the root), in one MAX allreduce of
    // (step << 20 | (2^20 - 1 - rank), -step).
    int root = 0;
    int64_t max_step = state.step(), min_step = state.step();
    if (pg) {
      constexpr int64_t shift = int64_t{1} << 20;
      std::vector<torch::Tensor> t{torch::tensor({state.step() * shift + (shift - 1 - rank), -state.step()}, torch::kInt64)};
      c10d::AllreduceOptions mx;
      mx.reduceOp = c10d::ReduceOp::MAX;
      if (auto st = wait_work(pg->allreduce(t, mx), deadline_in(timeout), abandon_now, "state agreement"); !st)
        return failed(st.message(), state.step());
      const int64_t top = t[0][0].item<int64_t>();
      max_step = top / shift;
      root = static_cast<int>(shift - 1 - top % shift);
      min_step = -t[0][1].item<int64_t>();
      if (min_step != max_step) {
        std::string blob;
        if (rank == root) to_checkpoint_data(state.step(), state.save_sections()).SerializeToString(&blob);
        auto got = broadcast_bytes(*pg, root, blob, timeout, abandon_now);
        if (!got) return failed(got.message(), state.step());
        if (rank != root) {
          pb::checkpoint_data d;
          if (!d.ParseFromString(got.value())) return failed("state broadcast from rank " + std::to_string(root) + " does not parse", state.step());
          if (auto st = state.load_sections(sections_of(d), d.step()); !st) return failed(st.message(), state.step());
          source = "peer";
        }
      }
    }
    if (source == "local" && state.step() == 0) source = "fresh";

    grad_sync_options go;
    go.bucket_bytes = cfg.get_int("cluster.bucket_kb") * 1024;
    go.spin_wait = std::chrono::microseconds(cfg.get_int("cluster.spin_wait_us"));
    go.timeout = timeout;
    go.abandon = abandon_now;
    go.control_words = 2;
    go.shm = shm;
    grad_sync sync(state.the_task().module()->parameters(), pg, go);
    // Whatever the last generation left in the gradients is a partial step.
    state.zero_grad();

    {
      // How this generation's gradients travel (shown in the rank's status).
      std::string transport;
      if (world > 1 && sync.uses_shm())
        transport = "gradients over shared memory";
      else if (world > 1)
        transport = "gradients over " + backend + (shm_why.empty() ? "" : " (no shared memory: " + shm_why + ")");
      auto ready = status_of(pb::rank_status::STATE_READY, rank, local, state.step(), transport);
      ready.set_state_source(source);
      ready.set_state_root(root);
      ready.set_switch_s(now_s() - offered_at);
      if (cb_.on_status) cb_.on_status(gen, std::move(ready));
    }

    const int64_t max_steps = cfg.get_int("train.max_steps");
    const int64_t eval_every = cfg.get_int("eval.every_steps");
    const int64_t ckpt_every = cfg.get_int("checkpoint.every_steps");
    const int64_t digest_every = cfg.get_int("cluster.digest_every_steps");
    const int64_t report_every = cfg.get_int("train.log_every_steps");
    std::map<std::string, double> eval_at_step;
    pb::step_report acc;  // sums since the last report
    bool first = true;    // the first step of a generation is reported at once (recovery timing)
    int64_t last_ckpt = -1;
    auto send_checkpoint = [&](int64_t step) {
      auto d = to_checkpoint_data(step, state.save_sections());
      d.set_meta(state.checkpoint_meta(eval_at_step, gen).SerializeAsString());
      if (cb_.on_checkpoint) cb_.on_checkpoint(gen, std::move(d));
      last_ckpt = step;
    };
    if (state.step() >= max_steps && rank == 0) {
      // The job's last step is done but this generation started after it
      // (the old rank 0 may have died before its final evaluation and
      // checkpoint reached the coordinator): the new rank 0 sends both.
      const auto e0 = clock_type::now();
      auto ev = state.evaluate();
      eval_at_step = ev.metrics;
      pb::eval_report er;
      er.set_step(state.step());
      for (const auto& [k, v] : ev.metrics) (*er.mutable_metrics())[k] = v;
      for (const auto& ex : ev.examples) er.add_examples(ex);
      er.set_duration_s(std::chrono::duration<double>(clock_type::now() - e0).count());
      if (cb_.on_eval) cb_.on_eval(gen, er);
      send_checkpoint(state.step());
    }
    while (state.step() < max_steps) {
      if (quitting()) return outcome::quit;
      if (abandon(gen)) return outcome::next_plan;
      const auto t0 = clock_type::now();
      // The step's control word rides at the end of its first gradient
      // bucket (SUM-reduced with it, no collective of its own): (do I hold a
      // plan newer than this generation, is a stop requested here). Every
      // rank reads the same sums after the step: all switch once every rank
      // holds the newer plan, all stop if any rank was asked to, at the same
      // step boundary.
      const bool stop_here = stop_.load();
      sync.set_control({offered_gen_.load() > gen ? 1.f : 0.f, stop_here ? 1.f : 0.f});
      auto r = state.train_step_dp(rank, world, sync);
      if (!r) return failed(r.message(), state.step());
      const int64_t step = state.step();
      acc.set_samples(acc.samples() + r->samples);
      acc.set_allreduce_s(acc.allreduce_s() + r->allreduce_s);
      acc.set_allreduce_exposed_s(acc.allreduce_exposed_s() + r->exposed_s);
      acc.set_steps_covered(acc.steps_covered() + 1);
      if ((digest_every > 0 && step % digest_every == 0) || step == max_steps) {
        const std::string digest = state.params_digest();
        acc.set_params_digest(digest);
        if (pg) {
          auto agree = digests_agree(*pg, digest, timeout, abandon_now);
          if (!agree) return failed(agree.message(), step);
          if (!agree.value()) return failed("parameters differ between ranks at step " + std::to_string(step), step, pb::rank_status::FAILURE_PARAMETERS_DIFFER);
        }
      }
      acc.set_step_s(acc.step_s() + std::chrono::duration<double>(clock_type::now() - t0).count());
      if (first || step % report_every == 0 || step == max_steps) {
        acc.set_step(step);
        acc.set_global_rank(rank);
        acc.set_world_size(world);
        acc.set_loss(r->samples > 0 ? r->loss_sum / static_cast<double>(r->samples) : 0.0);
        acc.set_lr(state.lr_at(step - 1));
        if (cb_.on_step) cb_.on_step(gen, acc);
        acc.Clear();
        first = false;
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
          if (cb_.on_eval) cb_.on_eval(gen, er);
        }
      }
      if (rank == 0 && ((ckpt_every > 0 && step % ckpt_every == 0) || step == max_steps)) send_checkpoint(step);

      if (opts_.fail_at_step >= 0 && step >= opts_.fail_at_step && !im.injected) {
        im.injected = true;
        inject_fault();
      }
      const bool stop_agreed = sync.control()[1] > 0.5f;
      const bool newer_plan = sync.control()[0] > static_cast<float>(world) - 0.5f;
      if (stop_agreed) {
        if (rank == 0 && stop_checkpoint_.load() && last_ckpt != step) send_checkpoint(step);
        status(pb::rank_status::STATE_FINISHED, step, state.params_digest());
        return outcome::stopped;
      }
      if (newer_plan) return outcome::next_plan;
    }
    status(pb::rank_status::STATE_FINISHED, state.step(), state.params_digest());
    return outcome::finished;
  } catch (const std::exception& e) {
    std::string what = e.what();
    state.zero_grad();
    return failed(what.substr(0, what.find('\n')), state.step());
  }
}

void rank_worker::inject_fault() {
  const std::string& m = opts_.fail_mode;
  std::fprintf(stderr, "dtactor: fault injection at step %lld: %s\n", static_cast<long long>(opts_.fail_at_step), m.c_str());
  std::fflush(stderr);
  const pid_t node = ::getppid();
  if (m == "crash") {
    ::kill(node, SIGKILL);
    ::raise(SIGKILL);
  } else if (m == "hang") {
    ::kill(node, SIGSTOP);
    ::raise(SIGSTOP);
  } else if (m == "leave") {
    ::kill(node, SIGTERM);
  } else if (m == "rank-crash") {
    ::raise(SIGKILL);
  }
}

}  // namespace dtactor
