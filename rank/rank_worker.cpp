#include "rank/rank_worker.hpp"

#include <malloc.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <utility>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "job/journal_events.hpp"
#include "actors/wire_enums.hpp"
#include "checkpoint.pb.h"
#include "model/trainer.hpp"
#include "rank/agreement.hpp"
#include "rank/part_writer.hpp"
#include "rank/state_io.hpp"
#include "rank/step_policy.hpp"
#include "rank/sync_diloco.hpp"
#include "rank/zero.hpp"
#include "rank/zero_sync.hpp"
#include "base/blas_info.hpp"
#include "storage/checkpoint_store.hpp"
#include "comm/communicator.hpp"
#include "data/data_shards.hpp"
#include "data/data_wait.hpp"
#include "comm/grad_sync.hpp"
#include "base/process.hpp"
#include "comm/rendezvous_client.hpp"
#include "data/sample_log.hpp"
#include "job/modes.hpp"
#include "job/shipped_file.hpp"
#include "comm/shm_group.hpp"

namespace dtactor {

namespace {

using clock_type = std::chrono::steady_clock;

// Per step, SUM-reduced with the first gradient bucket: (holds a newer
// plan, stop requested, stop with a final checkpoint requested).

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

// The element-wise MAX of every rank's `words`, in place (same length on every rank).
status max_allreduce(c10d::ProcessGroup& pg, std::vector<int64_t>& words, clock_type::time_point deadline, const abandon_fn& abandon,
                     const char* what) {
  std::vector<torch::Tensor> t{torch::tensor(words, torch::kInt64)};
  c10d::AllreduceOptions mx;
  mx.reduceOp = c10d::ReduceOp::MAX;
  if (auto st = wait_work(pg.allreduce(t, mx), deadline, abandon, what); !st) return st;
  const auto a = t[0].accessor<int64_t, 1>();
  for (size_t i = 0; i < words.size(); ++i) words[i] = a[static_cast<int64_t>(i)];
  return {};
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
  job_modes modes;  // cfg's modes, read with it
  std::shared_ptr<training_state> state;
  // Groups of earlier generations: an abandoned collective may still run on
  // their threads, and a group's destructor waits for it. Kept until the
  // process ends (it ends with _exit).
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> parked;
  bool injected = false;
  // Neither train.threads nor --threads-per-rank fixed the thread count:
  // each generation splits the machine's cores over the ranks it plans there.
  bool auto_threads = false;
  std::string module_digest;  // of the shipped module it loaded ("" = none shipped)
  int threads = 0;
  std::unique_ptr<part_writer> writer;  // made at the first checkpoint
  std::optional<bool> wrote_direct;     // how the last checkpoint's part was written (checkpoint.direct = auto says when it changes)
  // train.zero >= 1: who holds which optimizer shard in this generation.
  std::optional<shard_plan> shards;
  // data.sample_log (null: off), and the step this rank last attempted:
  // (step, generation, global rank, world size).
  std::unique_ptr<sample_log> samples_log;
  struct attempt_id {
    int64_t step = -1;
    uint64_t gen = 0;
    int rank = -1, world = 0;
  } attempt;
  // The last generation this rank trained in, its global rank and world
  // size there (world 0: none yet).
  uint64_t trained_gen = 0;
  int trained_rank = -1, trained_world = 0;
  // train.sync = diloco: a rank behind its peers that kept its window trains
  // the steps it missed on its slices of the world its peers took them in,
  // instead of skipping them: steps before `until` (and after the previous
  // segment's) as global rank `rank` of `world`. Ascending by `until`.
  using catch_up_segment = dtactor::catch_up_segment;
  std::vector<catch_up_segment> catch_up;
  // train.sync = diloco, ranks as workers: the slices this rank trained
  // (step, global rank, world size; a replayed one: the fragments it went
  // to, empty = all) since the oldest fragment anchor `slices_anchor`, and
  // the slices of the window that no survivor holds (a lost worker's) that
  // this rank trains again before the next boundary (replay_owed_slices).
  using slice_id = window_slice;  // rank/sync_diloco.hpp
  int64_t slices_anchor = -1;
  std::vector<slice_id> window_slices;
  std::vector<slice_id> replays;
  // `start`: the oldest fragment anchor now (what is older is in every fragment).
  void note_slice(int64_t start, slice_id s) {
    if (slices_anchor != start) {
      window_slices.erase(std::remove_if(window_slices.begin(), window_slices.end(), [&](const slice_id& x) { return x.step < start; }),
                          window_slices.end());
      slices_anchor = start;
    }
    window_slices.push_back(std::move(s));
  }
  // A window's state read from a checkpoint: what global rank `rank` of the
  // `world` that wrote it trained since the oldest fragment anchor `start`
  // (its parameters and moments hold those slices).
  void window_from_checkpoint(int64_t start, int64_t step, int rank, int world) {
    window_slices.clear();
    replays.clear();
    slices_anchor = start;
    for (int64_t s = start; s < step; ++s) window_slices.push_back({s, rank, std::max(1, world), {}});
  }
  void forget_window() {
    window_slices.clear();
    replays.clear();
    slices_anchor = -1;
  }
};

namespace {
// DiLoCo: the oldest fragment anchor (plain DiLoCo: the anchor). A worker's
// steps before it are in every fragment of the global parameters.
int64_t oldest_fragment_anchor(const outer_optimizer& o) {
  int64_t start = o.fragment_anchor(0);
  for (size_t f = 1; f < o.fragments().size(); ++f) start = std::min(start, o.fragment_anchor(f));
  return start;
}
}  // namespace

rank_worker::rank_worker(rank_worker_options opts, rank_worker_callbacks cb)
    : opts_(std::move(opts)), cb_(std::move(cb)), impl_(std::make_unique<impl>()) {
  thread_ = std::thread([this] {
    // Named for top/perf (it would inherit the spawning CAF thread's name).
    ::pthread_setname_np(::pthread_self(), "dtactor-train");
    run();
    {
      std::lock_guard<std::mutex> lock(mu_);  // else join_for may miss the wake-up
      done_.store(true);
    }
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
    // A drain plan switches the ranks of the generation just before it at an
    // agreed step. A rank still in an older one (its node was cut off and
    // declared lost, and now comes back: a zombie) has no part in that
    // agreement, and its peers have left its collective: it abandons at once.
    const uint64_t running = running_gen_.load();
    const bool zombie = running > 0 && running + 1 < plan.generation();
    if ((!plan.drain() || zombie) && plan.generation() > 0) abort_gen_.store(plan.generation());
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
  {
    // Under the lock: take_plan checks quit_ under it and then sleeps; a
    // store between the two was a lost wake-up, and the destructor joined a
    // thread that slept for ever (seen once in the suite under load, in
    // rank_workers.a_diloco_rank_behind_its_peer_...).
    std::lock_guard<std::mutex> lock(mu_);
    quit_.store(true);
  }
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

namespace {
// The module the coordinator shipped (plan.module_object): this node's own
// model.file when it is the same file, else a checked copy fetched from the
// store. Returns the config to load the model with; `module_digest`: the
// shipped module's (unchanged when none is shipped).
result<config> with_shipped_module(const pb::generation_plan& plan, const config& cfg, int local, std::string& module_digest) {
  config load_cfg = cfg;
  if (!plan.module_object().empty()) {
    auto store = open_object_store(plan.checkpoint_store(), default_fs_env(), cfg.get_string("checkpoint.s3_endpoint"));
    if (!store) return make_error("cannot open the checkpoint store for the shipped module: " + store.message());
    auto got = fetch_shipped_file(*store.value(), plan.module_object(), plan.module_digest(), cfg.get_string("model.file"), shipped_cache_dir());
    if (!got) return got.err();
    if (got->path != cfg.get_string("model.file")) {
      std::fprintf(stderr, "rank %d: model.file %s here: using the coordinator's, %s (%s)\n", local,
                   std::filesystem::exists(cfg.get_string("model.file")) ? "differs" : "is missing", got->path.c_str(),
                   got->fetched ? "fetched from the checkpoint store" : "fetched before");
      (void)load_cfg.set("model.file", got->path);
    }
    module_digest = plan.module_digest();
  }
  return load_cfg;
}
}  // namespace

// The rank's set-up from the warm-up plan: its config (the threads fitted
// to the machine), the module the coordinator shipped, the training state,
// the sample log, the modes. An error is one line.
status rank_worker::warm_up(const pb::generation_plan& plan) {
  auto& im = *impl_;
  try {
    auto parsed = config::parse_toml(plan.config_toml(), "generation plan");
    if (!parsed) return parsed.err();
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
    // The module the coordinator shipped: this node's own model.file when it
    // is the same file, else a checked copy fetched from the store.
    auto load_cfg = with_shipped_module(plan, cfg, opts_.local_rank, im.module_digest);
    if (!load_cfg) return load_cfg.err();
    if (opts_.state) {
      im.state = opts_.state;
    } else {
      if (opts_.setup_mmap_threshold > 0) ::mallopt(M_MMAP_THRESHOLD, opts_.setup_mmap_threshold);
      auto created = training_state::create(load_cfg.value());
      if (opts_.step_mmap_threshold > 0) ::mallopt(M_MMAP_THRESHOLD, opts_.step_mmap_threshold);
      if (!created) return created.err();
      im.state = std::move(created.value());
      // The module's own parameter tensors, freed once the optimizer copied
      // them into its flat buffers, go back to the kernel (see train()).
      ::malloc_trim(0);
    }
    if (const std::string& dir = cfg.get_string("data.sample_log"); !dir.empty()) {
      auto opened = sample_log::open(dir, opts_.node_id + "-r" + std::to_string(opts_.local_rank));
      if (!opened) return opened.err();
      im.samples_log = std::move(opened.value());
      im.state->record_samples(true);
    }
    auto modes = job_modes_of(cfg);
    if (!modes) return modes.err();
    im.modes = modes.value();
    im.cfg = std::move(cfg);
  } catch (const std::exception& e) {
    std::string what = e.what();
    return make_error(what.substr(0, what.find('\n')));
  }
  return {};
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
  if (auto st = warm_up(plan); !st) return status(plan.generation(), pb::rank_status::STATE_FAILED, -1, 0, st.message());
  {
    // The data as this rank opened it, for the coordinator to compare.
    auto idle = status_of(pb::rank_status::STATE_IDLE, -1, local, im.state->step(), "warmed up");
    if (opts_.data_digests)
      for (auto& [path, digest] : data_file_digests(*im.cfg)) (*idle.mutable_data_digests())[path] = digest;
    // The module it loaded is the coordinator's, wherever it came from.
    if (!im.module_digest.empty()) (*idle.mutable_data_digests())[im.cfg->get_string("model.file")] = im.module_digest;
    if (cb_.on_status) cb_.on_status(0, std::move(idle));
  }

  uint64_t current = 0;
  for (;;) {
    if (plan.generation() > current) {
      current = plan.generation();
      running_gen_.store(current);
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

// One generation as the training thread runs it.
struct rank_worker::generation_run {
  explicit generation_run(const pb::generation_plan& p) : plan(p) {}
  const pb::generation_plan& plan;
  uint64_t gen = 0;
  int local = 0;
  int rank = -1;
  int world = 0;
  double offered_at = 0;
  std::chrono::milliseconds timeout{0};
  abandon_fn abandon_now;
  c10::intrusive_ptr<c10d::ProcessGroup> pg;  // null when world == 1
  exchange_plan exchange;                     // how gradients travel (cluster.shm_allreduce: shared memory within hosts)
  std::string backend;
  ev::state_source source = ev::state_source::local;  // where the starting state came from
  int root = 0;                                       // global rank the state came from
  uint64_t transfer_bytes = 0;                        // state received from a peer
  double transfer_s = 0;
  uint64_t reshard_bytes = 0;                                  // optimizer shards and parameters moved (train.zero >= 1)
  ev::optimizer_source optimizer = ev::optimizer_source::own;  // where its optimizer shards came from
  // train.sync = diloco: steps this rank skipped to meet the furthest peer,
  // and the window's steps already taken (since the anchor) when it began.
  int64_t skipped_steps = 0, window_steps = 0;
  // ... and the slices of the window no survivor held, trained again by the
  // survivors before the next boundary (replay_owed_slices).
  int64_t replayed_slices = 0;
};

void rank_worker::report_status(generation_run& g, pb::rank_status::state s, int64_t step, const std::string& detail) {
  if (cb_.on_status) cb_.on_status(g.gen, status_of(s, g.rank, g.local, step, detail));
}

rank_worker::outcome rank_worker::failed(generation_run& g, const std::string& why, int64_t step, pb::rank_status::failure_kind kind) {
  if (quitting()) return outcome::quit;
  // Abandoned for a newer plan: not a failure of this generation.
  if (abandon(g.gen)) return outcome::next_plan;
  auto s = status_of(pb::rank_status::STATE_FAILED, g.rank, g.local, step, why);
  s.set_failure(kind);
  if (cb_.on_status) cb_.on_status(g.gen, std::move(s));
  return outcome::failed;
}

rank_worker::outcome rank_worker::checkpoint_unusable(generation_run& g, int64_t checkpoint_step, const std::string& why, bool refused) {
  if (!refused) return failed(g, why, impl_->state->step());
  if (quitting()) return outcome::quit;
  if (abandon(g.gen)) return outcome::next_plan;
  auto s = status_of(pb::rank_status::STATE_FAILED, g.rank, g.local, impl_->state->step(), why);
  s.set_failure(pb::rank_status::FAILURE_CHECKPOINT);
  s.set_refused_checkpoint_step(checkpoint_step);
  if (cb_.on_status) cb_.on_status(g.gen, std::move(s));
  return outcome::failed;
}

void rank_worker::fit_threads_to_host(const pb::generation_plan& plan) {
  auto& im = *impl_;
  if (!im.auto_threads) return;
  // Nodes started by hand on one machine each think they own it; the plan
  // counts every rank of the generation on this machine.
  int host_ranks = 0;
  for (const auto& a : plan.ranks())
    if (a.node_id() == opts_.node_id && a.local_rank() == opts_.local_rank) host_ranks = a.host_ranks();
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int n = host_ranks > 0 ? std::max(1, hw / host_ranks) : im.threads;
  if (n != im.threads) {
    (void)im.cfg->set("train.threads", std::to_string(n));
    configure_threads(*im.cfg);
    im.threads = n;
  }
}

rank_worker::outcome rank_worker::run_generation(const pb::generation_plan& plan, double offered_at) {
  auto& im = *impl_;
  training_state& state = *im.state;
  generation_run g(plan);
  g.gen = plan.generation();
  g.local = opts_.local_rank;
  g.rank = global_rank_in(plan, opts_.node_id, g.local);
  g.world = plan.world_size();
  g.offered_at = offered_at;
  g.timeout = std::chrono::milliseconds(im.cfg->get_int("cluster.collective_timeout_ms"));
  g.abandon_now = [this, gen = g.gen] { return abandon(gen); };
  if (g.rank < 0) {
    // Not in this generation (this node leaves, or this rank was left out).
    report_status(g, pb::rank_status::STATE_IDLE, state.step(), "not in generation " + std::to_string(g.gen));
    return outcome::idle;
  }
  fit_threads_to_host(plan);
  // However the generation ends, a checkpoint write still reading the state
  // (checkpoint.direct) is over before anything else touches it: the next
  // generation's reshard or load, the caller's state after quit.
  struct write_over {
    rank_worker* w;
    training_state& s;
    ~write_over() {
      w->finish_checkpoints();
      s.set_before_update(nullptr);
    }
  } over{this, state};
  try {
    if (g.world > 1)
      if (auto ended = build_group(g)) return *ended;
    if (auto ended = agree_state(g)) return *ended;
    return train(g);
  } catch (const data_error& e) {
    // A shard that cannot be read: no generation can fix it.
    std::string what = e.what();
    state.zero_grad();
    return failed(g, what.substr(0, what.find('\n')), state.step(), pb::rank_status::FAILURE_DATA);
  } catch (const std::exception& e) {
    std::string what = e.what();
    state.zero_grad();
    return failed(g, what.substr(0, what.find('\n')), state.step());
  }
}

// The generation's c10d group, built on a helper thread: a newer plan (or
// quit) abandons a rendezvous that waits for a member who will never come.
// Returns nothing once g.pg is built, or the outcome that ends the generation.
std::optional<rank_worker::outcome> rank_worker::build_group(generation_run& g) {
  auto& im = *impl_;
  const config& cfg = *im.cfg;
  struct build {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::optional<result<c10::intrusive_ptr<c10d::ProcessGroup>>> r;
    exchange_plan exchange;
  };
  auto b = std::make_shared<build>();
  const auto rendezvous_timeout = std::max<std::chrono::milliseconds>(g.timeout, std::chrono::seconds(60));
  communicator_options co;
  co.backend = cfg.get_string("cluster.backend");
  co.timeout = rendezvous_timeout;
  co.generation = g.gen;
  co.hostname = opts_.advertise_addr.empty() ? "127.0.0.1" : opts_.advertise_addr;
  const std::string host = g.plan.store_host().empty() ? opts_.default_store_host : g.plan.store_host();
  const auto port = static_cast<uint16_t>(g.plan.store_port());
  // Gradient floats (+ the control words) a shared-memory slot must hold.
  // The largest bucket is at most a bucket's worth and the largest
  // parameter (a bucket closes once it holds bucket_kb).
  int64_t shm_floats = step_control::words, largest_param = 0;
  for (const auto& p : im.state->the_task().module()->parameters())
    if (p.requires_grad()) {
      shm_floats += p.numel();
      largest_param = std::max<int64_t>(largest_param, p.numel());
    }
  const int64_t largest_floats = cfg.get_int("cluster.bucket_kb") * 256 + largest_param + step_control::words;
  const int64_t ring_floats = cfg.get_int("cluster.shm_ring_mb") * (int64_t{1} << 18);
  g.backend = resolve_backend(co);
  const bool want_shm = cfg.get_bool("cluster.shm_allreduce") && g.backend == "gloo";
  const int rank = g.rank, world = g.world;
  std::thread([b, co, host, port, rank, world, rendezvous_timeout, want_shm, shm_floats, largest_floats, ring_floats, key = opts_.key] {
    result<c10::intrusive_ptr<c10d::ProcessGroup>> r = make_error("not built");
    try {
      auto store = c10::make_intrusive<rendezvous_client>(host, port, rendezvous_timeout, key);
      r = make_process_group(store, rank, world, co);
      if (r.ok() && want_shm) {
        auto ex = setup_exchange(c10::make_intrusive<c10d::PrefixStore>("g" + std::to_string(co.generation) + "/exchange", store), rank, world,
                                 shm_floats, co, host_key(), largest_floats, ring_floats);
        if (!ex)
          r = ex.err();
        else {
          std::lock_guard<std::mutex> lock(b->mu);
          b->exchange = std::move(ex.value());
        }
      }
    } catch (const rendezvous_error& e) {
      // The store's own errors name it already.
      const std::string what = e.what_without_backtrace();
      r = make_error(what.substr(0, what.find('\n')));
    } catch (const std::exception& e) {
      std::string what = e.what();
      what = what.substr(0, what.find('\n'));
      r = make_error("rendezvous store at " + host + ":" + std::to_string(port) + ": " + what);
    }
    std::lock_guard<std::mutex> lock(b->mu);
    b->r = std::move(r);
    b->done = true;
    b->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(b->mu);
  while (!b->done) {
    if (quitting()) return outcome::quit;
    if (newer_plan_waiting(g.gen)) return outcome::next_plan;
    b->cv.wait_for(lock, std::chrono::milliseconds(5));
  }
  if (!b->r->ok()) return failed(g, b->r->message(), im.state->step());
  g.pg = b->r->value();
  im.parked.push_back(g.pg);  // outlives this generation (see impl::parked)
  g.exchange = b->exchange;
  if (g.exchange.hosts) im.parked.push_back(g.exchange.hosts);
  return std::nullopt;
}

// What a generation loads of a checkpoint (load_from_checkpoint), and what
// the load found.
struct rank_worker::checkpoint_load {
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
std::optional<rank_worker::outcome> rank_worker::agree_state(generation_run& g) {
  training_state& state = *impl_->state;
  // Sharded from the first generation on (a fresh rank holds all of it), so
  // that every rank's stream has the same replicated part.
  if (impl_->cfg->get_int("train.zero") >= 1 && !state.optimizer().sharded()) state.shard_optimizer({{0, state.optimizer().total_elements()}});
  // DiLoCo: what a rank holds is its anchor (the last boundary it
  // synchronised at); its steps since are its own window's.
  const bool diloco = state.diloco();
  auto held_of = [&] { return diloco ? state.outer().anchor() : state.step(); };
  if (g.rank == 0 && g.plan.checkpoint_step() > held_of())
    if (auto ended = state_from_plan_checkpoint(g)) return ended;
  if (impl_->cfg->get_int("train.zero") >= 2)
    if (auto ended = finish_zero2_step(g)) return ended;
  const int64_t held_step = state.step();  // what this rank holds before any transfer
  bool own_window = true;  // DiLoCo: this rank goes on with its own window (it held the agreed anchor)
  if (g.pg)
    if (auto ended = take_agreed_state(g, own_window)) return ended;
  if (diloco && g.pg && g.rank != 0 && g.source == ev::state_source::disk && !own_window)
    if (auto ended = worker_section_from_checkpoint(g)) return ended;
  if (impl_->cfg->get_int("train.zero") >= 1)
    if (auto ended = shard_state(g, held_step == state.step())) return ended;
  if (diloco && g.pg)
    if (auto ended = agree_window(g, own_window)) return ended;
  if (g.source == ev::state_source::local && state.step() == 0) g.source = ev::state_source::fresh;
  return std::nullopt;
}

// Nobody alive holds state (agree_state, global rank 0): the checkpoint the
// plan names, read from the store by this rank itself. Sharded (train.zero
// >= 1): its replicated part only; every rank reads its own shards after
// the agreement (shard_state).
std::optional<rank_worker::outcome> rank_worker::state_from_plan_checkpoint(generation_run& g) {
  training_state& state = *impl_->state;
  checkpoint_load l;
  l.step = g.plan.checkpoint_step();
  l.which = impl_->cfg->get_int("train.zero") >= 1 ? load_which::replicated : load_which::all;
  if (auto ended = load_from_checkpoint(g, l)) return ended;
  g.source = ev::state_source::disk;
  impl_->catch_up.clear();
  if (state.diloco()) impl_->window_from_checkpoint(oldest_fragment_anchor(state.outer()), state.step(), 0, l.meta.world_size());
  return std::nullopt;
}

// train.zero >= 2, before the agreement: the step whose gradient-norm
// allreduce failed here after other ranks completed it is finished (this
// rank's shards updated), or dropped without a group.
std::optional<rank_worker::outcome> rank_worker::finish_zero2_step(generation_run& g) {
  training_state& state = *impl_->state;
  if (!g.pg) {
    state.drop_interrupted_step();
  } else {
    auto finished = finish_interrupted_step(*g.pg, state, g.timeout, g.abandon_now);
    if (!finished) return failed(g, finished.message(), state.step());
    // The samples are the attempt's, of the generation that computed them.
    if (*finished && impl_->attempt.step == state.step() - 1)
      if (auto st = log_samples(impl_->attempt.step, impl_->attempt.gen, impl_->attempt.rank, impl_->attempt.world); !st)
        return failed(g, st.message(), state.step(), pb::rank_status::FAILURE_DATA);
    if (*finished)
      std::fprintf(stderr,
                   "rank %d: generation %llu: finished step %lld's update of this rank's shards (its gradient-norm allreduce failed here "
                   "and completed on other ranks, which stepped theirs)\n",
                   g.rank, static_cast<unsigned long long>(g.gen), static_cast<long long>(state.step() - 1));
  }
  return std::nullopt;
}

// The one state agreement (MAX of agreement_words): the highest step (DiLoCo:
// anchor) any member holds and the lowest rank holding it, the root; when
// not everyone holds it, the state is broadcast from the root. `own_window`
// (DiLoCo): whether this rank keeps its window's own progress.
std::optional<rank_worker::outcome> rank_worker::take_agreed_state(generation_run& g, bool& own_window) {
  training_state& state = *impl_->state;
  const bool diloco = state.diloco();
  auto held_of = [&] { return diloco ? state.outer().anchor() : state.step(); };
  const auto words = agreement_words(held_of(), g.rank);
  std::vector<torch::Tensor> t{torch::tensor({words.first, words.second}, torch::kInt64)};
  c10d::AllreduceOptions mx;
  mx.reduceOp = c10d::ReduceOp::MAX;
  if (auto st = wait_work(g.pg->allreduce(t, mx), deadline_in(g.timeout), g.abandon_now, "state agreement"); !st)
    return failed(g, st.message(), state.step());
  const auto a = read_agreement(t[0][0].item<int64_t>(), t[0][1].item<int64_t>());
  g.root = a.root;
  if (!a.everyone_holds_it()) {
    // DiLoCo: a rank holding the agreed anchor keeps its window's own
    // progress (parameters, buffers, inner moments, step) through the
    // transfer; the others start their window over from the anchor.
    const bool keep_window = diloco && held_of() == a.max_step;
    own_window = keep_window;
    std::vector<std::pair<torch::Tensor, torch::Tensor>> kept;  // (live, copy)
    const int64_t own_step = state.step(), own_inner_steps = state.optimizer().steps_taken();
    if (keep_window) {
      torch::NoGradGuard no_grad;
      for (auto& st : state.state_tensors())
        if (st.name.rfind("outer/", 0) != 0) kept.emplace_back(st.t, st.t.clone());
    }
    // In place, in chunks, over the data plane (bounded extra memory).
    int64_t from_disk = g.source == ev::state_source::disk ? 1 : 0;
    auto sent = broadcast_state(*g.pg, g.root, state, g.timeout, g.abandon_now, from_disk);
    if (!sent) return failed(g, sent.message(), state.step());
    if (diloco) {
      torch::NoGradGuard no_grad;
      if (keep_window) {
        for (auto& [live, copy] : kept) live.copy_(copy);
        state.state_loaded(own_step);
        state.optimizer().set_steps_taken(own_inner_steps);
      } else {
        state.outer().reset_to_global();
        state.state_loaded(state.outer().anchor());
        impl_->forget_window();
      }
    }
    if (g.rank != g.root) {
      // The generation's state came from the store when its root loaded
      // it from there (every rank says so: one story in the journal).
      g.source = from_disk ? ev::state_source::disk : ev::state_source::peer;
      g.transfer_bytes = sent->bytes;
      g.transfer_s = sent->seconds;
    }
  }
  return std::nullopt;
}

// DiLoCo, after the state agreement: the furthest step any worker reached in
// the window, the catch-up or skip of this rank, and the replay of a lost
// worker's slices (replay_owed_slices).
std::optional<rank_worker::outcome> rank_worker::agree_window(generation_run& g, bool own_window) {
  training_state& state = *impl_->state;
  // The workers go on from the furthest step any of them reached in the
  // window (no one's inner steps are undone); one behind catches up on
  // the steps its peers took, or skips them (below).
  auto& im = *impl_;
  std::vector<torch::Tensor> t{torch::tensor({state.step(), static_cast<int64_t>(im.trained_gen)}, torch::kInt64)};
  c10d::AllreduceOptions mx;
  mx.reduceOp = c10d::ReduceOp::MAX;
  if (auto st = wait_work(g.pg->allreduce(t, mx), deadline_in(g.timeout), g.abandon_now, "agreement on the window's step"); !st)
    return failed(g, st.message(), state.step());
  const int64_t furthest = t[0][0].item<int64_t>();
  const uint64_t newest_trained = static_cast<uint64_t>(t[0][1].item<int64_t>());
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
  while (!im.catch_up.empty() && im.catch_up.front().until <= own) im.catch_up.erase(im.catch_up.begin());
  const bool catch_up = own_window && furthest > own && im.trained_world > 0 && im.trained_gen == newest_trained &&
                        im.modes.diloco_worker != diloco_worker_kind::host;
  if (catch_up) {
    if (im.catch_up.empty() || im.catch_up.back().until < furthest) im.catch_up.push_back({furthest, im.trained_rank, im.trained_world});
  } else {
    im.catch_up.clear();
    g.skipped_steps = furthest - own;
    state.skip_to(furthest);
  }
  if (auto ended = replay_owed_slices(g, furthest)) return ended;
  return std::nullopt;
}

// DiLoCo, a generation whose state came from a checkpoint (global rank 0
// read it and sent it to all): a rank other than 0 takes its own inner
// state (parameters, buffers, inner moments) from its section of the
// checkpoint when there is one, so that a resume at the same world size is
// exact; without one (a checkpoint of fewer workers, or diloco_workers =
// first) it goes on with rank 0's.
std::optional<rank_worker::outcome> rank_worker::worker_section_from_checkpoint(generation_run& g) {
  auto& im = *impl_;
  training_state& state = *im.state;
  checkpoint_load l;
  l.step = g.plan.checkpoint_step();
  l.own_section = true;
  if (auto ended = load_from_checkpoint(g, l)) return ended;
  if (l.loaded) state.state_loaded(l.meta.step());
  // Its own section: its own slices of the checkpoint's window; else rank 0's.
  im.window_from_checkpoint(oldest_fragment_anchor(state.outer()), state.step(), l.loaded ? g.rank : 0, l.meta.world_size());
  return std::nullopt;
}

// The one path of every checkpoint load: open the plan's store, read the
// manifest of the step the plan names, check that it fits this job, then
// read what the load planner names for this rank (rank/state_io's
// load_checkpoint and load_worker_section, storage/checkpoint_plan).
std::optional<rank_worker::outcome> rank_worker::load_from_checkpoint(generation_run& g, checkpoint_load& l) {
  auto& im = *impl_;
  training_state& state = *im.state;
  const std::string name = manifest_name(l.step);
  const std::string where = g.plan.checkpoint_store() + "/" + name;
  auto store = checkpoint_store::open_readonly(g.plan.checkpoint_store(), im.cfg->get_string("checkpoint.s3_endpoint"));
  if (!store) return failed(g, "checkpoint store: " + store.message(), state.step());
  auto meta = store->read_manifest(name);
  if (!meta) return checkpoint_unusable(g, l.step, "checkpoint " + where + ": " + meta.message(), meta.code() == errc::corrupt_checkpoint);
  if (auto st = check_checkpoint_compatible(meta.value(), *im.cfg, where); !st) return checkpoint_unusable(g, l.step, st.message(), true);
  status st;
  if (l.own_section) {
    auto section = load_worker_section(state, store.value(), meta.value(), g.rank);
    if (!section) st = section.err();
    l.loaded = section && *section;
  } else {
    st = load_checkpoint(state, store.value(), meta.value(), l.which, &l.bytes_read);
    l.loaded = st.ok();
  }
  if (!st) return checkpoint_unusable(g, l.step, "checkpoint " + where + ": " + st.message(), st.code() == errc::corrupt_checkpoint);
  l.meta = std::move(meta.value());
  return std::nullopt;
}

// train.diloco_worker = host, and this rank's host is a worker of several
// ranks, synchronous over its shared-memory segment (else every rank is a
// worker of its own). The same on every rank of a host.
bool rank_worker::host_worker(const generation_run& g) const {
  return impl_->state->diloco() && impl_->modes.diloco_worker == diloco_worker_kind::host && g.world > 1 && g.exchange.shm &&
         g.exchange.host_ranks > 1 && (g.exchange.hierarchical || g.exchange.host_count == 1);
}


// DiLoCo (ranks as workers), at a new generation, after the agreement on
// the furthest step: the slices of the window's steps (the oldest fragment
// anchor to furthest) that no survivor trained or will train catching up
// were a lost worker's (trained and gone with it, or never reached). They
// are found from what every survivor holds, in two MAX allreduces (each
// step's world size, then which fragments of each slice someone holds),
// dealt round-robin over the new world and trained again before the next
// boundary (training_state::replay_slice), so that every sample of the
// window reaches every fragment's next outer step once. Streaming: a slice
// of a step before fragment f's anchor is in f already (the lost worker's
// pseudo-gradient was in that exchange), so it is owed to the other
// fragments only. Every rank computes the same list.
std::optional<rank_worker::outcome> rank_worker::replay_owed_slices(generation_run& g, int64_t furthest) {
  auto& im = *impl_;
  training_state& state = *im.state;
  const outer_optimizer& outer = state.outer();
  im.replays.clear();
  const window_span w{oldest_fragment_anchor(outer), furthest};
  if (w.len() <= 0) return std::nullopt;
  std::vector<int64_t> anchors;
  for (size_t f = 0; f < outer.fragments().size(); ++f) anchors.push_back(outer.fragment_anchor(f));
  const auto held = held_slices(im.window_slices, im.catch_up, state.step(), w);
  const char* what = "agreement on the window's slices";
  // 1. Each step's world size (the world its peers took it in); 2. which
  // fragments of each slice (of that step's world only) someone holds.
  auto worlds = slice_world_words(held, w);
  if (auto st = max_allreduce(*g.pg, worlds, deadline_in(g.timeout), g.abandon_now, what); !st) return failed(g, st.message(), state.step());
  auto bits = slice_fragment_words(held, w, worlds, static_cast<int64_t>(anchors.size()));
  if (auto st = max_allreduce(*g.pg, bits, deadline_in(g.timeout), g.abandon_now, what); !st) return failed(g, st.message(), state.step());
  // Who replays: the workers, each rank (or, with hosts as workers, each
  // host: its ranks together, each a part of the slice), round-robin in
  // the order of their lowest rank. With hosts, the leaders are marked in
  // one more allreduce (a host of one rank is a worker of its own).
  replay_unit u{g.world, g.rank, 0, 1};
  if (im.modes.diloco_worker == diloco_worker_kind::host) {
    const bool host = host_worker(g);
    const int leader = host ? g.exchange.host_members.front() : g.rank;
    std::vector<int64_t> leaders(static_cast<size_t>(g.world), 0);
    leaders[static_cast<size_t>(leader)] = 1;
    if (auto st = max_allreduce(*g.pg, leaders, deadline_in(g.timeout), g.abandon_now, what); !st) return failed(g, st.message(), state.step());
    count_units(leaders, leader, u);
    if (host) {
      const auto& m = g.exchange.host_members;
      u.parts = static_cast<int>(m.size());
      u.part = static_cast<int>(std::find(m.begin(), m.end(), g.rank) - m.begin());
    }
  }
  auto dealt = deal_owed_slices(w, worlds, bits, anchors, u);
  im.replays = std::move(dealt.mine);
  g.replayed_slices = dealt.owed;
  return std::nullopt;
}

// train.zero >= 1, after the agreement: this generation's shard plan, and
// every rank's optimizer moments resharded to it from whoever holds them at
// the agreed step. When both holders of some shard were lost, the newest
// committed checkpoint: global rank 0 loads it whole and the others take
// their shards from it.
std::optional<rank_worker::outcome> rank_worker::shard_state(generation_run& g, bool holds_current) {
  auto& im = *impl_;
  training_state& state = *im.state;
  flat_adamw& opt = state.optimizer();
  const int64_t total = opt.total_elements();
  std::vector<std::string> nodes(static_cast<size_t>(g.world));
  for (const auto& r : g.plan.ranks())
    if (r.global_rank() >= 0 && r.global_rank() < g.world) nodes[static_cast<size_t>(r.global_rank())] = r.node_id();
  const int64_t want_replicas = im.cfg->get_int("train.zero_replicas");
  const int replicas = want_replicas > 0 ? static_cast<int>(want_replicas) : default_replicas(nodes);
  auto plan = make_shard_plan(total, nodes, replicas);
  // The agreed state came from a checkpoint: each rank reads its own
  // shards from it. Agreed, since the rank that read it may be the only one
  // to know (the others held that step already).
  bool from_disk = g.source == ev::state_source::disk;
  if (g.pg) {
    std::vector<int64_t> word{from_disk ? 1 : 0};
    if (auto st = max_allreduce(*g.pg, word, deadline_in(g.timeout), g.abandon_now, "agreement on the optimizer state's source"); !st)
      return failed(g, st.message(), state.step());
    from_disk = word[0] > 0;
  }
  if (from_disk) return shards_from_checkpoint(g, plan, g.plan.checkpoint_step());
  std::string missing;
  if (!g.pg) {
    // Alone: this rank must hold everything.
    const auto held = opt.held_ranges();
    if (held == std::vector<std::pair<int64_t, int64_t>>{{0, total}} || !opt.sharded()) {
      state.shard_optimizer({{0, total}});
      im.shards = plan;
      return std::nullopt;
    }
    missing = "elements outside this rank's shards";
  } else {
    auto r = reshard_optimizer(*g.pg, opt, plan, holds_current, state.params_mixed(), g.timeout, g.abandon_now);
    if (!r) {
      (void)state.reset_state();  // half-moved shards: this rank holds nothing current
      return failed(g, r.message(), state.step());
    }
    if (r->complete) {
      state.clear_params_mixed();
      im.shards = plan;
      g.reshard_bytes = r->bytes_in + r->bytes_out;
      if (r->moments_in > 0) g.optimizer = ev::optimizer_source::replica;
      return std::nullopt;
    }
    missing = r->missing;
  }
  return shards_from_fallback(g, plan, missing);
}

// Some optimizer state is lost with its holders (shard_state: `missing`):
// back to the checkpoint the plan names for that (the coordinator's choice,
// never this rank's). Global rank 0 reads its replicated part and sends it
// to all; then every rank reads its own shards.
std::optional<rank_worker::outcome> rank_worker::shards_from_fallback(generation_run& g, const shard_plan& plan, const std::string& missing) {
  auto& im = *impl_;
  training_state& state = *im.state;
  std::fprintf(stderr, "rank %d: generation %llu: optimizer state of %s was held only by lost ranks; resuming from the plan's checkpoint\n", g.rank,
               static_cast<unsigned long long>(g.gen), missing.c_str());
  // With none committed, the job starts over from step 0 (every step is
  // lost, and the journal's recovery says so): failing instead would fail
  // the same way in every generation after.
  const int64_t fallback = g.plan.has_fallback_checkpoint_step() ? g.plan.fallback_checkpoint_step() : -1;
  bool have_checkpoint = fallback >= 0;
  if (g.rank == 0 && have_checkpoint) {
    checkpoint_load l;
    l.step = fallback;
    l.which = load_which::replicated;
    if (auto ended = load_from_checkpoint(g, l)) return ended;
  } else if (g.rank == 0) {
    std::fprintf(stderr, "rank 0: generation %llu: the plan names no checkpoint to go back to (none is committed in %s that no rank refused): "
                 "the job starts over from step 0\n", static_cast<unsigned long long>(g.gen), g.plan.checkpoint_store().c_str());
    if (auto st = state.reset_state(); !st) return failed(g, "starting over: " + st.message(), state.step());
  } else {
    (void)state.reset_state();
  }
  g.source = ev::state_source::disk;
  if (g.pg) {
    int64_t from_disk = have_checkpoint ? 1 : 0;
    auto sent = broadcast_state(*g.pg, 0, state, g.timeout, g.abandon_now, from_disk);
    if (!sent) return failed(g, sent.message(), state.step());
    g.root = 0;
    have_checkpoint = from_disk != 0;
  }
  if (!have_checkpoint) {
    // reset_state() zeroed every rank's moments: a fresh optimizer.
    state.shard_optimizer(plan.ranges_of(g.rank));
    state.clear_params_mixed();
    im.shards = plan;
    g.source = ev::state_source::fresh;
    g.optimizer = ev::optimizer_source::restart;
    return std::nullopt;
  }
  return shards_from_checkpoint(g, plan, fallback);
}

// Every rank of a generation whose state came from the checkpoint at `step`
// (the plan's: global rank 0 loaded it and sent it to all): its own shards'
// moments, read from the parts that hold them (each part whole, its
// checksum checked), not the whole checkpoint.
std::optional<rank_worker::outcome> rank_worker::shards_from_checkpoint(generation_run& g, const shard_plan& plan, int64_t step) {
  auto& im = *impl_;
  training_state& state = *im.state;
  if (step != state.step())
    return failed(g, "the agreed state is at step " + std::to_string(state.step()) + ", the plan's checkpoint at step " + std::to_string(step),
                  state.step());
  state.shard_optimizer(plan.ranges_of(g.rank));
  checkpoint_load l;
  l.step = step;
  l.which = load_which::shards;
  if (auto ended = load_from_checkpoint(g, l)) return ended;
  std::fprintf(stderr, "rank %d: generation %llu: optimizer shards read from the checkpoint at step %lld: %llu of its %llu bytes\n", g.rank,
               static_cast<unsigned long long>(g.gen), static_cast<long long>(state.step()), static_cast<unsigned long long>(l.bytes_read),
               static_cast<unsigned long long>(l.meta.state_bytes()));
  state.clear_params_mixed();
  im.shards = plan;
  g.optimizer = ev::optimizer_source::checkpoint;
  g.reshard_bytes = l.bytes_read;
  return std::nullopt;
}

double rank_worker::send_eval(generation_run& g, std::map<std::string, double>& eval_at_step) {
  training_state& state = *impl_->state;
  const auto e0 = clock_type::now();
  auto ev = state.evaluate();
  eval_at_step = ev.metrics;
  const double took = std::chrono::duration<double>(clock_type::now() - e0).count();
  if (g.rank == 0 && cb_.on_eval) cb_.on_eval(g.gen, eval_report_of(state.step(), ev.metrics, ev.examples, took));
  return took;
}

// After an evaluation every rank ran: ranks finish it at different times (a
// loaded machine, a busier host), and the first would otherwise wait for
// the last in the next step's collective, under the collective timeout. They
// meet here instead, with room for the evaluation's own length. Dead peers
// are still noticed by the heartbeats (a newer plan abandons the wait).
std::optional<rank_worker::outcome> rank_worker::meet_after_eval(generation_run& g, double eval_s) {
  if (!g.pg) return std::nullopt;
  const auto room = std::chrono::milliseconds(static_cast<int64_t>(std::max(60.0, 10 * eval_s) * 1000));
  std::vector<torch::Tensor> t{torch::zeros({1})};
  if (auto st = wait_work(g.pg->allreduce(t), deadline_in(g.timeout + room), g.abandon_now, "meeting after the evaluation"); !st)
    return failed(g, st.message(), impl_->state->step());
  return std::nullopt;
}

// The writer of this rank's checkpoint parts, made once (checkpoint.keep_buffer,
// checkpoint.direct).
void rank_worker::ensure_part_writer() {
  auto& im = *impl_;
  if (im.writer) return;
  im.writer = std::make_unique<part_writer>(
      [this](uint64_t gen, pb::checkpoint_written w) {
        if (cb_.on_checkpoint) cb_.on_checkpoint(gen, std::move(w));
      },
      im.cfg->get_bool("checkpoint.keep_buffer"));
}

// checkpoint.direct: true, false, or (auto) straight from the state when
// this host has no room for a part buffer per rank (part_buffer_fits); a
// buffer this rank already holds is used.
bool rank_worker::checkpoint_direct(generation_run& g, uint64_t bytes, int64_t step) {
  auto& im = *impl_;
  if (im.modes.direct != direct_checkpoint::automatic) return im.modes.direct == direct_checkpoint::on;
  if (im.writer->buffer_bytes() >= bytes) return false;
  const int ranks = std::max<int>({1, static_cast<int>(g.exchange.host_members.size()), opts_.local_world});
  const memory_room room = read_memory_room();
  const bool direct = !part_buffer_fits(bytes, ranks, room);
  if (im.wrote_direct != direct) {
    auto gb = [](double b) { return b / 1e9; };
    if (direct)
      std::fprintf(stderr,
                   "rank %d: checkpoint at step %lld written straight from the state during the next step (checkpoint.direct = auto): no room for "
                   "%d part buffers of %.2f GB beside the steps (%.2f GB available on this host, this rank's step takes %.2f GB more than it holds)\n",
                   g.rank, static_cast<long long>(step), ranks, gb(static_cast<double>(bytes)), gb(static_cast<double>(room.available)),
                   gb(static_cast<double>(room.step_headroom)));
    else if (im.wrote_direct)
      std::fprintf(stderr, "rank %d: checkpoint at step %lld copied into a %.2f GB buffer again (checkpoint.direct = auto: there is room now)\n", g.rank,
                   static_cast<long long>(step), gb(static_cast<double>(bytes)));
  }
  return direct;
}

namespace {
// The stream a checkpoint of this generation holds: the state's layout and,
// DiLoCo with checkpoint.diloco_workers = all, every other worker's own
// inner state after it as a section of its own.
state_layout checkpoint_layout(training_state& state, const job_modes& modes, int rank, int world) {
  const bool sections = state.diloco() && world > 1 && modes.checkpoint_workers == diloco_checkpoint_workers::all;
  return sections ? with_worker_sections(layout_of(state), rank, world) : layout_of(state);
}

// This rank's byte ranges of it, as the save planner decides them
// (storage/checkpoint_plan through state_io's save_ranges): sharded, its
// share of the replicated bytes and the windows of the shards it is the
// primary of; DiLoCo, worker 0 the stream proper (global rank 0's whole
// state, not a mix) and each other worker its section (none: an empty part);
// else its balanced share.
std::vector<byte_range> checkpoint_ranges(training_state& state, const std::optional<shard_plan>& shards, const state_layout& layout, int rank,
                                          int world) {
  rank_share share;
  share.rank = rank;
  share.world = world;
  share.per_worker = state.diloco();
  if (shards && layout.sharded()) {
    const auto& mine = shards->shards[static_cast<size_t>(rank)];
    share.primary = {{mine.begin, mine.end}};
    share.held = shards->ranges_of(rank);
  }
  return save_ranges(layout, share, state.optimizer().group_bases());
}
}  // namespace

void rank_worker::write_checkpoint(generation_run& g, const std::map<std::string, double>& eval_at_step) {
  auto& im = *impl_;
  training_state& state = *im.state;
  if (g.plan.checkpoint_store().empty()) return;  // the plan names no store: checkpoints are off
  ensure_part_writer();
  const state_layout layout = checkpoint_layout(state, im.modes, g.rank, g.world);
  part_writer::job j;
  j.step = state.step();
  j.generation = g.gen;
  j.rank = g.rank;
  j.world = g.world;
  j.node_id = opts_.node_id;
  j.store = g.plan.checkpoint_store();
  j.s3_endpoint = im.cfg->get_string("checkpoint.s3_endpoint");
  j.ranges = checkpoint_ranges(state, im.shards, layout, g.rank, g.world);
  if (g.rank == 0) {
    auto meta = state.checkpoint_meta(eval_at_step, g.gen);
    describe_layout(layout, meta);
    meta.set_world_size(g.world);
    j.meta = meta.SerializeAsString();
  }
  uint64_t bytes = 0;
  for (const auto& [a, b] : j.ranges) bytes += b - a;
  const bool direct = checkpoint_direct(g, bytes, j.step);
  im.wrote_direct = direct;
  // Direct: the write reads the parameters and moments while the next step
  // computes its gradients; its update (or whatever else changes them
  // first) waits for the write.
  if (direct) state.set_before_update([w = im.writer.get()] { w->fence(); });
  im.writer->submit(layout, std::move(j), direct);
}

void rank_worker::finish_checkpoints() {
  if (impl_->writer) impl_->writer->wait_idle();
}

// The step loop of a generation, until the job ends, a stop every rank
// agreed on, a switch to a newer plan, or a failure.
namespace {

// What a rank's READY status says about how its generation's gradients
// (and, with ZeRO, parameters; with DiLoCo, pseudo-gradients) travel.
struct transport_facts {
  int rank = 0, world = 1;
  std::string backend;
  const exchange_plan* exchange = nullptr;
  uint64_t reshard_bytes = 0;
  bool over_shm = false;           // the reducer uses the segment (alone or hierarchical)
  bool fragments_off_shm = false;  // streaming DiLoCo's fragments left it to the host's reducer
  const shard_plan* shards = nullptr;
  bool zero2 = false;
  const param_sync* zero_sync = nullptr;  // how the parameters are gathered (train.zero >= 1)
  size_t fragments = 0;  // streaming DiLoCo: the fragments' reducers
  bool host_sync = false;
  std::string host_workers_why_not;
};

std::string describe_transport(const transport_facts& f, training_state& state, const config& cfg) {
  std::string transport;
  if (f.world > 1 && f.over_shm) {
    transport = f.exchange->describe(f.backend);
  } else if (f.world > 1) {
    std::string why = f.exchange->why_not;
    if (f.fragments_off_shm) why = "overlapped fragments leave the host's segment to the host's per-step reducer";
    if (why.empty() && (f.exchange->shm || f.exchange->hierarchical)) why = "the gradients are not all float32, or do not fit the segment";
    transport = "gradients over " + f.backend + (why.empty() ? "" : " (no shared memory: " + why + ")");
  }
  if (f.shards && f.world > 1) {
    const auto& sp = *f.shards;
    transport += "; optimizer state" + std::string(f.zero2 ? " and gradients" : "") + " sharded (train.zero=" + std::to_string(f.zero2 ? 2 : 1) + "): this rank holds " + std::to_string(sp.held_elements(f.rank)) + " of " +
                 std::to_string(sp.total) + " elements, " + std::to_string(sp.shards.empty() ? 0 : sp.shards[0].holders.size()) +
                 " holder(s) a shard, " + std::to_string(f.reshard_bytes) + " bytes moved, parameters gathered " +
                 (f.zero_sync ? f.zero_sync->describe() : "over " + f.backend);
  }
  if (state.diloco() && f.world > 1) {
    // The same transport carries the pseudo-gradients, once a window.
    const auto at = transport.find("gradients");
    if (at != std::string::npos) transport.replace(at, 9, "pseudo-gradients");
    const auto& oo = state.outer().options();
    std::string how = "train.sync_every=" + std::to_string(cfg.get_int("train.sync_every"));
    if (f.fragments > 0)
      how += ", " + std::to_string(f.fragments) + " fragments, overlap " + std::to_string(oo.overlap) + " step(s), mix " + std::to_string(oo.mix).substr(0, 4);
    if (f.host_sync)
      how += ", workers are hosts: " + std::to_string(f.exchange->host_ranks) + " ranks here, synchronous over shared memory every step";
    else if (!f.host_workers_why_not.empty())
      how += ", train.diloco_worker = host but this rank is a worker of its own (" + f.host_workers_why_not + ")";
    transport = "DiLoCo (" + how + "): " + transport + ", window at step " + std::to_string(state.step()) + " of anchor " +
                std::to_string(state.outer().anchor());
  }
  return transport;
}

}  // namespace

// One generation's steps as train() runs them: the exchanges chosen once
// for the generation, the step in hand, and what the steps add up between
// two step reports.
struct rank_worker::steps_run {
  grad_sync_options options;
  // One reducer, or one a streaming DiLoCo fragment (their exchanges take
  // turns on the same transport, one in flight at a time).
  std::vector<std::unique_ptr<grad_sync>> syncs;
  // train.diloco_worker = host: the host's per-step reducer (it takes turns
  // with the outer exchange on the host's segment), or why there is none.
  std::unique_ptr<grad_sync> host_sync;
  std::string host_workers_why_not;
  bool zero2 = false;     // gradients reduce-scattered into the optimizer's windows
  bool streaming = false, fragments_off_shm = false;
  // Buffers training changes (BatchNorm): rank 0's go to every rank after
  // each step (PyTorch DDP's broadcast_buffers), or the ranks' states drift
  // apart and the digest comparison stops the job.
  std::vector<torch::Tensor> moving_buffers;

  training_state::dp_step r;  // the step in hand (DiLoCo: its outer exchanges' times added)
  step_control mine;          // this rank's control for the step
  step_control agreed;        // the last exchange's sums of the ranks' controls

  pb::step_report acc;        // sums since the last report
  double loss_sum_steps = 0;  // its steps' mean losses since the last report
  int64_t loss_steps = 0;
  bool first = true;  // the first step of a generation is reported at once (recovery timing)
  clock_type::time_point window_began = clock_type::now();

  grad_sync& sync() const { return *syncs.front(); }
  int64_t buffer_bytes() const {
    int64_t n = 0;
    for (const auto& x : syncs) n += x->buffer_bytes();
    return n + (host_sync ? host_sync->buffer_bytes() : 0);
  }
};

status rank_worker::choose_exchanges(generation_run& g, steps_run& s) {
  auto& im = *impl_;
  training_state& state = *im.state;
  const config& cfg = *im.cfg;
  auto spec = exchange_spec_of(cfg);
  if (!spec) return spec.err();
  grad_sync_options& go = s.options;
  go.bucket_bytes = cfg.get_int("cluster.bucket_kb") * 1024;
  go.spin_wait = std::chrono::microseconds(cfg.get_int("cluster.spin_wait_us"));
  go.timeout = g.timeout;
  go.abandon = g.abandon_now;
  go.carry_control = true;
  go.exchange = spec.value();
  go.exchange.transport = transport_for(spec.value(), g.exchange);
  go.shm = g.exchange.shm;
  go.hosts = g.exchange.hosts;
  // train.zero = 2: each rank receives only its shards' summed gradients,
  // straight into the optimizer's gradient windows; the clipping norm is
  // the sum of the primaries' partial sums (one small allreduce a step).
  s.zero2 = im.shards && g.pg && g.world > 1 && cfg.get_int("train.zero") >= 2;
  if (s.zero2) go.zero2 = zero2_of(state.optimizer(), *im.shards);
  // train.diloco_worker = host: the ranks of a host are one worker,
  // synchronous inside through the host's segment (host_sync below).
  const bool host_workers = host_worker(g);
  // Streaming DiLoCo: one reducer a fragment (its parameters only). Only
  // with host workers and an overlap do the fragments go over the process
  // group: the host's per-step reducer uses the segment while a fragment is
  // in flight.
  s.streaming = state.diloco() && state.outer().streaming();
  s.fragments_off_shm = s.streaming && host_workers && state.outer().options().overlap > 0;
  if (s.streaming) {
    std::vector<torch::Tensor> trained;
    for (auto& p : state.the_task().module()->parameters())
      if (p.requires_grad()) trained.push_back(p);
    grad_sync_options fo = go;
    if (s.fragments_off_shm) {
      fo.exchange.transport = exchange_transport::process_group;
      fo.shm = nullptr;
      fo.hosts = c10::intrusive_ptr<c10d::ProcessGroup>();
    }
    for (const auto& fr : state.outer().fragments()) {
      std::vector<torch::Tensor> part(trained.begin() + static_cast<std::ptrdiff_t>(fr.first_param),
                                      trained.begin() + static_cast<std::ptrdiff_t>(fr.first_param + fr.params));
      s.syncs.push_back(std::make_unique<grad_sync>(std::move(part), g.pg, fo));
    }
  } else {
    s.syncs.push_back(std::make_unique<grad_sync>(state.the_task().module()->parameters(), g.pg, go));
  }
  // train.zero >= 1: the reducer's parameter sync (the all-gather after
  // the update, zero=2's norm), over the path the ranks' places allow.
  s.sync().set_parameter_sync(zero_sync_for(s.sync(), g.exchange, state.optimizer(), im.shards ? &*im.shards : nullptr,
                                            {g.pg, s.zero2, g.timeout, g.abandon_now, go.spin_wait, g.backend}));
  if (state.diloco() && im.modes.diloco_worker == diloco_worker_kind::host && g.world > 1) {
    if (host_workers) {
      grad_sync_options ho;
      ho.bucket_bytes = go.bucket_bytes;
      ho.spin_wait = go.spin_wait;
      ho.timeout = go.timeout;
      ho.abandon = go.abandon;
      ho.shm = g.exchange.shm;
      ho.exchange.transport = exchange_transport::host;
      s.host_sync = std::make_unique<grad_sync>(state.the_task().module()->parameters(), c10::intrusive_ptr<c10d::ProcessGroup>(), ho);
    } else {
      s.host_workers_why_not = g.exchange.host_ranks <= 1 ? "this rank is alone on its host"
                               : g.exchange.why_not.empty() ? "no shared memory"
                                                            : g.exchange.why_not;
    }
  }
  if (g.pg && state.the_task().buffers_change_in_training())
    for (auto& b : state.the_task().module()->buffers()) s.moving_buffers.push_back(b);
  return {};
}

// How this generation's gradients travel, shown in the rank's READY status.
void rank_worker::report_ready(generation_run& g, const steps_run& s) {
  auto& im = *impl_;
  training_state& state = *im.state;
  transport_facts tf;
  tf.rank = g.rank;
  tf.world = g.world;
  tf.backend = g.backend;
  tf.exchange = &g.exchange;
  tf.reshard_bytes = g.reshard_bytes;
  tf.over_shm = s.sync().uses_shm() || s.sync().hierarchical();
  tf.fragments_off_shm = s.fragments_off_shm;
  tf.shards = im.shards ? &*im.shards : nullptr;
  tf.zero2 = s.zero2;
  tf.zero_sync = s.sync().parameter_sync();
  tf.fragments = s.streaming ? s.syncs.size() : 0;
  tf.host_sync = s.host_sync != nullptr;
  tf.host_workers_why_not = s.host_workers_why_not;
  const std::string transport = describe_transport(tf, state, *im.cfg);
  if (g.world > 1) std::fprintf(stderr, "rank %d: generation %llu: %s\n", g.rank, static_cast<unsigned long long>(g.gen), transport.c_str());
  auto ready = status_of(pb::rank_status::STATE_READY, g.rank, g.local, state.step(), transport);
  ready.set_state_source(to_wire(g.source));
  ready.set_state_root(g.root);
  ready.set_switch_s(now_s() - g.offered_at);
  ready.set_state_bytes(g.transfer_bytes);
  if (im.shards) {
    ready.set_optimizer_source(to_wire(g.optimizer));
    ready.set_reshard_bytes(g.reshard_bytes);
  }
  ready.set_state_transfer_s(g.transfer_s);
  if (state.diloco()) {
    ready.set_window_steps(g.window_steps);
    ready.set_skipped_steps(g.skipped_steps);
    ready.set_replayed_slices(g.replayed_slices);
  }
  if (cb_.on_status) cb_.on_status(g.gen, std::move(ready));
}

// The host buffer of this rank's checkpoint part, made ahead of the first
// checkpoint (checkpoint.direct = false and checkpoint.keep_buffer; else
// made at a checkpoint that uses it).
void rank_worker::prepare_part_writer(generation_run& g) {
  auto& im = *impl_;
  training_state& state = *im.state;
  if (g.plan.checkpoint_store().empty()) return;
  ensure_part_writer();
  const state_layout layout = checkpoint_layout(state, im.modes, g.rank, g.world);
  uint64_t bytes = 0;
  for (const auto& [a, b] : checkpoint_ranges(state, im.shards, layout, g.rank, g.world)) bytes += b - a;
  // auto: not ahead of time (the first checkpoint sees whether there is
  // room for it beside the steps).
  if (im.cfg->get_bool("checkpoint.keep_buffer") && im.modes.direct == direct_checkpoint::off) im.writer->prepare(bytes);
}

// DiLoCo: where this generation enters the window, said once on stderr.
void rank_worker::announce_window(generation_run& g) {
  auto& im = *impl_;
  training_state& state = *im.state;
  if (!state.diloco()) return;
  if (g.skipped_steps > 0 || g.window_steps > 0)
    std::fprintf(stderr, "rank %d: generation %llu: DiLoCo window goes on at step %lld, %lld step(s) after its anchor (this rank skipped %lld)\n",
                 g.rank, static_cast<unsigned long long>(g.gen), static_cast<long long>(state.step()), static_cast<long long>(g.window_steps),
                 static_cast<long long>(g.skipped_steps));
  if (!im.catch_up.empty())
    std::fprintf(stderr, "rank %d: generation %llu: DiLoCo: catching up on steps %lld to %lld (its peers took them), on its own slices of them\n",
                 g.rank, static_cast<unsigned long long>(g.gen), static_cast<long long>(state.step()),
                 static_cast<long long>(im.catch_up.back().until - 1));
  if (!im.replays.empty())
    std::fprintf(stderr, "rank %d: generation %llu: DiLoCo: %lld slice(s) of the window's steps %lld to %lld were held by no survivor (a lost worker's); this rank trains %zu of them again before the boundary%s\n",
                 g.rank, static_cast<unsigned long long>(g.gen), static_cast<long long>(g.replayed_slices),
                 static_cast<long long>(oldest_fragment_anchor(state.outer())), static_cast<long long>(state.outer().anchor() + g.window_steps - 1),
                 im.replays.size(), im.replays.front().parts > 1 ? " (its host's ranks together, each a part of every slice)" : "");
}

// A lost worker's slice of this window, trained again (no collective): its
// samples reach the next outer step once.
std::optional<rank_worker::outcome> rank_worker::replay_next_slice(generation_run& g, steps_run& s) {
  auto& im = *impl_;
  training_state& state = *im.state;
  const impl::slice_id x = im.replays.front();
  auto rr = x.parts > 1 && s.host_sync ? state.replay_slice_host(x.step, x.rank, x.world, x.part, x.parts, *s.host_sync, x.fragments)
                                       : state.replay_slice(x.step, x.rank, x.world, x.fragments);
  if (!rr) return failed(g, rr.message(), state.step());
  // A host's replay is one line, its first rank's, of the whole slice.
  if (x.part == 0) {
    const auto whole = state.order().rank_slice(x.step, x.rank, x.world);
    if (auto st = log_samples(x.step, g.gen, x.rank, x.world, x.fragments, x.parts > 1 ? &whole : nullptr); !st)
      return failed(g, st.message(), state.step(), pb::rank_status::FAILURE_DATA);
  }
  im.note_slice(oldest_fragment_anchor(state.outer()), x);
  im.replays.erase(im.replays.begin());
  return std::nullopt;
}

// The step's forward, backward and update (DiLoCo: an inner step of this
// rank's slice, of the world it was taken in when catching up).
std::optional<rank_worker::outcome> rank_worker::inner_step(generation_run& g, steps_run& s, bool replay_on) {
  auto& im = *impl_;
  training_state& state = *im.state;
  const bool diloco = state.diloco();
  const int64_t attempted = state.step();
  int slice_rank = g.rank, slice_world = g.world;
  for (const auto& c : im.catch_up)
    if (attempted < c.until) {
      slice_rank = c.rank;
      slice_world = c.world;
      break;
    }
  im.attempt = {attempted, g.gen, slice_rank, slice_world};
  result<training_state::dp_step> r = training_state::dp_step{};
  if (s.host_sync)
    r = state.inner_step_host(g.rank, g.world, *s.host_sync, g.exchange.host_members);
  else
    r = diloco ? state.inner_step(slice_rank, slice_world) : state.train_step_dp(g.rank, g.world, s.sync());
  // Applied (with ZeRO, to this rank's shards even when the all-gather
  // after it failed): the step is in the audit log before anything else.
  if (state.step() > attempted)
    if (auto st = log_samples(attempted, g.gen, slice_rank, slice_world); !st)
      return failed(g, st.message(), state.step(), pb::rank_status::FAILURE_DATA);
  if (!r) return failed(g, r.message(), state.step());
  // No generation can fix a loss that became NaN or infinite.
  if (r->samples > 0 && !std::isfinite(r->loss_sum))
    return failed(g,
                  "loss became " + std::to_string(r->loss_sum / static_cast<double>(r->samples)) + " at step " + std::to_string(state.step()) +
                      "; lower train.lr, keep train.grad_clip on, or resume from an earlier checkpoint",
                  state.step(), pb::rank_status::FAILURE_DIVERGED);
  if (replay_on) im.note_slice(oldest_fragment_anchor(state.outer()), {attempted, slice_rank, slice_world, {}});
  s.r = *r;
  return std::nullopt;
}

// DiLoCo after a step: the exchange in flight that lands now, then the
// fragments due (each exchange carries the step control). `boundary` is set
// when one landed: every rank then holds the same global parameters.
std::optional<rank_worker::outcome> rank_worker::outer_steps(generation_run& g, steps_run& s, int64_t max_steps, bool& boundary) {
  auto& im = *impl_;
  training_state& state = *im.state;
  std::vector<size_t> landed_fragments;
  auto record = [&](const training_state::outer_step_result& o) {
    landed_fragments.push_back(o.fragment);
    s.r.allreduce_s += o.exchange_s;
    s.r.exposed_s += o.exposed_s;
    s.acc.set_outer_steps(s.acc.outer_steps() + 1);
    s.acc.set_outer_payload_bytes(s.acc.outer_payload_bytes() + static_cast<uint64_t>(o.payload_bytes));
    s.acc.set_outer_exchange_s(s.acc.outer_exchange_s() + o.exchange_s);
    s.acc.set_pseudo_grad_norm(o.pseudo_grad_norm);
    s.acc.set_outer_inner_steps(static_cast<uint64_t>(o.inner_steps));
    s.acc.set_outer_window_s(std::chrono::duration<double>(clock_type::now() - s.window_began).count());
    s.window_began = clock_type::now();
    s.agreed = s.syncs[o.fragment]->control();
    boundary = true;
  };
  bool landed = false;
  if (state.outer().lands(state.step())) {
    auto o = state.outer_land(*s.syncs[*state.outer().in_flight()]);
    if (!o) return failed(g, o.message(), state.step());
    record(*o);
    landed = true;
  }
  const auto due = state.outer().due_fragments(state.step());
  for (size_t f : due) {
    // Overlapped only when it is the one exchange of this step and the job
    // goes on: a boundary never leaves an exchange in flight.
    const bool overlap = state.outer().options().overlap > 0 && state.step() < max_steps && due.size() == 1 && !landed;
    s.syncs[f]->set_control(s.mine);
    auto o = state.outer_launch(f, *s.syncs[f], overlap);
    if (!o) return failed(g, o.message(), state.step());
    if (o->landed) record(*o);
  }
  // data.sample_log: this rank's lines before the landed pseudo-gradient's
  // step are in that fragment of the global parameters.
  if (im.samples_log)
    for (size_t f : landed_fragments)
      if (auto st = im.samples_log->append_synced(state.outer().fragment_anchor(f), g.gen, g.rank, g.world,
                                                  state.outer().streaming() ? static_cast<int>(f) : -1,
                                                  static_cast<int>(state.outer().fragments().size()));
          !st)
        return failed(g, st.message(), state.step(), pb::rank_status::FAILURE_DATA);
  return std::nullopt;
}

// Rank 0's moving buffers to every rank (at a synchronisation boundary).
std::optional<rank_worker::outcome> rank_worker::broadcast_buffers(generation_run& g, const steps_run& s, int64_t step) {
  c10d::BroadcastOptions bo;
  bo.rootRank = 0;
  torch::NoGradGuard no_grad;
  for (const auto& b : s.moving_buffers) {
    std::vector<torch::Tensor> t{b};
    if (auto st = wait_work(g.pg->broadcast(t, bo), deadline_in(g.timeout), g.abandon_now, "buffer broadcast"); !st) return failed(g, st.message(), step);
  }
  return std::nullopt;
}

// The parameters' digest, compared across the ranks: a rank that drifted
// ends the job rather than train on silently.
std::optional<rank_worker::outcome> rank_worker::compare_digests(generation_run& g, steps_run& s, int64_t step) {
  const std::string digest = impl_->state->params_digest();
  s.acc.set_params_digest(digest);
  if (!g.pg) return std::nullopt;
  auto agree = digests_agree(*g.pg, digest, g.timeout, g.abandon_now);
  if (!agree) return failed(g, agree.message(), step);
  if (!agree.value()) return failed(g, "parameters differ between ranks at step " + std::to_string(step), step, pb::rank_status::FAILURE_PARAMETERS_DIFFER);
  return std::nullopt;
}

// The step report: the sums since the last one, the data reader's figures
// and the bytes this rank holds.
void rank_worker::report_step(generation_run& g, steps_run& s, int64_t step) {
  auto& im = *impl_;
  training_state& state = *im.state;
  pb::step_report& acc = s.acc;
  acc.set_step(step);
  acc.set_global_rank(g.rank);
  acc.set_world_size(g.world);
  acc.set_loss(s.r.samples > 0 ? s.r.loss_sum / static_cast<double>(s.r.samples) : 0.0);
  acc.set_loss_mean(s.loss_steps > 0 ? s.loss_sum_steps / static_cast<double>(s.loss_steps) : acc.loss());
  s.loss_sum_steps = 0;
  s.loss_steps = 0;
  acc.set_lr(state.lr_at(step - 1));
  acc.set_data_wait_s(take_data_wait_s());
  if (auto d = process_shard_reader_stats()) {
    auto* x = acc.mutable_data();
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
  acc.set_param_bytes(static_cast<uint64_t>(state.optimizer().param_bytes()));
  // The optimizer's gradients and the reducer's bucket buffers kept between
  // steps (zero=0/1: a second copy of every gradient; zero=2: none, its
  // buffers live only while a step's buckets are in flight).
  acc.set_grad_bytes(static_cast<uint64_t>(state.optimizer().grad_bytes() + s.buffer_bytes()));
  acc.set_optimizer_state_bytes(static_cast<uint64_t>(state.optimizer().state_bytes() + (state.diloco() ? state.outer().state_bytes() : 0)));
  if (im.writer) acc.set_checkpoint_buffer_bytes(im.writer->buffer_bytes());
  if (cb_.on_step) cb_.on_step(g.gen, acc);
  acc.Clear();
  s.first = false;
}

// The loop's own state (train): the cadence, what this generation
// evaluated and checkpointed last, what a rank alone owes at its next
// boundary.
struct rank_worker::step_loop {
  step_cadence cadence;
  std::map<std::string, double> eval_at_step;
  // The step of the last checkpoint this generation wrote, or of the one
  // the caller's state was read from (nothing to write again there).
  int64_t last_ckpt = -1;
  bool diloco = false;
  // A rank alone (world 1: `dtactor train`, or a cluster down to one rank)
  // has nobody to agree with: every step boundary where no DiLoCo exchange
  // is in flight is a synchronisation boundary (its parameters are the
  // job's), and a stop is taken before the next step. What fell due while
  // an exchange was in flight waits for it to land.
  bool alone = false;
  bool eval_owed = false, checkpoint_owed = false;
  // DiLoCo: what falls due in the window [window_start, step] runs at its boundary.
  bool due(int64_t every, int64_t step, int64_t window_start) const {
    if (!diloco || alone) return cadence.due(every, step);
    if (step >= cadence.max_steps) return true;
    return every > 0 && step / every > window_start / every;
  }
};

// Before the first step of a generation: the exchanges, the gradients and
// DiLoCo's flight cleared, memory handed back, READY, the part writer.
std::optional<rank_worker::outcome> rank_worker::begin_steps(generation_run& g, steps_run& s) {
  training_state& state = *impl_->state;
  if (auto st = choose_exchanges(g, s); !st) return failed(g, st.message(), state.step());
  // Whatever the last generation left in the gradients is a partial step,
  // and an exchange it left in flight is gone with its reducers.
  state.zero_grad();
  if (state.diloco()) state.outer().drop_flight();
  // What set-up freed goes back to the kernel now: the module's own
  // parameter tensors once the optimizer copied them into its flat buffers
  // (16 MB each for a GPT layer's MLP), the shards a reshard handed over.
  // The rank keeps a step's freed buffers on its heap (app/rank.cpp's
  // malloc settings), so without this they stayed resident between the
  // heap's live blocks: 4 bytes a parameter a rank (the 340M GPT at world 4,
  // train.zero = 2: 6.0 GB a rank and out of memory; 4.7 GB with this).
  ::malloc_trim(0);
  report_ready(g, s);
  prepare_part_writer(g);
  return std::nullopt;
}

// Stops at `step` (all ranks agreed, or alone): a final checkpoint when
// asked for one, every part stored, then STATE_FINISHED.
rank_worker::outcome rank_worker::stop_here(generation_run& g, step_loop& L, int64_t step, bool final_checkpoint) {
  if (final_checkpoint && L.last_ckpt != step) write_checkpoint(g, L.eval_at_step);
  finish_checkpoints();
  report_status(g, pb::rank_status::STATE_FINISHED, step, impl_->state->params_digest());
  return outcome::stopped;
}

// The step's control (step_control.hpp) rides at the end of its first
// gradient bucket, SUM-reduced with it (no collective of its own). Every
// rank reads the same sums after the step: all switch once every rank holds
// the newer plan, all stop if any rank was asked to, at the same step
// boundary, and rank 0 writes the final checkpoint if any rank was asked
// for one.
void rank_worker::set_step_control(generation_run& g, steps_run& s) {
  s.mine = step_control{};
  s.mine.newer_plan = offered_gen_.load() > g.gen ? 1.f : 0.f;
  s.mine.stop = stop_.load() ? 1.f : 0.f;
  s.mine.final_checkpoint = s.mine.stop > 0 && stop_checkpoint_.load() ? 1.f : 0.f;
  s.sync().set_control(s.mine);
}

// The step's figures into the report's sums.
void rank_worker::add_step_sums(steps_run& s, int64_t step, int64_t attempted) {
  s.acc.set_samples(s.acc.samples() + s.r.samples);
  if (s.r.samples > 0) {
    s.loss_sum_steps += s.r.loss_sum / static_cast<double>(s.r.samples);
    ++s.loss_steps;
  }
  s.acc.set_allreduce_s(s.acc.allreduce_s() + s.r.allreduce_s);
  s.acc.set_allreduce_exposed_s(s.acc.allreduce_exposed_s() + s.r.exposed_s);
  s.acc.set_compute_s(s.acc.compute_s() + s.r.compute_s);
  s.acc.set_update_s(s.acc.update_s() + s.r.update_s);
  s.acc.set_gather_s(s.acc.gather_s() + s.r.gather_s);
  if (step > attempted) s.acc.set_steps_covered(s.acc.steps_covered() + 1);
}

// At a boundary (every rank holds the same parameters): the evaluation and
// the checkpoint that fell due, then the agreed stop or switch.
std::optional<rank_worker::outcome> rank_worker::at_boundary(generation_run& g, steps_run& s, step_loop& L, int64_t step,
                                                             int64_t window_start) {
  L.eval_at_step.clear();
  // Every rank evaluates (their parameters are identical, so are the
  // results): a rank left waiting in the next collective while rank 0
  // evaluated alone would hit the collective timeout on a long
  // evaluation. Rank 0 reports.
  const bool eval_now = L.due(L.cadence.eval_every, step, window_start) || std::exchange(L.eval_owed, false);
  if (eval_now && step < L.cadence.max_steps) {
    const double took = send_eval(g, L.eval_at_step);
    if (auto ended = meet_after_eval(g, took)) return ended;
  } else if (eval_now) {
    send_eval(g, L.eval_at_step);  // the last step: nothing collective follows but the digests' comparison, already done
  }
  if (L.due(L.cadence.checkpoint_every, step, window_start) || std::exchange(L.checkpoint_owed, false)) {
    write_checkpoint(g, L.eval_at_step);
    L.last_ckpt = step;
  }
  if (s.agreed.stop_agreed()) return stop_here(g, L, step, s.agreed.final_checkpoint_wanted());
  if (s.agreed.all_hold_newer_plan(g.world)) return outcome::next_plan;
  return std::nullopt;
}

// After a step: DiLoCo's outer exchanges, the buffers, the sums, the
// digests, the report, an injected fault; at a boundary, at_boundary.
std::optional<rank_worker::outcome> rank_worker::after_step(generation_run& g, steps_run& s, step_loop& L, int64_t attempted,
                                                            int64_t window_start, clock_type::time_point t0) {
  auto& im = *impl_;
  training_state& state = *im.state;
  // Every rank holds the same parameters after this step (streaming: the
  // same global parameters, and nothing is in flight).
  bool boundary = !L.diloco;
  if (L.diloco)
    if (auto ended = outer_steps(g, s, L.cadence.max_steps, boundary)) return ended;
  if (L.diloco && L.alone && !state.outer().in_flight().has_value()) boundary = true;
  const int64_t step = state.step();
  if (boundary && !s.moving_buffers.empty())
    if (auto ended = broadcast_buffers(g, s, step)) return ended;
  add_step_sums(s, step, attempted);
  if (boundary && L.due(L.cadence.digest_every, step, window_start))
    if (auto ended = compare_digests(g, s, step)) return ended;
  s.acc.set_step_s(s.acc.step_s() + std::chrono::duration<double>(clock_type::now() - t0).count());
  if (s.first || L.cadence.report_due(step) || (boundary && L.diloco && !L.alone)) report_step(g, s, step);
  if (opts_.fail_at_step >= 0 && step >= opts_.fail_at_step && !im.injected && opts_.fail_mode != fault_mode::rank_oom) {
    im.injected = true;
    inject_fault();
  }
  if (boundary) return at_boundary(g, s, L, step, window_start);
  if (L.alone) {
    L.eval_owed = L.eval_owed || L.cadence.eval_due(step);
    L.checkpoint_owed = L.checkpoint_owed || L.cadence.checkpoint_due(step);
  }
  return std::nullopt;
}

rank_worker::outcome rank_worker::train(generation_run& g) {
  auto& im = *impl_;
  training_state& state = *im.state;
  steps_run s;
  if (auto ended = begin_steps(g, s)) return *ended;
  step_loop L;
  L.cadence = step_cadence_of(*im.cfg);
  L.last_ckpt = opts_.state_checkpointed_at >= 0 && opts_.state_checkpointed_at == state.step() ? state.step() : -1;
  // train.sync = diloco: inner steps without a collective; at each boundary
  // the outer step (its exchange carries the step control), and only there
  // what needs every rank to hold the same parameters (buffers, digests,
  // evaluation, checkpoints, stop, switch).
  L.diloco = state.diloco();
  L.alone = !g.pg;
  // Something of DiLoCo's left to do at this step: a fragment due, or an
  // exchange in flight that lands now.
  auto outer_pending = [&] { return L.diloco && (state.outer().due(state.step()) || state.outer().lands(state.step())); };
  auto in_flight = [&] { return L.diloco && state.outer().in_flight().has_value(); };
  const int64_t max_steps = L.cadence.max_steps;
  if (state.step() >= max_steps && !outer_pending() && g.rank == 0 && L.last_ckpt != state.step()) {
    // The job's last step is done but this generation started after it
    // (the old rank 0 may have died before its final evaluation and
    // checkpoint reached the coordinator): the new rank 0 sends both.
    send_eval(g, L.eval_at_step);
  }
  if (state.step() >= max_steps && !outer_pending() && L.last_ckpt != state.step()) write_checkpoint(g, L.eval_at_step);
  announce_window(g);
  im.trained_gen = g.gen;
  im.trained_rank = g.rank;
  im.trained_world = g.world;
  const bool replay_on = L.diloco && g.pg;  // the window's slices are noted (replay_owed_slices)
  s.window_began = clock_type::now();
  while (state.step() < max_steps || outer_pending()) {
    if (quitting()) return outcome::quit;
    if (abandon(g.gen)) return outcome::next_plan;
    if (opts_.stop_at_step >= 0 && state.step() >= opts_.stop_at_step && !stop_.load()) request_stop(true);
    if (opts_.fail_mode == fault_mode::rank_oom && opts_.fail_at_step >= 0 && state.step() >= opts_.fail_at_step) inject_fault();
    if (L.alone && stop_.load() && !in_flight()) return stop_here(g, L, state.step(), stop_checkpoint_.load());
    if (!im.replays.empty()) {
      if (auto ended = replay_next_slice(g, s)) return *ended;
      continue;
    }
    const auto t0 = clock_type::now();
    set_step_control(g, s);
    const int64_t attempted = state.step();
    const int64_t window_start = L.diloco ? state.outer().anchor() : attempted;
    s.r = training_state::dp_step{};
    if (!outer_pending())
      if (auto ended = inner_step(g, s, replay_on)) return *ended;
    if (!L.diloco) s.agreed = s.sync().control();
    if (auto ended = after_step(g, s, L, attempted, window_start, t0)) return *ended;
  }
  finish_checkpoints();
  report_status(g, pb::rank_status::STATE_FINISHED, state.step(), state.params_digest());
  return outcome::finished;
}

status rank_worker::log_samples(int64_t step, uint64_t gen, int rank, int world, const std::vector<bool>& fragments, const std::vector<int64_t>* samples) {
  auto& im = *impl_;
  if (!im.samples_log) return {};
  std::vector<int> to;
  for (size_t f = 0; f < fragments.size(); ++f)
    if (fragments[f]) to.push_back(static_cast<int>(f));
  return im.samples_log->append(step, gen, rank, world, samples ? *samples : im.state->recorded_samples(), fragments.empty() ? nullptr : &to);
}

void rank_worker::inject_fault() {
  std::fprintf(stderr, "dtactor: fault injection at step %lld: %s\n", static_cast<long long>(opts_.fail_at_step), to_string(opts_.fail_mode).c_str());
  std::fflush(stderr);
  const pid_t node = ::getppid();
  switch (opts_.fail_mode) {
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

}  // namespace dtactor
