#include "rank/train_command.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <mutex>

#include "model/diloco.hpp"
#include "monitoring/journal.hpp"
#include "monitoring/progress.hpp"
#include "monitoring/resources.hpp"
#include "monitoring/run_observer.hpp"
#include "rank/part_writer.hpp"
#include "rank/state_io.hpp"
#include "rank/step_policy.hpp"
#include "runtime/blas_info.hpp"
#include "runtime/checkpoint_store.hpp"
#include "runtime/data_shards.hpp"
#include "runtime/data_wait.hpp"
#include "runtime/fs.hpp"
#include "runtime/job_config.hpp"
#include "runtime/sample_log.hpp"

namespace dtactor {

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }

}  // namespace

namespace {

// A task's data_error (a shard that cannot be read or parsed) ends the
// command with its first line, as a rank reports it in a cluster.
std::string first_line(const std::exception& e) {
  const std::string what = e.what();
  return what.substr(0, what.find('\n'));
}

result<train_summary> run_training_unguarded(const config& cfg, const train_options& opts) {
  const auto start = clock_type::now();
  if (auto st = validate_training_config(cfg); !st) return st.err();
  if (auto st = ensure_writable_dir(opts.run_dir); !st) return make_error("run directory: " + st.message());
  if (auto st = check_sample_log_dir(cfg.get_string("data.sample_log")); !st) return st.err();
  auto run_lock = file_lock::try_acquire(run_dir_lock_path(opts.run_dir), "dtactor train");
  if (!run_lock) return make_error(run_dir_busy_message(opts.run_dir, run_lock.message()));

  configure_threads(cfg);
  auto created = training_state::create(cfg);
  if (!created) return created.err();
  training_state& state = *created.value();
  task& tk = state.the_task();
  const checkpoint_policy policy = checkpoint_policy_of(cfg);
  auto store = checkpoint_store::open(checkpoint_dir_of(cfg, opts.run_dir), policy, default_fs_env(), cfg.get_string("checkpoint.s3_endpoint"));
  if (!store) return store.err();
  if (auto st = store->check_no_foreign_manifests(); !st) return st.err();
  // Its checkpoints carry the store's newest generation: a cluster's
  // commits there fence older generations out (0 in a store of its own).
  const uint64_t store_generation = store->newest_generation();
  // data.sample_log: one process, world 1. It has no generations; its
  // records carry one number per run, above every generation the store or
  // the log directory holds, so that a resumed run's records of the steps it
  // redoes supersede the earlier run's.
  std::unique_ptr<sample_log> samples_log;
  uint64_t log_generation = 0;
  if (const std::string& dir = cfg.get_string("data.sample_log"); !dir.empty()) {
    auto logged = newest_logged_generation(dir);
    if (!logged) return logged.err();
    log_generation = std::max(store_generation, logged.value()) + 1;
    auto opened = sample_log::open(dir, this_host_name());
    if (!opened) return opened.err();
    samples_log = std::move(opened.value());
    state.record_samples(true);
  }

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
    if (auto d = process_shard_reader_stats())
      usage.note_data(0, this_host_name(), {d->bytes_read_s3, d->bytes_read_local, d->cache_hits, d->cache_misses, d->shards_verified,
                                           d->shards_failed, d->read_ahead_depth, d->cache_used_bytes, d->cache_peak_bytes});
    if (usage.due(unix_time_now()) || (force && !usage.empty())) jn.write(usage.snapshot());
  };

  // Resume.
  std::optional<pb::checkpoint_meta> ckpt;
  std::string ckpt_path;
  std::shared_ptr<checkpoint_store> ckpt_from;
  if (!opts.resume_from.empty()) {
    auto one = open_checkpoint_target(opts.resume_from, {});
    if (!one) return make_error("cannot resume from '" + opts.resume_from + "': " + one.message());
    ckpt = std::move(one->meta);
    ckpt_path = one->name;
    ckpt_from = one->store;
  } else if (opts.resume) {
    auto newest = store->newest_valid(
        [&](const std::string& path, const std::string& why) {
          prog.log("skipping checkpoint " + path + ": " + why);
          jn.write(ev::checkpoint_skipped{path, why});
        },
        true);
    if (!newest) return newest.err();
    if (newest.value()) {
      ckpt = std::move(*newest.value());
      ckpt_path = store->location() + "/" + manifest_name(ckpt->step());
      ckpt_from = std::make_shared<checkpoint_store>(store.value());
    }
  }
  if (ckpt) {
    if (auto st = check_checkpoint_compatible(*ckpt, cfg, ckpt_path); !st) return st.err();
    if (auto st = load_checkpoint(state, *ckpt_from, *ckpt); !st) return make_error("'" + ckpt_path + "': " + st.message());
    ev::checkpoint_restored restored;
    restored.step = ckpt->step();
    restored.source = ev::state_source::disk;
    restored.path = ckpt_path;
    jn.write(restored);
    prog.log("resumed from " + ckpt_path + " at step " + std::to_string(ckpt->step()));
  }

  const int64_t max_steps = cfg.get_int("train.max_steps");
  const int64_t global_batch = cfg.get_int("train.global_batch_size");
  const step_cadence cadence = step_cadence_of(cfg);
  const blas_info blas = describe_blas();
  const std::string core = blas_core();
  jn.write(ev::job_started{tk.name(), state.parameter_count(), max_steps, global_batch, 1, state.step(), at::get_num_threads(),
                           core.empty() ? blas.library : blas.library + " (" + core + " kernels)", cfg.digest()});
  prog.log("training " + tk.name() + " (" + std::to_string(state.parameter_count()) + " parameters, " + std::to_string(tk.train_size()) +
           " training samples) from step " + std::to_string(state.step()) + " to " + std::to_string(max_steps) + ", run dir " + opts.run_dir);

  train_summary summary;
  int64_t last_saved = ckpt ? ckpt->step() : -1;
  std::map<std::string, double> eval_at_step;  // metrics of an evaluation at the current step
  // Checkpoints as a cluster writes them, with one rank: the part is copied
  // at the step boundary and stored in the background; the loop commits it
  // (writes the manifest) once stored.
  std::mutex written_mu;
  std::vector<std::pair<pb::checkpoint_written, std::string>> written;  // (report, manifest body)
  part_writer writer([&](uint64_t, pb::checkpoint_written w) {
    std::lock_guard<std::mutex> lock(written_mu);
    std::string meta = w.meta();
    written.emplace_back(std::move(w), std::move(meta));
  });
  auto commit_written = [&]() -> status {
    std::vector<std::pair<pb::checkpoint_written, std::string>> ready;
    {
      std::lock_guard<std::mutex> lock(written_mu);
      ready.swap(written);
    }
    for (auto& [w, body] : ready) {
      if (!w.error().empty()) return make_error("checkpoint at step " + std::to_string(w.step()) + " not saved: " + w.error());
      pb::checkpoint_meta meta;
      if (!meta.ParseFromString(body)) return make_error("checkpoint at step " + std::to_string(w.step()) + ": meta does not parse");
      for (const auto& part : w.parts()) *meta.add_parts() = part;
      const auto t0 = clock_type::now();
      auto done = store->commit(std::move(meta));
      if (!done) return done.err();
      ev::checkpoint_saved saved;
      saved.step = w.step();
      saved.path = done->location;
      saved.bytes = static_cast<int64_t>(done->bytes);
      saved.duration_s = seconds_since(t0);
      saved.parts = 1;
      saved.stall_s = w.stall_s();
      saved.write_s = w.write_s();
      saved.bytes_per_s = w.write_s() > 0 ? static_cast<double>(done->bytes) / w.write_s() : 0.0;
      jn.write(saved);
      prog.note_event("checkpoint " + std::to_string(w.step()));
    }
    return {};
  };
  auto save = [&]() {
    const state_layout layout = layout_of(state);
    pb::checkpoint_meta meta = state.checkpoint_meta(eval_at_step, store_generation);
    describe_layout(layout, meta);
    meta.set_world_size(1);
    part_writer::job j;
    j.step = state.step();
    j.store = store->location();
    j.s3_endpoint = cfg.get_string("checkpoint.s3_endpoint");
    j.node_id = this_host_name();
    j.meta = meta.SerializeAsString();
    writer.submit(layout, std::move(j));
    last_saved = state.step();
  };
  auto run_eval = [&]() {
    const auto t0 = clock_type::now();
    summary.last_eval = state.evaluate();
    eval_at_step = summary.last_eval.metrics;
    const auto r = eval_report_of(state.step(), summary.last_eval.metrics, summary.last_eval.examples, seconds_since(t0));
    ev::eval_done done;
    done.step = r.step();
    done.duration_s = r.duration_s();
    for (const auto& [k, v] : r.metrics()) done.metrics[k] = v;
    done.examples.assign(r.examples().begin(), r.examples().end());
    jn.write(done);
    prog.on_eval(state.step(), summary.last_eval.metrics);
    for (const auto& ex : summary.last_eval.examples) prog.log("  " + ex);
  };

  // A shard that cannot be read or parsed (the task's data_error): the
  // journal and the command end with its line, as a cluster's would.
  auto data_failed = [&](const data_error& e) -> error {
    jn.write(ev::job_failed{state.step(), std::nullopt, first_line(e)});
    return make_error(first_line(e));
  };
  double window_loss = 0, window_time = 0, ema_sps = 0;
  int64_t window_steps = 0;
  // Streaming DiLoCo with an overlap: a fragment's exchange in flight is
  // not part of the state, so a stop or a checkpoint waits for it to land
  // (at most train.sync_overlap steps).
  auto in_flight = [&] { return state.diloco() && state.outer().in_flight().has_value(); };
  bool checkpoint_owed = false;
  while (state.step() < max_steps) {
    if (opts.stop_signal && opts.stop_signal->load() != 0 && !in_flight()) {
      summary.stop_signal = opts.stop_signal->load();
      break;
    }
    if (opts.stop_at_step >= 0 && state.step() >= opts.stop_at_step && !in_flight()) break;
    eval_at_step.clear();
    const auto t0 = clock_type::now();
    double loss = 0;
    std::vector<int64_t> anchors_before;
    if (samples_log && state.diloco())
      for (size_t f = 0; f < state.outer().fragments().size(); ++f) anchors_before.push_back(state.outer().fragment_anchor(f));
    try {
      loss = state.train_step();
    } catch (const data_error& e) {
      return data_failed(e);
    }
    const double dt = seconds_since(t0);
    if (samples_log) {
      if (auto st = samples_log->append(state.step() - 1, log_generation, 0, 1, state.recorded_samples()); !st) return st.err();
      // DiLoCo: the outer steps that landed with this step (their fragments' anchors moved).
      if (state.diloco()) {
        const outer_optimizer& o = state.outer();
        for (size_t f = 0; f < o.fragments().size(); ++f)
          if (o.fragment_anchor(f) != anchors_before[f])
            if (auto st = samples_log->append_synced(o.fragment_anchor(f), log_generation, 0, 1, o.streaming() ? static_cast<int>(f) : -1,
                                                     static_cast<int>(o.fragments().size()));
                !st)
              return st.err();
      }
    }
    if (!std::isfinite(loss)) {
      jn.write(ev::job_failed{state.step(), std::nullopt, "non-finite loss"});
      return make_error("loss became " + std::to_string(loss) + " at step " + std::to_string(state.step()) +
                        "; lower train.lr, keep train.grad_clip on, or resume from an earlier checkpoint");
    }
    window_loss += loss;
    window_time += dt;
    ++window_steps;
    const double sps_now = static_cast<double>(global_batch) / std::max(dt, 1e-9);
    ema_sps = ema_sps == 0 ? sps_now : 0.9 * ema_sps + 0.1 * sps_now;
    const int64_t step = state.step();
    if (cadence.report_due(step)) {
      const double sps = static_cast<double>(window_steps * global_batch) / std::max(window_time, 1e-9);
      ev::step_completed line;
      line.step = step;
      line.world_size = 1;
      line.loss = loss;
      line.loss_avg = window_loss / static_cast<double>(window_steps);
      line.lr = state.lr_at(step - 1);
      line.samples_per_s = sps;
      line.data_wait_s = take_data_wait_s() / static_cast<double>(window_steps);
      jn.write(line);
      prog.on_step(step, loss, state.lr_at(step - 1), sps, 1, true);
      note_usage(false);
      window_loss = window_time = 0;
      window_steps = 0;
    } else {
      prog.on_step(step, loss, state.lr_at(step - 1), ema_sps, 1, false);
    }
    if (cadence.eval_due(step)) {
      try {
        run_eval();
      } catch (const data_error& e) {
        return data_failed(e);
      }
    }
    if (cadence.checkpoint_due(step) || checkpoint_owed) {
      checkpoint_owed = in_flight();
      if (!checkpoint_owed) save();
    }
    if (auto st = commit_written(); !st) return st.err();
  }
  prog.finish();

  summary.step = state.step();
  summary.finished = state.step() >= max_steps;
  summary.params_digest = state.params_digest();
  if (!summary.finished && last_saved != state.step()) save();
  writer.wait_idle();
  if (auto st = commit_written(); !st) return st.err();
  summary.wall_s = seconds_since(start);
  note_usage(true);
  if (summary.finished) {
    ev::job_finished finished;
    finished.step = summary.step;
    finished.params_digest = summary.params_digest;
    finished.wall_s = summary.wall_s;
    finished.metrics = summary.last_eval.metrics;
    jn.write(finished);
  } else {
    ev::job_stopped stopped;
    stopped.step = summary.step;
    stopped.params_digest = summary.params_digest;
    stopped.reason = summary.stop_signal ? "signal " + std::to_string(summary.stop_signal) : "stop_at_step";
    jn.write(stopped);
  }
  return summary;
}

}  // namespace

result<train_summary> run_training(const config& cfg, const train_options& opts) {
  try {
    return run_training_unguarded(cfg, opts);
  } catch (const data_error& e) {
    return make_error(first_line(e));
  }
}

result<eval_result> run_evaluation(const std::string& target, const std::string& config_path, const std::vector<std::string>& overrides,
                                   int64_t* step_out) {
  auto ckpt = open_checkpoint_target(target, [](const std::string& path, const std::string& why) {
    std::fprintf(stderr, "skipping checkpoint %s: %s\n", path.c_str(), why.c_str());
  });
  if (!ckpt) return ckpt.err();
  // Without --config, the job's own config (stored in the checkpoint) applies.
  auto loaded = config_path.empty() ? config::parse_toml(ckpt->meta.config_toml(), ckpt->name + " (stored config)") : config::load(config_path, {});
  if (!loaded) return loaded.err();
  config cfg = std::move(loaded.value());
  for (const auto& o : overrides) {
    auto eq = o.find('=');
    if (eq == std::string::npos || eq == 0) return make_error("--set expects key=value, got '" + o + "'");
    if (auto st = cfg.set(o.substr(0, eq), o.substr(eq + 1)); !st) return st.err();
  }
  if (auto st = check_checkpoint_compatible(ckpt->meta, cfg, ckpt->name); !st) return st.err();
  configure_threads(cfg);
  auto created = training_state::create(cfg);
  if (!created) return created.err();
  if (auto st = load_checkpoint(*created.value(), *ckpt->store, ckpt->meta); !st) return make_error("'" + ckpt->name + "': " + st.message());
  if (step_out) *step_out = ckpt->meta.step();
  try {
    return created.value()->evaluate();
  } catch (const data_error& e) {
    return make_error(first_line(e));
  }
}

result<export_summary> run_export(const std::string& target, const std::string& out, bool state_dict) {
  if (out.empty()) return make_error("export needs --out FILE");
  auto ckpt = open_checkpoint_target(target, [](const std::string& path, const std::string& why) {
    std::fprintf(stderr, "skipping checkpoint %s: %s\n", path.c_str(), why.c_str());
  });
  if (!ckpt) return ckpt.err();
  auto cfg = config::parse_toml(ckpt->meta.config_toml(), ckpt->name + " (stored config)");
  if (!cfg) return cfg.err();
  // One thread is plenty to rebuild the module; no data beyond what the task reads.
  (void)cfg->set("train.threads", "1");
  configure_threads(cfg.value());
  auto created = training_state::create(cfg.value());
  if (!created) return created.err();
  training_state& state = *created.value();
  if (auto st = load_checkpoint(state, *ckpt->store, ckpt->meta); !st) return make_error("'" + ckpt->name + "': " + st.message());
  // Streaming DiLoCo: a checkpoint taken mid-run holds rank 0's own
  // parameters as the model; the model the job has is the global one.
  if (state.diloco() && state.outer().streaming()) state.outer().swap_global();
  export_summary summary;
  summary.step = ckpt->meta.step();
  auto module = state.the_task().module();
  const std::string tmp = out + ".tmp";
  try {
    if (!state_dict && state.the_task().save_scripted(tmp)) {
      summary.what = "scripted module";
      summary.tensors = static_cast<int64_t>(module->parameters().size() + module->buffers().size());
    } else {
      c10::Dict<std::string, torch::Tensor> dict;
      for (const auto& kv : module->named_parameters()) dict.insert(kv.key(), kv.value().detach().clone());
      for (const auto& kv : module->named_buffers()) dict.insert(kv.key(), kv.value().detach().clone());
      const std::vector<char> bytes = torch::pickle_save(c10::IValue(dict));
      if (auto st = write_file_atomic(tmp, {std::string_view(bytes.data(), bytes.size())}); !st) return st.err();
      summary.what = "state_dict";
      summary.tensors = static_cast<int64_t>(dict.size());
    }
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    std::filesystem::remove(tmp);
    return make_error("cannot write '" + out + "': " + what.substr(0, what.find('\n')));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, out, ec);
  if (ec) return make_error("cannot write '" + out + "': " + ec.message());
  return summary;
}

}  // namespace dtactor
