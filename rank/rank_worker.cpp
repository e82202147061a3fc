#include "rank/rank_worker.hpp"

#include <malloc.h>
#include <pthread.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <utility>

#include "data/data_shards.hpp"
#include "data/sample_log.hpp"
#include "comm/grad_sync.hpp"
#include "job/shipped_file.hpp"
#include "model/layers.hpp"
#include "model/trainer.hpp"
#include "rank/checkpoint_saver.hpp"
#include "rank/generation.hpp"
#include "rank/group_builder.hpp"
#include "rank/part_writer.hpp"
#include "rank/state_source.hpp"
#include "rank/step_loop.hpp"
#include "rank/sync_strategy.hpp"
#include "storage/checkpoint_store.hpp"

namespace dtactor {

int global_rank_in(const pb::generation_plan& plan, const std::string& node_id, int local_rank) {
  for (const auto& r : plan.ranks())
    if (r.node_id() == node_id && r.local_rank() == local_rank) return r.global_rank();
  return -1;
}

rank_worker::rank_worker(rank_worker_options opts, rank_worker_callbacks cb)
    : opts_(std::move(opts)), cb_(std::move(cb)), impl_(std::make_unique<rank_state>()) {
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

void rank_worker::take_slot(int32_t local_rank) {
  std::optional<pb::rank_status> idle;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (opts_.local_rank >= 0 || local_rank < 0) return;
    opts_.local_rank = local_rank;
    from_spare_ = true;
    idle = warmed_up_;
  }
  if (!idle || !cb_.on_status) return;
  idle->set_local_rank(local_rank);
  cb_.on_status(0, std::move(*idle));
}

int rank_worker::local_rank() const {
  std::lock_guard<std::mutex> lock(mu_);
  return opts_.local_rank;
}

rank_worker_callbacks rank_worker::generation_callbacks() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!from_spare_) return cb_;
  }
  rank_worker_callbacks cb = cb_;
  cb.on_status = [this](uint64_t gen, pb::rank_status s) {
    if (s.status() == pb::rank_status::STATE_READY) {
      std::lock_guard<std::mutex> lock(mu_);
      s.set_from_spare(from_spare_);
      from_spare_ = false;
    }
    if (cb_.on_status) cb_.on_status(gen, std::move(s));
  };
  return cb;
}

status rank_worker::open_sample_log() {
  auto& im = *impl_;
  const std::string& dir = im.settings.data.sample_log;
  const int local = local_rank();
  if (dir.empty() || local < 0 || im.samples_log) return {};
  auto opened = sample_log::open(dir, opts_.node_id + "-r" + std::to_string(local));
  if (!opened) return opened.err();
  im.samples_log = std::move(opened.value());
  im.state->record_samples(true);
  return {};
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
result<config> with_shipped_module(const pb::generation_plan& plan, const config& cfg, const job_settings& s, int local, std::string& module_digest) {
  config load_cfg = cfg;
  if (!plan.module_object().empty()) {
    auto store = open_object_store(plan.checkpoint_store(), default_fs_env(), s.checkpoint.s3_endpoint);
    if (!store) return make_error("cannot open the checkpoint store for the shipped module: " + store.message());
    auto got = fetch_shipped_file(*store.value(), plan.module_object(), plan.module_digest(), s.model.file, shipped_cache_dir());
    if (!got) return got.err();
    if (got->path != s.model.file) {
      std::fprintf(stderr, "rank %d: model.file %s here: using the coordinator's, %s (%s)\n", local,
                   std::filesystem::exists(s.model.file) ? "differs" : "is missing", got->path.c_str(),
                   got->fetched ? "fetched from the checkpoint store" : "fetched before");
      (void)load_cfg.set("model.file", got->path);
    }
    module_digest = plan.module_digest();
  }
  return load_cfg;
}

// A warm rank that will hold the whole optimizer (train.zero = 0) touches
// its gradient buffers and moments while it waits for a plan, when this
// host has room for them beside the larger of 512 MiB and 5% of its
// memory: the first step, or a peer's state landing in them, would
// otherwise fault them in while the other ranks wait (2.4 GB at the 202M
// GPT: about 2 s of page faults here). Sharded levels hold only their
// shards, known at the first plan.
// Room on this host for `bytes` more beside the larger of 512 MiB and 5%
// of its memory.
bool room_for(int64_t bytes) {
  const memory_room room = read_memory_room();
  const int64_t spare = std::max<int64_t>(int64_t{512} << 20, room.total / 20);
  return bytes > 0 && room.available >= 0 && room.available - bytes >= spare;
}

void make_resident_if_room(training_state& state, const job_settings& s) {
  if (s.train.zero >= 1) return;
  if (room_for(state.resident_bytes())) state.make_resident();
}

// The same for the gradient reducer's bucket buffers (as large as the
// gradients), made and touched here for the first generation's reducer to
// take (comm/bucket_buffers.hpp): summed every step, at train.zero <= 1.
// DiLoCo's reducers cut their buckets otherwise; zero = 2 keeps none.
void make_buckets_if_room(training_state& state, const job_settings& s, bucket_buffers& into) {
  if (s.train.zero >= 2 || s.modes.sync != sync_mode::every_step) return;
  grad_sync_options o;
  o.bucket_bytes = s.cluster.bucket_kb * 1024;
  o.carry_control = true;  // as choose_exchanges
  int64_t bytes = 0;
  for (const auto& p : state.the_task().module()->parameters())
    if (p.requires_grad()) bytes += p.numel() * static_cast<int64_t>(p.element_size());
  if (!room_for(bytes)) return;
  for (auto& b : bucket_buffers_for(state.the_task().module()->parameters(), o)) into.give(std::move(b));
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
    // The settings and the modes, read once here.
    auto settings = job_settings_of(cfg);
    if (!settings) return settings.err();
    job_settings& s = settings.value();
    // Ranks sharing a machine share its cores: until a plan says how many
    // ranks run here, this node's.
    if (s.train.threads == 0) {
      const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
      im.auto_threads = opts_.threads <= 0;
      const int n = opts_.threads > 0 ? opts_.threads : std::max(1, hw / std::max(1, opts_.local_world));
      (void)cfg.set("train.threads", std::to_string(n));
      s.train.threads = n;
    }
    im.threads = static_cast<int>(s.train.threads);
    configure_threads(s.train.threads);
    // The module the coordinator shipped: this node's own model.file when it
    // is the same file, else a checked copy fetched from the store.
    auto load_cfg = with_shipped_module(plan, cfg, s, opts_.local_rank, im.module_digest);
    if (!load_cfg) return load_cfg.err();
    if (opts_.state) {
      im.state = opts_.state;
    } else {
      if (opts_.setup_mmap_threshold > 0) ::mallopt(M_MMAP_THRESHOLD, opts_.setup_mmap_threshold);
      // Sharded masters (train.zero = 3, or bf16 from zero = 1): no rank
      // holds the whole model while it starts; the first generation makes
      // each rank's shards (rank/state_source).
      defer_block_values defer(masters_sharded(s.train));
      auto created = training_state::create(load_cfg.value());
      if (opts_.step_mmap_threshold > 0) ::mallopt(M_MMAP_THRESHOLD, opts_.step_mmap_threshold);
      if (!created) return created.err();
      im.state = std::move(created.value());
      // The module's own parameter tensors, freed once the optimizer copied
      // them into its flat buffers, go back to the kernel (see train()).
      ::malloc_trim(0);
      make_resident_if_room(*im.state, s);
      make_buckets_if_room(*im.state, s, *im.buckets);
    }
    im.sync = make_sync_strategy(s.modes.sync);
    im.saver = make_saver(s, *im.sync);
    im.settings = std::move(s);
    im.cfg = std::move(cfg);
    if (auto opened = open_sample_log(); !opened) return opened;
  } catch (const std::exception& e) {
    std::string what = e.what();
    return make_error(what.substr(0, what.find('\n')));
  }
  return {};
}

void rank_worker::run() {
  auto status = [&](uint64_t gen, pb::rank_status::state s, int rank, int64_t step, const std::string& detail) {
    if (cb_.on_status) cb_.on_status(gen, status_of(s, rank, local_rank(), step, detail));
  };
  pb::generation_plan plan;
  double offered_at = 0;
  if (!take_plan(0, true, plan, offered_at)) return;
  auto& im = *impl_;
  if (auto st = warm_up(plan); !st) return status(plan.generation(), pb::rank_status::STATE_FAILED, -1, 0, st.message());
  {
    // The data as this rank opened it, for the coordinator to compare.
    auto idle = status_of(pb::rank_status::STATE_IDLE, -1, local_rank(), im.state->step(), "warmed up");
    if (opts_.data_digests)
      for (auto& [path, digest] : data_file_digests(*im.cfg)) (*idle.mutable_data_digests())[path] = digest;
    // The module it loaded is the coordinator's, wherever it came from.
    if (!im.module_digest.empty()) (*idle.mutable_data_digests())[im.settings.model.file] = im.module_digest;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (opts_.local_rank < 0) warmed_up_ = idle;
    }
    if (cb_.on_status) cb_.on_status(0, std::move(idle));
  }

  uint64_t current = 0;
  for (;;) {
    if (plan.generation() > current) {
      // The previous generation ran on until now after the plan came (its
      // warm-up, before the first: not a drain).
      const double drain_s = current > 0 ? std::max(0.0, now_s() - offered_at) : 0.0;
      current = plan.generation();
      running_gen_.store(current);
      const auto o = run_generation(plan, offered_at, drain_s);
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


void rank_worker::fit_threads_to_host(const pb::generation_plan& plan) {
  auto& im = *impl_;
  if (!im.auto_threads) return;
  // Nodes started by hand on one machine each think they own it; the plan
  // counts every rank of the generation on this machine.
  int host_ranks = 0;
  for (const auto& a : plan.ranks())
    if (a.node_id() == opts_.node_id && a.local_rank() == local_rank()) host_ranks = a.host_ranks();
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int n = host_ranks > 0 ? std::max(1, hw / host_ranks) : im.threads;
  if (n != im.threads) {
    (void)im.cfg->set("train.threads", std::to_string(n));
    im.settings.train.threads = n;
    configure_threads(n);
    im.threads = n;
  }
}

rank_worker::outcome rank_worker::run_generation(const pb::generation_plan& plan, double offered_at, double drain_s) {
  auto& im = *impl_;
  training_state& state = *im.state;
  const rank_worker_callbacks cb = generation_callbacks();
  generation_run g(plan, cb);
  g.gen = plan.generation();
  g.local = local_rank();
  g.rank = global_rank_in(plan, opts_.node_id, g.local);
  g.world = plan.world_size();
  g.offered_at = offered_at;
  g.drain_s = drain_s;
  g.timeout = im.settings.cluster.collective_timeout;
  g.abandon_now = [this, gen = g.gen] { return abandon(gen); };
  g.quitting = [this] { return quitting(); };
  g.newer_plan_waiting = [this, gen = g.gen] { return newer_plan_waiting(gen); };
  if (g.rank < 0) {
    // Not in this generation (this node leaves, or this rank was left out).
    g.report_status(pb::rank_status::STATE_IDLE, state.step(), "not in generation " + std::to_string(g.gen));
    return outcome::idle;
  }
  fit_threads_to_host(plan);
  if (auto opened = open_sample_log(); !opened) return g.failed(opened.message(), state.step());
  // However the generation ends, a checkpoint write still reading the state
  // (checkpoint.direct) is over before anything else touches it: the next
  // generation's reshard or load, the caller's state after quit. A buffered
  // write goes on storing its copy while the next generation starts (its
  // part is reported under its own generation; the coordinator commits a
  // drained generation's parts).
  struct write_over {
    checkpoint_saver& saver;
    training_state& s;
    ~write_over() {
      saver.release_state();
      s.set_before_update(nullptr);
    }
  } over{*im.saver, state};
  try {
    if (g.world > 1)
      if (auto ended = build_group(g, im, {opts_.advertise_addr, opts_.default_store_host, opts_.key})) return *ended;
    if (auto ended = starting_state(g, im).agree()) return *ended;
    return step_loop(g, im, loop_options(g.gen)).run();
  } catch (const data_error& e) {
    // A shard that cannot be read: no generation can fix it.
    std::string what = e.what();
    state.zero_grad();
    return g.failed(what.substr(0, what.find('\n')), state.step(), pb::rank_status::FAILURE_DATA);
  } catch (const std::exception& e) {
    std::string what = e.what();
    state.zero_grad();
    return g.failed(what.substr(0, what.find('\n')), state.step());
  }
}

std::unique_ptr<checkpoint_saver> rank_worker::make_saver(const job_settings& s, const sync_strategy& sync) {
  checkpoint_saver_options so;
  so.sync = &sync;
  so.node_id = opts_.node_id;
  so.s3_endpoint = s.checkpoint.s3_endpoint;
  so.keep_buffer = s.checkpoint.keep_buffer;
  so.modes = s.modes;
  so.local_world = opts_.local_world;
  so.on_written = [this](uint64_t gen, pb::checkpoint_written w) {
    if (cb_.on_checkpoint) cb_.on_checkpoint(gen, std::move(w));
  };
  return std::make_unique<checkpoint_saver>(std::move(so));
}

step_loop_options rank_worker::loop_options(uint64_t gen) {
  step_loop_options o;
  o.fail_at_step = opts_.fail_at_step;
  o.fail_mode = opts_.fail_mode;
  o.stop_at_step = opts_.stop_at_step;
  o.state_checkpointed_at = opts_.state_checkpointed_at;
  o.newer_plan = [this, gen] { return offered_gen_.load() > gen; };
  o.stop = [this] { return stop_.load(); };
  o.stop_checkpoint = [this] { return stop_checkpoint_.load(); };
  o.request_final_stop = [this] { request_stop(true); };
  return o;
}

}  // namespace dtactor
