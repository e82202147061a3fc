#include "model/trainer.hpp"

#include <ATen/autocast_mode.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <thread>

#include "checkpoint.pb.h"
#include "base/blas_info.hpp"
#include "data/data_wait.hpp"
#include "storage/fs.hpp"
#include "comm/grad_sync.hpp"
#include "base/hash.hpp"
#include "base/unix_time.hpp"
#include "job/modes.hpp"
#include "model/builtin_tasks.hpp"

namespace dtactor {

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }

uint64_t step_seed(uint64_t seed, int64_t step, int rank) {
  const uint64_t words[3] = {seed, static_cast<uint64_t>(step), static_cast<uint64_t>(rank)};
  return hash64(words, sizeof words, 0x5eedULL) & 0x7fffffffffffffffULL;
}

// RAII: bf16 autocast on CPU for the forward pass only.
struct autocast_scope {
  explicit autocast_scope(bool on) : on_(on) {
    if (on_) {
      at::autocast::set_cpu_enabled(true);
      at::autocast::set_autocast_cpu_dtype(at::kBFloat16);
    }
  }
  ~autocast_scope() {
    if (on_) {
      at::autocast::set_cpu_enabled(false);
      at::autocast::clear_cache();
    }
  }
  bool on_;
};

}  // namespace

void configure_threads(int64_t threads) {
  int n = static_cast<int>(threads);
  if (n <= 0) n = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  // LibTorch's OpenMP pool and OpenBLAS's pthreads pool spin on the same
  // cores when both have n threads: a ViT step ran 2.3x slower that way here
  // (bench/bench_train_step). Matrix products dominate, so OpenBLAS gets the
  // threads; without OpenBLAS, LibTorch's pool does.
  if (set_blas_threads(n)) {
    at::set_num_threads(1);
  } else {
    at::set_num_threads(n);
  }
}

training_state::training_state(const config& cfg, job_settings s, std::unique_ptr<task> t)
    : cfg_(cfg), settings_(std::move(s)), task_(std::move(t)) {
  const train_settings& ts = settings_.train;
  flat_adamw_options o;
  o.lr = ts.lr;
  o.beta1 = ts.beta1;
  o.beta2 = ts.beta2;
  o.weight_decay = ts.weight_decay;
  o.compute = ts.precision == precision_mode::bf16 ? torch::kBFloat16 : torch::kFloat;
  o.held_masters_only = masters_sharded(ts);
  optimizer_ = std::make_unique<flat_adamw>(task_->module()->parameters(), o);
  optimizer_->grads_unwritten();  // only forward_backward writes them (train.sync = diloco, which also does, has no train.zero)
  for (const auto& u : task_->param_units()) units_deferred_ = units_deferred_ || static_cast<bool>(u.initial);
  if (auto shards = task_->train_shard_samples(); !shards.empty()) {
    block_shards_ = settings_.data.shards.shuffle_block_shards;
    read_ahead_shards_ = block_shards_ * (1 + settings_.data.shards.read_ahead_blocks);
    order_ = std::make_unique<data_order>(static_cast<uint64_t>(ts.seed), shard_layout{std::move(shards), block_shards_}, ts.global_batch_size);
  } else {
    order_ = std::make_unique<data_order>(static_cast<uint64_t>(ts.seed), task_->train_size(), ts.global_batch_size);
  }
  schedule_.peak_lr = ts.lr;
  schedule_.min_lr = ts.min_lr;
  schedule_.warmup_steps = ts.warmup_steps;
  schedule_.max_steps = ts.max_steps;
  if (settings_.modes.sync == sync_mode::diloco) {
    outer_options oo;
    oo.lr = ts.outer_lr;
    oo.momentum = ts.outer_momentum;
    oo.every = ts.sync_every;
    oo.max_steps = ts.max_steps;
    oo.fragments = static_cast<int>(ts.sync_fragments);
    oo.overlap = resolved_overlap(ts.sync_overlap, oo.fragments);
    oo.mix = ts.sync_mix;
    std::vector<int64_t> numels;
    for (const auto& p : task_->module()->parameters())
      if (p.requires_grad()) numels.push_back(p.numel());
    outer_ = std::make_unique<outer_optimizer>(*optimizer_, numels, oo);
  }
}

result<std::unique_ptr<training_state>> training_state::create(const config& cfg) {
  // The settings, read once (validate_training_config's check).
  auto settings = job_settings_of(cfg);
  if (!settings) return settings.err();
  const job_settings& s = settings.value();
  torch::manual_seed(static_cast<uint64_t>(s.train.seed));
  result<std::unique_ptr<task>> t = make_error("");
  try {
    t = make_task(cfg, s);
  } catch (const c10::Error& e) {
    return make_error("cannot build model '" + s.model.name + "': " + e.what_without_backtrace());
  }
  if (!t) return t.err();
  const int64_t b = s.train.global_batch_size;
  if (b > t.value()->train_size())
    return make_error("train.global_batch_size (" + std::to_string(b) + ") is larger than the training set (" +
                          std::to_string(t.value()->train_size()) + " samples)",
                      errc::batch_exceeds_data);
  if (s.modes.sync == sync_mode::diloco) {
    int64_t tensors = 0;
    for (const auto& p : t.value()->module()->parameters())
      if (p.requires_grad()) ++tensors;
    if (s.train.sync_fragments > tensors)
      return make_error("train.sync_fragments = " + std::to_string(s.train.sync_fragments) + " but model '" + s.model.name + "' has only " +
                        std::to_string(tensors) + " parameter tensors to cut into fragments (use at most " + std::to_string(tensors) + ")");
  }
  return std::unique_ptr<training_state>(new training_state(cfg, std::move(settings.value()), std::move(t.value())));
}

double training_state::forward_backward(const std::vector<int64_t>& samples, int64_t step, int rank, grad_sync* sync, double divisor) {
  // Dropout masks are a pure function of (seed, step, rank): resuming needs no RNG state.
  torch::manual_seed(step_seed(static_cast<uint64_t>(settings_.train.seed), step, rank));
  const double scale = 1.0 / (divisor > 0 ? divisor : static_cast<double>(order_->global_batch_size()));
  // Sharded data: what this step and the next ones read, for read-ahead.
  if (order_->sharded()) task_->upcoming_shards(order_->shards_from(step * order_->global_batch_size(), read_ahead_shards_));
  optimizer_->refresh_compute();  // train.precision = bf16: this step's parameters, rounded from the masters
  optimizer_->grads_written();
  const int64_t micro_batch = settings_.train.micro_batch_size;
  const size_t chunk = micro_batch > 0 ? static_cast<size_t>(micro_batch) : std::max<size_t>(1, samples.size());
  double total = 0;
  if (record_samples_) recorded_.clear();
  for (size_t i = 0; i < samples.size(); i += chunk) {
    std::vector<int64_t> part(samples.begin() + i, samples.begin() + std::min(samples.size(), i + chunk));
    if (record_samples_) recorded_.insert(recorded_.end(), part.begin(), part.end());
    torch::Tensor loss;
    {
      autocast_scope ac(settings_.train.bf16);
      loss = task_->loss_sum(part);
    }
    if (sync && i + chunk >= samples.size()) sync->arm();
    (loss.to(torch::kFloat) * scale).backward();
    total += loss.item<double>();
  }
  return total;
}

void training_state::shard_optimizer(const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  before_update();
  if (settings_.train.zero >= 2) optimizer_->shard_grads();
  optimizer_->shard(ranges);
}

void training_state::drop_stale_moments() {
  if (optimizer_->sharded()) shard_optimizer({});
}

double training_state::update_at(std::optional<double> global_norm, int64_t lr_step) {
  before_update();
  const double clip = settings_.train.grad_clip;
  const double max_norm = clip > 0 ? clip : std::numeric_limits<double>::infinity();
  double norm = 0;
  if (global_norm) {
    norm = *global_norm;
    optimizer_->clip_to(norm, max_norm);
  } else {
    norm = optimizer_->clip_grad_norm(max_norm);
  }
  optimizer_->set_lr(schedule_.at(lr_step));
  optimizer_->step();
  optimizer_->zero_grad();
  return norm;
}

double training_state::apply_update(std::optional<double> global_norm) {
  const double norm = update_at(global_norm, step_);
  ++step_;
  interrupted_at_.reset();
  last_norm_ = std::make_pair(step_, norm);
  return norm;
}

void training_state::finish_interrupted_step(double norm) {
  if (!has_interrupted_step()) return;
  apply_update(norm);
  params_mixed_ = true;
}

void training_state::drop_interrupted_step() {
  if (!interrupted_at_) return;
  optimizer_->zero_grad();
  interrupted_at_.reset();
}

result<training_state::dp_step> training_state::train_step(const step_context& c) {
  dp_step r;
  double divisor = 0;
  const auto samples = samples_of(c, divisor);
  r.samples = static_cast<int64_t>(samples.size());
  const int64_t at = c.replay ? c.replay->step : step_;
  const auto t0 = clock_type::now();
  // A replay by a host's ranks: a part with nothing of the slice sends
  // zeros into the host's sum (finish()).
  const bool host_replay = c.replay && c.sync;
  if (host_replay) optimizer_->zero_grad();
  param_sync* ps = c.sync ? c.sync->parameter_sync() : nullptr;
  if (ps) ps->take_pass_gather_s();  // not an evaluation's or a digest's gathers since the last step
  if (ps && ps->gathers_in_passes() && !c.replay)
    for (int64_t i = micro_batches(samples.size()); i < most_micro_batches(c); ++i) ps->idle_pass();
  if (host_replay && samples.empty()) {
    if (record_samples_) recorded_.clear();
  } else {
    r.loss_sum = forward_backward(samples, at, c.rank, c.sync, divisor);
  }
  r.compute_s = seconds_since(t0);
  if (ps) r.pass_gather_s = ps->take_pass_gather_s();
  if (c.sync) {
    auto synced = c.sync->finish();
    if (synced && ps)
      if (auto st = ps->gathered(); !st) synced = st.err();
    if (!synced) {
      optimizer_->zero_grad();  // the next attempt of this step starts from zero
      return synced.err();
    }
    r.allreduce_s = synced->allreduce_s;
    r.exposed_s = synced->exposed_s;
    r.buckets = synced->buckets;
    r.launched_in_backward = synced->launched_in_backward;
  }
  if (c.replay) {
    const auto t1 = clock_type::now();
    r.grad_norm = replay_update(c.replay->step, c.replay->fragments);
    r.update_s = seconds_since(t1);
    return r;
  }
  return update_after_sync(c, r);
}

int64_t training_state::micro_batches(size_t samples) const {
  const int64_t m = settings_.train.micro_batch_size;
  if (samples == 0) return 0;
  return m > 0 ? (static_cast<int64_t>(samples) + m - 1) / m : 1;
}

// The most micro-batches any rank of the step computes (slices differ by
// a sample where the world does not divide the global batch).
int64_t training_state::most_micro_batches(const step_context& c) const {
  int64_t most = 0;
  for (int r = 0; r < c.world; ++r) most = std::max(most, micro_batches(order_->rank_slice(step_, r, c.world).size()));
  return most;
}

// This rank's samples of the step (a replay's: its part of the slice), and
// what their loss sum is divided by (0: the global batch).
std::vector<int64_t> training_state::samples_of(const step_context& c, double& divisor) {
  const int64_t at = c.replay ? c.replay->step : step_;
  auto slice = order_->rank_slice(at, c.rank, c.world);
  // Sharded data: the next step's samples, decoded ahead while this one runs.
  if (!c.replay && order_->sharded()) task_->upcoming_samples(order_->rank_slice(step_ + 1, c.rank, c.world));
  switch (c.mean) {
    case loss_mean::global_batch:
      divisor = 0;
      break;
    case loss_mean::own_slice:
      divisor = static_cast<double>(std::max<size_t>(1, slice.size()));
      break;
    case loss_mean::ranks: {
      size_t n = 0;
      for (int r : c.mean_ranks) n += order_->rank_slice(at, r, c.world).size();
      divisor = static_cast<double>(std::max<size_t>(1, n));
      break;
    }
  }
  if (!c.replay || !c.sync || c.replay->parts <= 1) return slice;
  const auto [lo, hi] = split_range(static_cast<int64_t>(slice.size()), c.replay->part, std::max(1, c.replay->parts));
  return std::vector<int64_t>(slice.begin() + lo, slice.begin() + hi);
}

// The update after the reducer summed the gradients. A sharded optimizer
// (ZeRO) clips by the reducer's parameter sync's global norm (train.zero =
// 2) and gathers the others' parameters after it stepped its own shards.
result<training_state::dp_step> training_state::update_after_sync(const step_context& c, dp_step r) {
  const auto t1 = clock_type::now();
  if (update_fence_) {
    auto fence = std::move(update_fence_);
    update_fence_ = nullptr;
    if (auto st = fence(); !st) {
      optimizer_->zero_grad();
      return st.err();
    }
  }
  param_sync* ps = c.sync ? c.sync->parameter_sync() : nullptr;
  std::optional<double> global_norm;
  if (ps && ps->sharded_norm()) {
    auto n = ps->global_norm();
    if (!n) {
      // Kept: other ranks may have completed this allreduce and stepped
      // (has_interrupted_step).
      interrupted_at_ = step_;
      return n.err();
    }
    global_norm = n.value();
  }
  // The update of this rank's shards is complete and stays (its summed
  // gradient was the whole world's): if the all-gather fails, this rank is
  // at the next step for its shards and holds a mix of two steps elsewhere,
  // which the next generation repairs from the shards' holders (rank/zero).
  // Nothing is undone, so nothing needs saving.
  r.grad_norm = apply_update(global_norm);
  if (ps) {
    const auto t2 = clock_type::now();
    if (auto st = ps->gather(); !st) {
      params_mixed_ = true;
      return st.err();
    }
    r.gather_s = seconds_since(t2);
  }
  r.update_s = seconds_since(t1);
  return r;
}

double training_state::replay_update(int64_t step, const std::vector<bool>& fragments) {
  // Fragments not owed this slice: their parameters and moments as they
  // were before the update (copies of those ranges only).
  struct kept_range {
    torch::Tensor live_p, live_m, live_v, p, m, v;
  };
  std::vector<kept_range> kept;
  if (outer_ && !fragments.empty()) {
    torch::NoGradGuard no_grad;
    const auto params = optimizer_->flat_params();
    const auto bases = optimizer_->group_bases();
    const auto& frags = outer_->fragments();
    for (size_t f = 0; f < frags.size(); ++f) {
      if (f < fragments.size() && fragments[f]) continue;
      for (const auto& [g, off, len] : frags[f].ranges) {
        kept_range k;
        k.live_p = params[g].narrow(0, off, len);
        auto [m, v] = optimizer_->moments(bases[g] + off, bases[g] + off + len);
        k.live_m = m;
        k.live_v = v;
        k.p = k.live_p.clone();
        k.m = m.clone();
        k.v = v.clone();
        kept.push_back(std::move(k));
      }
    }
  }
  const double norm = update_at(std::nullopt, step);
  if (!kept.empty()) {
    torch::NoGradGuard no_grad;
    for (auto& k : kept) {
      k.live_p.copy_(k.p);
      k.live_m.copy_(k.m);
      k.live_v.copy_(k.v);
    }
  }
  return norm;
}

void training_state::set_before_update(std::function<void()> f) {
  before_update_ = std::move(f);
  if (outer_) outer_->set_before_update(before_update_);
}

void training_state::set_update_fence(std::function<status()> f) { update_fence_ = std::move(f); }

void training_state::skip_to(int64_t step) {
  if (step > step_) step_ = step;
}

void training_state::zero_grad() {
  optimizer_->zero_grad();
  interrupted_at_.reset();
}

namespace {
// Streaming DiLoCo: the global parameters in the module while it lives (the
// workers' own parameters differ from them, and from each other, between
// two exchanges of a fragment).
struct global_view {
  outer_optimizer* o = nullptr;
  explicit global_view(outer_optimizer* outer) : o(outer && outer->streaming() ? outer : nullptr) {
    if (o) o->swap_global();
  }
  ~global_view() {
    if (o) o->swap_global();
  }
  global_view(const global_view&) = delete;
  global_view& operator=(const global_view&) = delete;
};
}  // namespace

eval_result training_state::evaluate() {
  before_update();
  optimizer_->refresh_compute();
  global_view view(outer_.get());
  auto module = task_->module();
  module->eval();
  eval_result r;
  {
    torch::NoGradGuard no_grad;
    autocast_scope ac(settings_.train.bf16);
    r = task_->evaluate(settings_.eval.max_samples, settings_.eval.batch_size);
  }
  module->train();
  return r;
}

std::vector<torch::Tensor> training_state::gradients() {
  std::vector<torch::Tensor> g;
  for (auto& p : task_->module()->parameters()) g.push_back(p.grad());
  return g;
}

torch::Tensor training_state::state_of(const torch::Tensor& param) const {
  if (!optimizer_->mixed()) return param;
  auto master = optimizer_->master_of(param);
  return master.defined() ? master : param;
}

std::string training_state::params_digest(const std::function<void(const torch::Tensor&)>& before_reading) {
  before_update();
  global_view view(outer_.get());
  auto module = task_->module();
  std::vector<std::pair<std::string, torch::Tensor>> all;
  for (auto& kv : module->named_parameters()) all.emplace_back(kv.key(), state_of(kv.value()));
  for (auto& kv : module->named_buffers()) all.emplace_back("buffer:" + kv.key(), kv.value());
  std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  hasher h;
  for (auto& [name, t] : all) {
    if (before_reading) before_reading(t);
    auto c = t.detach().contiguous();
    h.update(name.data(), name.size());
    h.update(c.data_ptr(), c.numel() * c.element_size());
  }
  return hex64(h.digest());
}

int64_t training_state::parameter_count() {
  int64_t n = 0;
  for (auto& p : task_->module()->parameters()) n += p.numel();
  return n;
}

pb::checkpoint_meta training_state::checkpoint_meta(const std::map<std::string, double>& metrics, uint64_t generation) const {
  pb::checkpoint_meta meta;
  meta.set_model(settings_.model.name);
  meta.set_step(step_);
  meta.set_arch_digest(cfg_.digest({"model."}));
  meta.set_config_digest(cfg_.digest());
  meta.set_generation(generation);
  meta.set_seed(static_cast<uint64_t>(settings_.train.seed));
  meta.set_global_batch_size(order_->global_batch_size());
  meta.set_samples_seen(step_ * order_->global_batch_size());
  meta.set_unix_time(unix_time_now());
  meta.set_config_toml(cfg_.to_toml());
  for (const auto& [k, v] : metrics) (*meta.mutable_metrics())[k] = v;
  return meta;
}

std::vector<state_tensor> training_state::state_tensors() {
  std::vector<state_tensor> out;
  auto module = task_->module();
  for (auto& kv : module->named_parameters()) out.push_back(state_tensor::whole("model/" + kv.key(), state_of(kv.value()).detach()));
  for (auto& kv : module->named_buffers()) out.push_back(state_tensor::whole("buffer/" + kv.key(), kv.value().detach()));
  for (auto& st : optimizer_->state_tensors()) out.push_back(std::move(st));
  if (outer_)
    for (auto& st : outer_->state_tensors()) out.push_back(std::move(st));
  optim_steps_ = torch::tensor({optimizer_->steps_taken()}, torch::kInt64);
  out.push_back(state_tensor::whole("optim/steps", optim_steps_));
  // The generator is re-seeded from (seed, step, rank) before every step, so
  // this state is not needed for exact resume; it is kept so that anything
  // drawing random numbers between steps resumes exactly too.
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    rng_ = gen.get_state().contiguous().clone();
  }
  out.push_back(state_tensor::whole("train/rng", rng_));
  for (auto& st : out) TORCH_CHECK(st.t.is_contiguous() && st.t.device().is_cpu(), "state tensor ", st.name, " is not a contiguous CPU tensor");
  return out;
}

void training_state::state_loaded(int64_t step) {
  if (optim_steps_.defined()) optimizer_->set_steps_taken(optim_steps_.item<int64_t>());
  if (rng_.defined()) {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(rng_);
  }
  step_ = step;
}

status training_state::reset_state() {
  before_update();
  auto fresh = create(cfg_);
  if (!fresh) return fresh.err();
  torch::NoGradGuard no_grad;
  auto mine = state_tensors();
  auto theirs = fresh.value()->state_tensors();
  for (auto& m : mine) {
    if (m.sharded) {
      m.t.zero_();  // a fresh optimizer's moments
      continue;
    }
    for (const auto& t : theirs)
      if (t.name == m.name) m.t.copy_(t.t);
  }
  state_loaded(0);
  interrupted_at_.reset();
  last_norm_.reset();
  return {};
}

namespace {}  // namespace

}  // namespace dtactor
