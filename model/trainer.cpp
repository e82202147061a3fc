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
#include "monitoring/journal.hpp"
#include "monitoring/data_wait.hpp"
#include "monitoring/progress.hpp"
#include "monitoring/resources.hpp"
#include "monitoring/run_observer.hpp"
#include "runtime/blas_info.hpp"
#include "runtime/checkpoint_store.hpp"
#include "runtime/fs.hpp"
#include "runtime/grad_sync.hpp"
#include "runtime/hash.hpp"

namespace dtactor {

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }

uint64_t step_seed(uint64_t seed, int64_t step, int rank) {
  const uint64_t words[3] = {seed, static_cast<uint64_t>(step), static_cast<uint64_t>(rank)};
  return hash64(words, sizeof words, 0x5eedULL) & 0x7fffffffffffffffULL;
}

std::string bytes_of(torch::serialize::OutputArchive& ar) {
  std::ostringstream os(std::ios::binary);
  ar.save_to(os);
  return os.str();
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

void configure_threads(const config& cfg) {
  int n = static_cast<int>(cfg.get_int("train.threads"));
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

training_state::training_state(const config& cfg, std::unique_ptr<task> t) : cfg_(cfg), task_(std::move(t)) {
  flat_adamw_options o;
  o.lr = cfg.get_double("train.lr");
  o.beta1 = cfg.get_double("train.beta1");
  o.beta2 = cfg.get_double("train.beta2");
  o.weight_decay = cfg.get_double("train.weight_decay");
  optimizer_ = std::make_unique<flat_adamw>(task_->module()->parameters(), o);
  order_ = std::make_unique<data_order>(static_cast<uint64_t>(cfg.get_int("train.seed")), task_->train_size(), cfg.get_int("train.global_batch_size"));
  schedule_.peak_lr = cfg.get_double("train.lr");
  schedule_.min_lr = cfg.get_double("train.min_lr");
  schedule_.warmup_steps = cfg.get_int("train.warmup_steps");
  schedule_.max_steps = cfg.get_int("train.max_steps");
  micro_batch_ = cfg.get_int("train.micro_batch_size");
  bf16_ = cfg.get_bool("train.bf16");
}

result<std::unique_ptr<training_state>> training_state::create(const config& cfg) {
  if (auto st = validate_training_config(cfg); !st) return st.err();
  torch::manual_seed(static_cast<uint64_t>(cfg.get_int("train.seed")));
  result<std::unique_ptr<task>> t = make_error("");
  try {
    t = make_task(cfg);
  } catch (const c10::Error& e) {
    return make_error("cannot build model '" + cfg.get_string("model.name") + "': " + e.what_without_backtrace());
  }
  if (!t) return t.err();
  const int64_t b = cfg.get_int("train.global_batch_size");
  if (b > t.value()->train_size())
    return make_error("train.global_batch_size (" + std::to_string(b) + ") is larger than the training set (" +
                      std::to_string(t.value()->train_size()) + " samples)");
  return std::unique_ptr<training_state>(new training_state(cfg, std::move(t.value())));
}

double training_state::forward_backward(const std::vector<int64_t>& samples, int64_t step, int rank, grad_sync* sync) {
  // Dropout masks are a pure function of (seed, step, rank): resuming needs no RNG state.
  torch::manual_seed(step_seed(static_cast<uint64_t>(cfg_.get_int("train.seed")), step, rank));
  const double scale = 1.0 / static_cast<double>(order_->global_batch_size());
  const size_t chunk = micro_batch_ > 0 ? static_cast<size_t>(micro_batch_) : std::max<size_t>(1, samples.size());
  double total = 0;
  for (size_t i = 0; i < samples.size(); i += chunk) {
    std::vector<int64_t> part(samples.begin() + i, samples.begin() + std::min(samples.size(), i + chunk));
    torch::Tensor loss;
    {
      autocast_scope ac(bf16_);
      loss = task_->loss_sum(part);
    }
    if (sync && i + chunk >= samples.size()) sync->arm();
    (loss.to(torch::kFloat) * scale).backward();
    total += loss.item<double>();
  }
  return total;
}

double training_state::apply_update() {
  const double clip = cfg_.get_double("train.grad_clip");
  const double norm = optimizer_->clip_grad_norm(clip > 0 ? clip : std::numeric_limits<double>::infinity());
  optimizer_->set_lr(schedule_.at(step_));
  optimizer_->step();
  optimizer_->zero_grad();
  ++step_;
  return norm;
}

double training_state::train_step() {
  auto samples = order_->global_batch(step_);
  const double loss = forward_backward(samples, step_) / static_cast<double>(samples.size());
  apply_update();
  return loss;
}

void training_state::zero_grad() { optimizer_->zero_grad(); }

result<training_state::dp_step> training_state::train_step_dp(int rank, int world, grad_sync& sync) {
  dp_step r;
  auto samples = order_->rank_slice(step_, rank, world);
  r.samples = static_cast<int64_t>(samples.size());
  const auto t0 = clock_type::now();
  r.loss_sum = forward_backward(samples, step_, rank, &sync);
  r.compute_s = seconds_since(t0);
  auto synced = sync.finish();
  if (!synced) {
    optimizer_->zero_grad();  // the next attempt of this step starts from zero
    return synced.err();
  }
  r.allreduce_s = synced->allreduce_s;
  r.exposed_s = synced->exposed_s;
  r.buckets = synced->buckets;
  r.launched_in_backward = synced->launched_in_backward;
  const auto t1 = clock_type::now();
  r.grad_norm = apply_update();
  r.update_s = seconds_since(t1);
  return r;
}

eval_result training_state::evaluate() {
  auto module = task_->module();
  module->eval();
  eval_result r;
  {
    torch::NoGradGuard no_grad;
    autocast_scope ac(bf16_);
    r = task_->evaluate(cfg_.get_int("eval.max_samples"), cfg_.get_int("eval.batch_size"));
  }
  module->train();
  return r;
}

std::vector<torch::Tensor> training_state::gradients() {
  std::vector<torch::Tensor> g;
  for (auto& p : task_->module()->parameters()) g.push_back(p.grad());
  return g;
}

std::string training_state::params_digest() {
  auto module = task_->module();
  std::vector<std::pair<std::string, torch::Tensor>> all;
  for (auto& kv : module->named_parameters()) all.emplace_back(kv.key(), kv.value());
  for (auto& kv : module->named_buffers()) all.emplace_back("buffer:" + kv.key(), kv.value());
  std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  hasher h;
  for (auto& [name, t] : all) {
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
  meta.set_model(cfg_.get_string("model.name"));
  meta.set_step(step_);
  meta.set_arch_digest(cfg_.digest({"model."}));
  meta.set_config_digest(cfg_.digest());
  meta.set_generation(generation);
  meta.set_seed(static_cast<uint64_t>(cfg_.get_int("train.seed")));
  meta.set_global_batch_size(order_->global_batch_size());
  meta.set_samples_seen(step_ * order_->global_batch_size());
  meta.set_unix_time(unix_time_now());
  meta.set_config_toml(cfg_.to_toml());
  for (const auto& [k, v] : metrics) (*meta.mutable_metrics())[k] = v;
  return meta;
}

std::vector<std::pair<std::string, std::string>> training_state::save_sections() {
  torch::serialize::OutputArchive model_ar, optim_ar;
  task_->module()->save(model_ar);
  optimizer_->save(optim_ar);
  // The generator is re-seeded from (seed, step, rank) before every step, so
  // this state is not needed for exact resume; it is kept so that anything
  // drawing random numbers between steps resumes exactly too.
  torch::Tensor rng;
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    rng = gen.get_state().contiguous();
  }
  return {{"model", bytes_of(model_ar)},
          {"optimizer", bytes_of(optim_ar)},
          {"rng", std::string(static_cast<const char*>(rng.data_ptr()), static_cast<size_t>(rng.numel()))}};
}

status training_state::load_sections(const std::map<std::string, std::string>& sections, int64_t step) {
  for (const char* name : {"model", "optimizer"})
    if (!sections.count(name)) return make_error(std::string("checkpoint has no '") + name + "' section");
  try {
    torch::serialize::InputArchive model_ar, optim_ar;
    std::istringstream ms(sections.at("model"), std::ios::binary);
    model_ar.load_from(ms);
    std::istringstream os(sections.at("optimizer"), std::ios::binary);
    optim_ar.load_from(os);
    task_->module()->load(model_ar);
    optimizer_->rebind();  // load replaced the parameters' storage
    optimizer_->load(optim_ar);
    if (auto it = sections.find("rng"); it != sections.end()) {
      auto state = torch::empty({static_cast<int64_t>(it->second.size())}, torch::kUInt8);
      std::memcpy(state.data_ptr(), it->second.data(), it->second.size());
      auto gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    }
  } catch (const c10::Error& e) {
    optimizer_->rebind();  // parameters stay views of the optimizer's buffers whatever was loaded
    return make_error(std::string("checkpoint does not fit this model: ") + e.what_without_backtrace());
  }
  step_ = step;
  return {};
}

namespace {

}  // namespace

result<train_summary> run_training(const config& cfg, const train_options& opts) {
  const auto start = clock_type::now();
  if (auto st = validate_training_config(cfg); !st) return st.err();
  if (auto st = ensure_writable_dir(opts.run_dir); !st) return make_error("run directory: " + st.message());
  auto run_lock = file_lock::try_acquire(run_dir_lock_path(opts.run_dir), "dtactor train");
  if (!run_lock) return make_error(run_dir_busy_message(opts.run_dir, run_lock.message()));

  configure_threads(cfg);
  auto created = training_state::create(cfg);
  if (!created) return created.err();
  training_state& state = *created.value();
  task& tk = state.the_task();
  const checkpoint_policy policy = checkpoint_policy_of(cfg);
  const std::string& best_metric = policy.best_metric;
  auto store = checkpoint_store::open(checkpoint_dir_of(cfg, opts.run_dir), policy);
  if (!store) return store.err();

  journal jn;
  if (auto st = jn.open(opts.run_dir + "/journal.jsonl"); !st) return st.err();
  const std::string config_text = cfg.to_toml();
  if (auto st = write_file_atomic(opts.run_dir + "/config.toml", {config_text}); !st) return st.err();

  const bool interactive = opts.interactive.value_or(progress::stderr_is_terminal());
  // Console progress and TensorBoard scalars (RUN_DIR/tensorboard), as a cluster's coordinator writes them.
  run_observer prog({opts.run_dir, cfg.get_int("train.max_steps"), interactive, opts.run_dir + "/train.log"});
  resource_book usage;
  auto note_usage = [&](bool force) {
    if (auto u = read_proc_usage()) usage.note(0, this_host_name(), *u);
    if (usage.due(unix_time_now()) || (force && !usage.empty())) jn.write("resources", usage.to_json());
  };

  // Resume.
  std::optional<loaded_checkpoint> ckpt;
  if (!opts.resume_from.empty()) {
    auto one = checkpoint_store::load(opts.resume_from);
    if (!one) return make_error("cannot resume from '" + opts.resume_from + "': " + one.message());
    ckpt = std::move(one.value());
  } else if (opts.resume) {
    auto newest = store->load_newest_valid([&](const std::string& path, const std::string& why) {
      prog.log("skipping checkpoint " + path + ": " + why);
      jn.write("checkpoint_skipped", {{"path", path}, {"reason", why}});
    });
    if (!newest) return newest.err();
    ckpt = std::move(newest.value());
  }
  if (ckpt) {
    if (auto st = check_checkpoint_compatible(ckpt->meta, cfg, ckpt->path); !st) return st.err();
    if (auto st = state.load_sections(ckpt->sections, ckpt->meta.step()); !st) return make_error("'" + ckpt->path + "': " + st.message());
    jn.write("checkpoint_restored", {{"step", ckpt->meta.step()}, {"source", "disk"}, {"path", ckpt->path}});
    prog.log("resumed from " + ckpt->path + " at step " + std::to_string(ckpt->meta.step()));
  }

  const int64_t max_steps = cfg.get_int("train.max_steps");
  const int64_t global_batch = cfg.get_int("train.global_batch_size");
  const int64_t log_every = cfg.get_int("train.log_every_steps");
  const int64_t eval_every = cfg.get_int("eval.every_steps");
  const int64_t ckpt_every = cfg.get_int("checkpoint.every_steps");
  const blas_info blas = describe_blas();
  jn.write("job_started", {{"model", tk.name()},
                           {"parameters", state.parameter_count()},
                           {"max_steps", max_steps},
                           {"global_batch_size", global_batch},
                           {"world_size", 1},
                           {"start_step", state.step()},
                           {"threads", at::get_num_threads()},
                           {"blas", blas.library},
                           {"config_digest", cfg.digest()}});
  prog.log("training " + tk.name() + " (" + std::to_string(state.parameter_count()) + " parameters, " + std::to_string(tk.train_size()) +
           " training samples) from step " + std::to_string(state.step()) + " to " + std::to_string(max_steps) + ", run dir " + opts.run_dir);

  train_summary summary;
  int64_t last_saved = ckpt ? ckpt->meta.step() : -1;
  std::map<std::string, double> eval_at_step;  // metrics of an evaluation at the current step
  auto save = [&]() -> status {
    pb::checkpoint_meta meta = state.checkpoint_meta(eval_at_step, 0);
    const auto t0 = clock_type::now();
    auto sections = state.save_sections();
    size_t bytes = 0;
    for (auto& s : sections) bytes += s.second.size();
    auto path = store->save(std::move(meta), sections);
    if (!path) return path.err();
    last_saved = state.step();
    jn.write("checkpoint_saved", {{"step", state.step()}, {"path", path.value()}, {"bytes", bytes}, {"duration_s", seconds_since(t0)}});
    prog.note_event("checkpoint " + std::to_string(state.step()));
    return {};
  };
  auto run_eval = [&]() {
    const auto t0 = clock_type::now();
    summary.last_eval = state.evaluate();
    eval_at_step = summary.last_eval.metrics;
    nlohmann::json ev = {{"step", state.step()}, {"duration_s", seconds_since(t0)}};
    for (const auto& [k, v] : summary.last_eval.metrics) ev[k] = v;
    if (!summary.last_eval.examples.empty()) ev["examples"] = summary.last_eval.examples;
    jn.write("eval", ev);
    prog.on_eval(state.step(), summary.last_eval.metrics);
    for (const auto& ex : summary.last_eval.examples) prog.log("  " + ex);
  };

  double window_loss = 0, window_time = 0, ema_sps = 0;
  int64_t window_steps = 0;
  while (state.step() < max_steps) {
    if (opts.stop_signal && opts.stop_signal->load() != 0) {
      summary.stop_signal = opts.stop_signal->load();
      break;
    }
    if (opts.stop_at_step >= 0 && state.step() >= opts.stop_at_step) break;
    eval_at_step.clear();
    const auto t0 = clock_type::now();
    const double loss = state.train_step();
    const double dt = seconds_since(t0);
    if (!std::isfinite(loss)) {
      jn.write("job_failed", {{"step", state.step()}, {"reason", "non-finite loss"}});
      return make_error("loss became " + std::to_string(loss) + " at step " + std::to_string(state.step()) +
                        "; lower train.lr, keep train.grad_clip on, or resume from an earlier checkpoint");
    }
    window_loss += loss;
    window_time += dt;
    ++window_steps;
    const double sps_now = static_cast<double>(global_batch) / std::max(dt, 1e-9);
    ema_sps = ema_sps == 0 ? sps_now : 0.9 * ema_sps + 0.1 * sps_now;
    const int64_t step = state.step();
    if (step % log_every == 0 || step == max_steps) {
      const double sps = static_cast<double>(window_steps * global_batch) / std::max(window_time, 1e-9);
      jn.write("step", {{"step", step},
                        {"loss", loss},
                        {"loss_avg", window_loss / static_cast<double>(window_steps)},
                        {"lr", state.lr_at(step - 1)},
                        {"samples_per_s", sps},
                        {"data_wait_s", take_data_wait_s() / static_cast<double>(window_steps)},
                        {"world_size", 1}});
      prog.on_step(step, loss, state.lr_at(step - 1), sps, 1, true);
      note_usage(false);
      window_loss = window_time = 0;
      window_steps = 0;
    } else {
      prog.on_step(step, loss, state.lr_at(step - 1), ema_sps, 1, false);
    }
    if ((eval_every > 0 && step % eval_every == 0) || step == max_steps) run_eval();
    if ((ckpt_every > 0 && step % ckpt_every == 0) || step == max_steps) {
      if (auto st = save(); !st) return st.err();
    }
  }
  prog.finish();

  summary.step = state.step();
  summary.finished = state.step() >= max_steps;
  summary.params_digest = state.params_digest();
  if (!summary.finished && last_saved != state.step()) {
    if (auto st = save(); !st) return st.err();
  }
  summary.wall_s = seconds_since(start);
  note_usage(true);
  if (summary.finished) {
    nlohmann::json ev = {{"step", summary.step}, {"params_digest", summary.params_digest}, {"wall_s", summary.wall_s}};
    for (const auto& [k, v] : summary.last_eval.metrics) ev[k] = v;
    jn.write("job_finished", ev);
  } else {
    jn.write("job_stopped", {{"step", summary.step},
                             {"params_digest", summary.params_digest},
                             {"reason", summary.stop_signal ? "signal " + std::to_string(summary.stop_signal) : "stop_at_step"}});
  }
  return summary;
}

result<eval_result> run_evaluation(const std::string& target, const std::string& config_path, const std::vector<std::string>& overrides,
                                   int64_t* step_out) {
  std::optional<loaded_checkpoint> ckpt;
  std::error_code ec;
  if (std::filesystem::is_directory(target, ec)) {
    const std::string dir = std::filesystem::exists(target + "/checkpoints") ? target + "/checkpoints" : target;
    auto store = checkpoint_store::open(dir, checkpoint_policy{});
    if (!store) return store.err();
    auto newest = store->load_newest_valid([](const std::string& path, const std::string& why) {
      std::fprintf(stderr, "skipping checkpoint %s: %s\n", path.c_str(), why.c_str());
    });
    if (!newest) return newest.err();
    if (!newest.value()) return make_error("no valid checkpoint in '" + dir + "'");
    ckpt = std::move(newest.value());
  } else {
    if (!std::filesystem::exists(target, ec)) return make_error("checkpoint '" + target + "' does not exist");
    auto one = checkpoint_store::load(target);
    if (!one) return make_error("cannot read checkpoint '" + target + "': " + one.message());
    ckpt = std::move(one.value());
  }
  // Without --config, the job's own config (stored in the checkpoint) applies.
  auto loaded = config_path.empty() ? config::parse_toml(ckpt->meta.config_toml(), ckpt->path + " (stored config)") : config::load(config_path, {});
  if (!loaded) return loaded.err();
  config cfg = std::move(loaded.value());
  for (const auto& o : overrides) {
    auto eq = o.find('=');
    if (eq == std::string::npos || eq == 0) return make_error("--set expects key=value, got '" + o + "'");
    if (auto st = cfg.set(o.substr(0, eq), o.substr(eq + 1)); !st) return st.err();
  }
  if (auto st = check_checkpoint_compatible(ckpt->meta, cfg, ckpt->path); !st) return st.err();
  configure_threads(cfg);
  auto created = training_state::create(cfg);
  if (!created) return created.err();
  if (auto st = created.value()->load_sections(ckpt->sections, ckpt->meta.step()); !st) return make_error("'" + ckpt->path + "': " + st.message());
  if (step_out) *step_out = ckpt->meta.step();
  return created.value()->evaluate();
}

}  // namespace dtactor
