#include "app/train_command.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <mutex>
#include <variant>

#include "model/diloco.hpp"
#include "monitoring/journal.hpp"
#include "monitoring/progress.hpp"
#include "monitoring/resources.hpp"
#include "monitoring/run_observer.hpp"
#include "actors/job_progress.hpp"
#include "rank/rank_worker.hpp"
#include "rank/state_io.hpp"
#include "rank/step_policy.hpp"
#include "base/blas_info.hpp"
#include "storage/checkpoint_store.hpp"
#include "data/data_shards.hpp"
#include "data/data_wait.hpp"
#include "storage/fs.hpp"
#include "job/checkpoint_commit.hpp"
#include "job/job_config.hpp"
#include "job/resume_point.hpp"
#include "job/settings.hpp"
#include "data/sample_log.hpp"

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

// The one generation of a `train` run: world 1, this host's one rank, the
// state already in place, checkpoints to the run's store.
pb::generation_plan plan_of_one(uint64_t generation, const std::string& node_id, int64_t start_step, const std::string& store,
                                const std::string& config_text) {
  pb::generation_plan plan;
  plan.set_generation(generation);
  plan.set_world_size(1);
  auto* me = plan.add_ranks();
  me->set_node_id(node_id);
  me->set_local_rank(0);
  me->set_global_rank(0);
  me->set_host_ranks(1);
  plan.set_start_step(start_step);
  plan.set_state_root(-1);
  plan.set_checkpoint_step(-1);  // the state is in place already
  plan.set_checkpoint_store(store);
  plan.set_config_toml(config_text);
  plan.set_cause(pb::generation_plan::CAUSE_START);
  return plan;
}

// What the world-1 rank reports, handled on the command's thread as a
// coordinator handles its ranks' reports: steps into the journal, the
// progress line and TensorBoard, evaluations, checkpoint parts committed to
// the store, the worker's end.
class world_one_sink {
 public:
  using event = std::variant<pb::step_report, pb::eval_report, pb::checkpoint_written, pb::rank_status>;

  world_one_sink(uint64_t generation, commit_fn commit, journal& jn, run_observer& prog)
      : generation_(generation), commit_(std::move(commit)), jn_(jn), prog_(prog) {}

  status handle(event& e) {
    if (auto* r = std::get_if<pb::step_report>(&e)) return on_step(*r);
    if (auto* v = std::get_if<pb::eval_report>(&e)) return on_eval(*v);
    if (auto* w = std::get_if<pb::checkpoint_written>(&e)) return on_checkpoint(*w);
    if (auto* s = std::get_if<pb::rank_status>(&e)) on_status(*s);
    return {};
  }

  // Resources (per-process usage from /proc, the data reader's figures)
  // into the journal when due, or now with `force`.
  void note_usage(bool force) {
    if (auto u = read_proc_usage()) usage_.note(0, this_host_name(), *u, held_);
    if (auto d = process_shard_reader_stats())
      usage_.note_data(0, this_host_name(), {d->bytes_read_s3, d->bytes_read_local, d->cache_hits, d->cache_misses, d->shards_verified,
                                             d->shards_failed, d->read_ahead_depth, d->cache_used_bytes, d->cache_peak_bytes});
    if (usage_.due(unix_time_now()) || (force && !usage_.empty())) jn_.write(usage_.snapshot());
  }

  bool done() const { return done_; }
  const std::optional<std::string>& failure() const { return failure_; }
  train_summary& summary() { return summary_; }

 private:
  status on_step(const pb::step_report& r) {
    if (r.outer_steps() > 0) jn_.write(outer_step_of(r, generation_, 1));
    if (r.param_bytes() > 0) held_ = {r.param_bytes(), r.grad_bytes(), r.optimizer_state_bytes(), r.checkpoint_buffer_bytes()};
    auto line = steps_.add(r, generation_, 1);
    if (!line) return {};
    line->generation.reset();
    if (r.data_wait_s() > 0) line->data_wait_s = r.data_wait_s() / std::max(1, r.steps_covered());
    jn_.write(*line);
    prog_.on_step(line->step, line->loss, line->lr, line->samples_per_s, 1, true);
    note_usage(false);
    return {};
  }

  status on_eval(const pb::eval_report& v) {
    ev::eval_done d;
    d.step = v.step();
    d.duration_s = v.duration_s();
    for (const auto& [k, x] : v.metrics()) d.metrics[k] = x;
    d.examples.assign(v.examples().begin(), v.examples().end());
    jn_.write(d);
    summary_.last_eval.metrics = d.metrics;
    summary_.last_eval.examples = d.examples;
    prog_.on_eval(d.step, d.metrics);
    for (const auto& ex : d.examples) prog_.log("  " + ex);
    return {};
  }

  // One rank, one part: the manifest its meta describes, committed.
  status on_checkpoint(const pb::checkpoint_written& w) {
    const std::string not_saved = "checkpoint at step " + std::to_string(w.step()) + " not saved: ";
    if (!w.error().empty()) return make_error(not_saved + w.error());
    written_parts parts;
    parts.generation = generation_;
    parts.world = 1;
    parts.parts[0].assign(w.parts().begin(), w.parts().end());
    parts.meta = w.meta();
    parts.stall_s = w.stall_s();
    parts.write_s = w.write_s();
    parts.direct = w.direct() ? 1 : 0;
    auto done = commit_checkpoint(w.step(), parts, commit_);
    if (!done) return make_error(not_saved + done.message(), done.code());
    ev::checkpoint_saved& saved = done->saved;
    saved.generation.reset();  // a run of its own: no generations in its journal
    jn_.write(saved);
    prog_.note_event("checkpoint " + std::to_string(w.step()));
    return {};
  }

  void on_status(const pb::rank_status& s) {
    if (s.status() == pb::rank_status::STATE_FAILED) {
      failure_ = s.detail();
      summary_.step = s.step();
      done_ = true;
    } else if (s.status() == pb::rank_status::STATE_FINISHED) {
      summary_.step = s.step();
      summary_.params_digest = s.detail();
      done_ = true;
    }
  }

  uint64_t generation_;
  commit_fn commit_;
  journal& jn_;
  run_observer& prog_;
  resource_book usage_;
  state_bytes held_;  // what the rank's last step report said it holds
  step_table steps_;
  train_summary summary_;
  std::optional<std::string> failure_;  // the worker's line when it failed
  bool done_ = false;
};

// Runs the rank worker on `plan` until it ends (or the command's stop
// signal stops it), handing what it reports to `sink` on this thread.
status run_worker(rank_worker_options wo, const pb::generation_plan& plan, const train_options& opts, world_one_sink& sink) {
  std::mutex events_mu;
  std::condition_variable events_cv;
  std::deque<world_one_sink::event> events;
  auto push = [&](world_one_sink::event e) {
    {
      std::lock_guard<std::mutex> lock(events_mu);
      events.push_back(std::move(e));
    }
    events_cv.notify_all();
  };
  rank_worker_callbacks cb;
  cb.on_step = [&](uint64_t, pb::step_report r) { push(std::move(r)); };
  cb.on_eval = [&](uint64_t, pb::eval_report r) { push(std::move(r)); };
  cb.on_checkpoint = [&](uint64_t, pb::checkpoint_written w) { push(std::move(w)); };
  cb.on_status = [&](uint64_t, pb::rank_status s) { push(std::move(s)); };
  status outcome;
  {
    rank_worker worker(std::move(wo), cb);
    worker.offer(plan);
    bool stop_asked = false;
    while (!sink.done() && outcome) {
      std::deque<world_one_sink::event> ready;
      {
        std::unique_lock<std::mutex> lock(events_mu);
        events_cv.wait_for(lock, std::chrono::milliseconds(50), [&] { return !events.empty(); });
        ready.swap(events);
      }
      for (auto& e : ready)
        if (outcome) outcome = sink.handle(e);
      if (!stop_asked && opts.stop_signal && opts.stop_signal->load() != 0) {
        sink.summary().stop_signal = opts.stop_signal->load();
        worker.request_stop(true);
        stop_asked = true;
      }
    }
    worker.quit();
  }
  // What the worker reported before it ended (a checkpoint's last parts).
  for (auto& e : events)
    if (outcome) outcome = sink.handle(e);
  return outcome;
}

// The checkpoint the run resumes from (find_resume_point, as a
// coordinator's), loaded into `state` and journaled; none when it starts
// over.
result<std::optional<resume_point>> resume_training(training_state& state, const config& cfg, const train_options& opts, checkpoint_store& store,
                                                    journal& jn, run_observer& prog) {
  resume_reports reports;
  reports.log = [&prog](const std::string& line) { prog.log(line); };
  reports.journal = [&jn](const ev::journal_event& e) { jn.write(e); };
  auto resume = find_resume_point(resume_request{opts.resume, opts.resume_from}, store, reports);
  if (!resume || !resume.value()) return resume;
  const resume_point& ckpt = *resume.value();
  if (auto st = check_checkpoint_compatible(ckpt.meta, cfg, ckpt.path); !st) return st.err();
  if (auto st = load_checkpoint(state, *ckpt.from, ckpt.meta); !st) return make_error("'" + ckpt.path + "': " + st.message());
  ev::checkpoint_restored restored;
  restored.step = ckpt.meta.step();
  restored.source = ev::state_source::disk;
  restored.path = ckpt.path;
  jn.write(restored);
  prog.log("resumed from " + ckpt.path + " at step " + std::to_string(ckpt.meta.step()));
  return resume;
}

// The run's first lines: job_started in the journal, what it trains on the console.
void journal_the_start(training_state& state, const config& cfg, const train_settings& train, const std::string& run_dir, journal& jn,
                       run_observer& prog) {
  task& tk = state.the_task();
  const blas_info blas = describe_blas();
  const std::string core = blas_core();
  ev::job_started started;
  started.model = tk.name();
  started.parameters = state.parameter_count();
  started.max_steps = train.max_steps;
  started.global_batch_size = train.global_batch_size;
  started.world_size = 1;
  started.start_step = state.step();
  started.threads = at::get_num_threads();
  started.blas = core.empty() ? blas.library : blas.library + " (" + core + " kernels)";
  started.config_digest = cfg.digest();
  jn.write(started);
  prog.log("training " + tk.name() + " (" + std::to_string(state.parameter_count()) + " parameters, " + std::to_string(tk.train_size()) +
           " training samples) from step " + std::to_string(state.step()) + " to " + std::to_string(started.max_steps) + ", run dir " + run_dir);
}

// The run's last journal line: finished, or stopped early.
void journal_the_end(journal& jn, const train_summary& summary) {
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
}

result<train_summary> run_training_unguarded(const config& cfg, const train_options& opts) {
  const auto start = clock_type::now();
  auto settings = job_settings_of(cfg);
  if (!settings) return settings.err();
  const job_settings& s = settings.value();
  if (auto st = ensure_writable_dir(opts.run_dir); !st) return make_error("run directory: " + st.message());
  if (auto st = check_sample_log_dir(s.data.sample_log); !st) return st.err();
  auto run_lock = file_lock::try_acquire(run_dir_lock_path(opts.run_dir), "dtactor train");
  if (!run_lock) return make_error(run_dir_busy_message(opts.run_dir, run_lock.err()));

  configure_threads(s.train.threads);
  auto created = training_state::create(cfg);
  if (!created) return created.err();
  std::shared_ptr<training_state> state_ptr = std::move(created.value());
  training_state& state = *state_ptr;
  auto store = checkpoint_store::open(checkpoint_dir_of(s.checkpoint, opts.run_dir), checkpoint_policy_of(s.checkpoint), default_fs_env(),
                                      s.checkpoint.s3_endpoint);
  if (!store) return store.err();
  if (auto st = store->check_no_foreign_manifests(); !st) return st.err();
  // The run is one generation, numbered above every earlier run's (as a
  // coordinator numbers its first).
  auto before = generations_before(store.value(), s.data.sample_log);
  if (!before) return before.err();
  const uint64_t generation = before.value() + 1;

  journal jn;
  if (auto st = jn.open(opts.run_dir + "/journal.jsonl"); !st) return st.err();
  const std::string config_text = cfg.to_toml();
  if (auto st = write_file_atomic(opts.run_dir + "/config.toml", {config_text}); !st) return st.err();

  const bool interactive = opts.interactive.value_or(progress::stderr_is_terminal());
  // Console progress and TensorBoard scalars (RUN_DIR/tensorboard), as a cluster's coordinator writes them.
  run_observer prog({opts.run_dir, s.train.max_steps, interactive, opts.run_dir + "/train.log"});

  auto resume = resume_training(state, cfg, opts, store.value(), jn, prog);
  if (!resume) return resume.err();
  journal_the_start(state, cfg, s.train, opts.run_dir, jn, prog);
  const int64_t max_steps = s.train.max_steps;

  // The steps are the cluster rank's (rank/rank_worker), at world 1 on the
  // state resumed above: no coordinator, no sockets, no process group.
  rank_worker_options wo;
  wo.node_id = this_host_name();
  wo.state = state_ptr;
  wo.stop_at_step = opts.stop_at_step;
  wo.data_digests = false;
  const auto& ckpt = resume.value();
  wo.state_checkpointed_at = ckpt && ckpt->from->location() == store->location() ? ckpt->meta.step() : -1;
  const pb::generation_plan plan = plan_of_one(generation, wo.node_id, state.step(), store->location(), config_text);
  world_one_sink sink(generation, commit_to(store.value()), jn, prog);
  const status outcome = run_worker(std::move(wo), plan, opts, sink);
  prog.finish();
  if (!outcome) return outcome.err();
  train_summary& summary = sink.summary();
  if (sink.failure()) {
    ev::job_failed failed;
    failed.step = summary.step;
    failed.reason = *sink.failure();
    jn.write(failed);
    return make_error(*sink.failure());
  }
  summary.finished = summary.step >= max_steps;
  summary.wall_s = seconds_since(start);
  sink.note_usage(true);
  journal_the_end(jn, summary);
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
  auto settings = job_settings_of(cfg);  // create()'s first check
  if (!settings) return settings.err();
  configure_threads(settings->train.threads);
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
  // The module as float32, its values the checkpoint's (under
  // train.precision = bf16 too: the masters).
  (void)cfg->set("train.precision", "fp32");
  configure_threads(1);
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
