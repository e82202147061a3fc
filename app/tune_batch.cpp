#include "app/tune_batch.hpp"

#include <csignal>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "comm/grad_sync.hpp"
#include "model/torch_error.hpp"
#include "model/trainer.hpp"
#include "monitoring/journal.hpp"
#include "monitoring/resources.hpp"
#include "storage/fs.hpp"
#include "job/job_config.hpp"
#include "base/process.hpp"

namespace dtactor {

namespace {

// Probe exit codes (anything else: an error that ends the search).
constexpr int probe_out_of_memory = 3;
constexpr int probe_too_large_for_data = 4;

using clock_type = std::chrono::steady_clock;

std::string human_bytes(double b) {
  char buf[32];
  if (b >= 1024.0 * 1024 * 1024) std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1024.0 * 1024 * 1024));
  else std::snprintf(buf, sizeof buf, "%.0f MiB", b / (1024.0 * 1024));
  return buf;
}

int64_t mem_available_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb * 1024;
  return 0;
}

std::string last_line(const std::string& text) {
  std::istringstream in(text);
  std::string line, last;
  while (std::getline(in, line))
    if (!line.empty()) last = line;
  return last;
}

std::string read_whole(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

result<int64_t> parse_bytes(const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || !std::isfinite(v) || v <= 0) return make_error("'" + text + "' is not a size (e.g. 8G, 512M, 1073741824)");
  std::string unit(end);
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  double mult = 1;
  if (unit.empty() || unit == "B") mult = 1;
  else if (unit == "K" || unit == "KB" || unit == "KIB") mult = 1024.0;
  else if (unit == "M" || unit == "MB" || unit == "MIB") mult = 1024.0 * 1024;
  else if (unit == "G" || unit == "GB" || unit == "GIB") mult = 1024.0 * 1024 * 1024;
  else if (unit == "T" || unit == "TB" || unit == "TIB") mult = 1024.0 * 1024 * 1024 * 1024;
  else return make_error("'" + text + "' is not a size (units: K, M, G, T, binary)");
  return static_cast<int64_t>(v * mult);
}

namespace {

// One step of the probe, as rank/step_loop takes it at world 1.
status probe_step(training_state& state, const step_context& ctx, grad_sync& local) {
  if (auto r = state.train_step(ctx); !r) return r.err();
  if (!state.diloco()) return {};
  return state.outer().after_inner_step(
      state.step(), state.outer().options().max_steps, [&local](size_t) -> grad_sync& { return local; }, std::nullopt,
      [](const outer_step_result&) {});
}

}  // namespace

int run_batch_probe(const config& base, int64_t micro_batch, int steps) {
  config cfg = base;
  for (const auto& [k, v] : std::vector<std::pair<std::string, std::string>>{{"train.global_batch_size", std::to_string(micro_batch)},
                                                                             {"train.micro_batch_size", "0"},
                                                                             {"train.max_steps", std::to_string(std::max(steps, 1))}})
    if (auto st = cfg.set(k, v); !st) {
      std::fprintf(stderr, "%s\n", st.message().c_str());
      return 1;
    }
  try {
    auto settings = job_settings_of(cfg);  // create()'s first check
    if (!settings) {
      std::fprintf(stderr, "%s\n", settings.message().c_str());
      return 1;
    }
    configure_threads(settings->train.threads);
    auto created = training_state::create(cfg);
    if (!created) {
      std::fprintf(stderr, "%s\n", created.message().c_str());
      return created.code() == errc::batch_exceeds_data ? probe_too_large_for_data : 1;
    }
    training_state& state = *created.value();
    // The step training runs at world 1 (rank/sync_strategy,
    // rank/diloco_window): the job's sync mode through a reducer without a
    // group, then DiLoCo's outer step where one is due.
    grad_sync local(state.the_task().module()->parameters(), c10::intrusive_ptr<c10d::ProcessGroup>());
    const auto ctx = step_context::of_job(state.diloco(), 0, 1, local);
    double timed_s = 0;
    int timed = 0;
    for (int s = 0; s < std::max(steps, 1); ++s) {
      const auto t0 = clock_type::now();
      if (auto st = probe_step(state, ctx, local); !st) {
        std::fprintf(stderr, "%s\n", st.message().c_str());
        return 1;
      }
      if (s > 0 || steps == 1) {
        timed_s += std::chrono::duration<double>(clock_type::now() - t0).count();
        ++timed;
      }
    }
    const auto usage = read_proc_usage(0);
    nlohmann::json out{{"micro_batch", micro_batch},
                       {"peak_rss_bytes", usage ? usage->peak_rss_bytes : 0.0},
                       {"samples_per_s", timed_s > 0 ? static_cast<double>(micro_batch) * timed / timed_s : 0.0}};
    std::printf("%s\n", out.dump().c_str());
    std::fflush(stdout);
    return 0;
  } catch (...) {
    const error e = current_torch_error();
    std::fprintf(stderr, "%s\n", e.message.c_str());
    return e.code == errc::out_of_memory ? probe_out_of_memory : 1;
  }
}

namespace {

// The per-rank memory budget: --max-memory, else 90% of MemAvailable shared
// by the host's ranks.
result<int64_t> memory_budget(const tune_batch_options& opts) {
  if (opts.max_memory > 0) return opts.max_memory;
  const int64_t avail = mem_available_bytes();
  if (avail <= 0) return make_error("cannot read MemAvailable from /proc/meminfo; give --max-memory");
  return static_cast<int64_t>(static_cast<double>(avail) * 0.9) / opts.ranks_per_host;
}

status check_options(const tune_batch_options& opts) {
  if (opts.start < 1) return make_error("--start must be at least 1");
  if (opts.steps < 1) return make_error("--steps must be at least 1");
  if (opts.ranks_per_host < 1) return make_error("--nproc-per-node must be at least 1");
  return {};
}

// One trial is a fresh `dtactor tune-batch --probe B` process watched for
// its resident memory. It ends in a batch_trial (it fits, or why not), or in
// an error that ends the search: the probe's own line for an error that is
// not about memory or the data's size, or a stop signal.
class probe_runner {
 public:
  probe_runner(const tune_batch_options& opts, int64_t budget)
      : opts_(opts), budget_(budget), exe_(self_executable()), out_path_(opts.run_dir + "/tune-batch-probe.log") {}

  result<batch_trial> run(int64_t b) {
    std::vector<std::string> argv{exe_, "tune-batch", "--probe", std::to_string(b), "--steps", std::to_string(opts_.steps)};
    argv.insert(argv.end(), opts_.probe_args.begin(), opts_.probe_args.end());
    std::filesystem::remove(out_path_);
    auto child = child_process::spawn(argv, false, out_path_);
    if (!child) return make_error("cannot start a probe: " + child.message());
    auto seen = watch(child.value());
    if (!seen) return seen.err();
    return judge(b, seen.value());
  }

  // The probe's output file, once the search is over.
  void remove_output() const { std::filesystem::remove(out_path_); }

 private:
  struct watched {
    child_exit exit;
    double peak_rss_bytes = 0;  // the largest resident size seen
    bool over = false;          // killed for going over the budget
  };

  // Polls the probe until it exits, killing it once it goes over the budget
  // (or on a stop signal: an error).
  result<watched> watch(child_process& child) {
    watched w;
    std::optional<child_exit> ex;
    while (!(ex = child.poll())) {
      if (opts_.stop_signal && opts_.stop_signal->load() != 0) {
        child.signal(SIGKILL);
        child.wait();
        return make_error("stopped by a signal");
      }
      if (auto u = read_proc_usage(child.pid())) {
        w.peak_rss_bytes = std::max(w.peak_rss_bytes, u->rss_bytes);
        if (u->rss_bytes > static_cast<double>(budget_)) {
          w.over = true;
          child.signal(SIGKILL);
          ex = child.wait();
          break;
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    w.exit = *ex;
    return w;
  }

  // What the probe's end and its output say about micro-batch `b`.
  result<batch_trial> judge(int64_t b, const watched& w) const {
    const std::string output = read_whole(out_path_);
    batch_trial t;
    t.micro_batch = b;
    t.peak_rss_bytes = w.peak_rss_bytes;
    if (w.over) {
      t.why = "over the budget (resident " + human_bytes(w.peak_rss_bytes) + ", killed)";
      return t;
    }
    if (w.exit.signaled) {
      // Killed from outside (the kernel's OOM killer, say): does not fit.
      t.why = "the probe was " + w.exit.describe();
      return t;
    }
    if (w.exit.exit_code == probe_out_of_memory || w.exit.exit_code == probe_too_large_for_data) {
      t.why = last_line(output);
      return t;
    }
    if (w.exit.exit_code != 0) return make_error("micro-batch " + std::to_string(b) + ": " + last_line(output));
    // The probe's own report is its last JSON line.
    std::istringstream lines(output);
    std::string line, json_line;
    while (std::getline(lines, line))
      if (!line.empty() && line.front() == '{') json_line = line;
    auto j = nlohmann::json::parse(json_line, nullptr, false);
    if (j.is_discarded() || !j.contains("peak_rss_bytes")) return make_error("micro-batch " + std::to_string(b) + ": the probe reported nothing");
    t.peak_rss_bytes = std::max(w.peak_rss_bytes, j.at("peak_rss_bytes").get<double>());
    t.samples_per_s = j.at("samples_per_s").get<double>();
    t.fits = t.peak_rss_bytes <= static_cast<double>(budget_);
    if (!t.fits) t.why = "peak " + human_bytes(t.peak_rss_bytes) + " is over the budget";
    return t;
  }

  const tune_batch_options& opts_;
  const int64_t budget_;
  const std::string exe_;
  const std::string out_path_;
};

// A trial into the result, the journal (batch_size_trial) and the console.
void record(const batch_trial& t, tune_batch_result& res, journal& jn) {
  res.trials.push_back(t);
  ev::batch_size_trial line{t.micro_batch, t.fits, t.peak_rss_bytes, std::nullopt, std::nullopt};
  if (t.fits) line.samples_per_s = t.samples_per_s;
  else line.reason = t.why;
  jn.write(line);
  if (t.fits)
    std::printf("  micro-batch %lld: fits, peak %s, %.0f samples/s\n", static_cast<long long>(t.micro_batch), human_bytes(t.peak_rss_bytes).c_str(),
                t.samples_per_s);
  else
    std::printf("  micro-batch %lld: does not fit: %s\n", static_cast<long long>(t.micro_batch), t.why.c_str());
  std::fflush(stdout);
}

// The search's bounds: the largest size that fit and the smallest that did
// not (0: none).
struct search_bounds {
  int64_t lo = 0, hi = 0;
};

// Doubles from opts.start up to `up_to`, then bisects (Lightning's
// "binsearch" mode), at most opts.max_trials trials, each recorded.
result<search_bounds> search(probe_runner& probe, const tune_batch_options& opts, int64_t up_to, tune_batch_result& res, journal& jn) {
  search_bounds sb;
  int trials = 0;
  auto try_size = [&](int64_t b) -> result<bool> {
    auto t = probe.run(b);
    if (!t) return t.err();
    ++trials;
    record(t.value(), res, jn);
    return t->fits;
  };
  for (int64_t b = opts.start; trials < opts.max_trials; b = std::min(b * 2, up_to)) {
    auto fits = try_size(b);
    if (!fits) return fits.err();
    if (!fits.value()) {
      sb.hi = b;
      break;
    }
    sb.lo = b;
    if (b >= up_to) break;
  }
  // Bisect to within 1/32 of the size: memory peaks vary by a few MiB from
  // run to run, so finer steps near the budget measure noise.
  while (sb.hi > 0 && sb.lo > 0 && sb.hi - sb.lo > std::max<int64_t>(1, sb.lo / 32) && trials < opts.max_trials) {
    const int64_t mid = sb.lo + (sb.hi - sb.lo) / 2;
    auto fits = try_size(mid);
    if (!fits) return fits.err();
    (fits.value() ? sb.lo : sb.hi) = mid;
  }
  return sb;
}

// The search's end into the result and the journal (batch_size_found).
// Error: not even opts.start fit.
result<tune_batch_result> conclude(tune_batch_result res, search_bounds sb, int64_t up_to, const tune_batch_options& opts, journal& jn) {
  if (sb.lo == 0) {
    ev::batch_size_found none;
    none.max_memory_bytes = res.max_memory;
    jn.write(none);
    return make_error("even micro-batch " + std::to_string(opts.start) + " does not fit in " + human_bytes(static_cast<double>(res.max_memory)) +
                      " per rank: " + res.trials.front().why);
  }
  res.micro_batch = sb.lo;
  res.limited_by_up_to = sb.hi == 0 && sb.lo >= up_to;
  const batch_trial* best = nullptr;
  for (const auto& t : res.trials)
    if (t.fits && t.micro_batch == sb.lo) best = &t;
  ev::batch_size_found found;
  found.micro_batch = sb.lo;
  found.max_memory_bytes = res.max_memory;
  found.peak_rss_bytes = best ? best->peak_rss_bytes : 0.0;
  found.samples_per_s = best ? best->samples_per_s : 0.0;
  found.limited_by_up_to = res.limited_by_up_to;
  found.trials = static_cast<int64_t>(res.trials.size());
  jn.write(found);
  return res;
}

}  // namespace

result<tune_batch_result> run_tune_batch(const config& cfg, const tune_batch_options& opts) {
  auto settings = job_settings_of(cfg);
  if (!settings) return settings.err();
  const job_settings& s = settings.value();
  if (auto st = check_options(opts); !st) return st.err();
  tune_batch_result res;
  auto budget = memory_budget(opts);
  if (!budget) return budget.err();
  res.max_memory = budget.value();
  const int64_t up_to = opts.up_to > 0 ? opts.up_to : s.train.global_batch_size;
  if (up_to < opts.start) return make_error("--up-to (" + std::to_string(up_to) + ") is below --start (" + std::to_string(opts.start) + ")");

  if (auto st = ensure_writable_dir(opts.run_dir); !st) return make_error("run directory: " + st.message());
  auto run_lock = file_lock::try_acquire(run_dir_lock_path(opts.run_dir), "dtactor tune-batch");
  if (!run_lock) return make_error(run_dir_busy_message(opts.run_dir, run_lock.err()));
  journal jn;
  if (auto st = jn.open(opts.run_dir + "/journal.jsonl"); !st) return st.err();
  if (!std::filesystem::exists(opts.run_dir + "/config.toml"))
    if (auto st = write_file_atomic(opts.run_dir + "/config.toml", {cfg.to_toml()}); !st) return st.err();
  jn.write(ev::batch_size_search_started{s.model.name, res.max_memory, opts.start, up_to, opts.steps});
  std::printf("searching the largest micro-batch of %s from %lld up to %lld within %s per rank (%d steps per size)\n", s.model.name.c_str(),
              static_cast<long long>(opts.start), static_cast<long long>(up_to), human_bytes(static_cast<double>(res.max_memory)).c_str(),
              opts.steps);
  std::fflush(stdout);

  probe_runner probe(opts, res.max_memory);
  auto sb = search(probe, opts, up_to, res, jn);
  if (!sb) return sb.err();
  probe.remove_output();
  return conclude(std::move(res), sb.value(), up_to, opts, jn);
}

}  // namespace dtactor
