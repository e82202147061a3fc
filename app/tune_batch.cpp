#include "app/tune_batch.hpp"

#include <csignal>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

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
    configure_threads(cfg);
    auto created = training_state::create(cfg);
    if (!created) {
      std::fprintf(stderr, "%s\n", created.message().c_str());
      return created.code() == errc::batch_exceeds_data ? probe_too_large_for_data : 1;
    }
    training_state& state = *created.value();
    double timed_s = 0;
    int timed = 0;
    for (int s = 0; s < std::max(steps, 1); ++s) {
      const auto t0 = clock_type::now();
      state.train_step();
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

result<tune_batch_result> run_tune_batch(const config& cfg, const tune_batch_options& opts) {
  if (auto st = validate_training_config(cfg); !st) return st.err();
  if (opts.start < 1) return make_error("--start must be at least 1");
  if (opts.steps < 1) return make_error("--steps must be at least 1");
  if (opts.ranks_per_host < 1) return make_error("--nproc-per-node must be at least 1");
  tune_batch_result res;
  res.max_memory = opts.max_memory;
  if (res.max_memory <= 0) {
    const int64_t avail = mem_available_bytes();
    if (avail <= 0) return make_error("cannot read MemAvailable from /proc/meminfo; give --max-memory");
    res.max_memory = static_cast<int64_t>(static_cast<double>(avail) * 0.9) / opts.ranks_per_host;
  }
  const int64_t up_to = opts.up_to > 0 ? opts.up_to : cfg.get_int("train.global_batch_size");
  if (up_to < opts.start) return make_error("--up-to (" + std::to_string(up_to) + ") is below --start (" + std::to_string(opts.start) + ")");

  if (auto st = ensure_writable_dir(opts.run_dir); !st) return make_error("run directory: " + st.message());
  auto run_lock = file_lock::try_acquire(run_dir_lock_path(opts.run_dir), "dtactor tune-batch");
  if (!run_lock) return make_error(run_dir_busy_message(opts.run_dir, run_lock.err()));
  journal jn;
  if (auto st = jn.open(opts.run_dir + "/journal.jsonl"); !st) return st.err();
  if (!std::filesystem::exists(opts.run_dir + "/config.toml"))
    if (auto st = write_file_atomic(opts.run_dir + "/config.toml", {cfg.to_toml()}); !st) return st.err();
  jn.write(ev::batch_size_search_started{cfg.get_string("model.name"), res.max_memory, opts.start, up_to, opts.steps});
  std::printf("searching the largest micro-batch of %s from %lld up to %lld within %s per rank (%d steps per size)\n",
              cfg.get_string("model.name").c_str(), static_cast<long long>(opts.start), static_cast<long long>(up_to),
              human_bytes(static_cast<double>(res.max_memory)).c_str(), opts.steps);
  std::fflush(stdout);

  const std::string exe = self_executable();
  const std::string out_path = opts.run_dir + "/tune-batch-probe.log";
  auto stopped = [&] { return opts.stop_signal && opts.stop_signal->load() != 0; };

  // One trial in a fresh process. An error that is not about memory or the
  // data's size ends the search with the probe's own line.
  auto trial = [&](int64_t b) -> result<batch_trial> {
    std::vector<std::string> argv{exe, "tune-batch", "--probe", std::to_string(b), "--steps", std::to_string(opts.steps)};
    argv.insert(argv.end(), opts.probe_args.begin(), opts.probe_args.end());
    std::filesystem::remove(out_path);
    auto child = child_process::spawn(argv, false, out_path);
    if (!child) return make_error("cannot start a probe: " + child.message());
    batch_trial t;
    t.micro_batch = b;
    double seen = 0;
    bool over = false;
    std::optional<child_exit> ex;
    while (!(ex = child->poll())) {
      if (stopped()) {
        child->signal(SIGKILL);
        child->wait();
        return make_error("stopped by a signal");
      }
      if (auto u = read_proc_usage(child->pid())) {
        seen = std::max(seen, u->rss_bytes);
        if (u->rss_bytes > static_cast<double>(res.max_memory)) {
          over = true;
          child->signal(SIGKILL);
          ex = child->wait();
          break;
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    const std::string output = read_whole(out_path);
    t.peak_rss_bytes = seen;
    if (over) {
      t.why = "over the budget (resident " + human_bytes(seen) + ", killed)";
      return t;
    }
    if (ex->signaled) {
      // Killed from outside (the kernel's OOM killer, say): does not fit.
      t.why = "the probe was " + ex->describe();
      return t;
    }
    if (ex->exit_code == probe_out_of_memory || ex->exit_code == probe_too_large_for_data) {
      t.why = last_line(output);
      return t;
    }
    if (ex->exit_code != 0) return make_error("micro-batch " + std::to_string(b) + ": " + last_line(output));
    // The probe's own report is its last JSON line.
    std::istringstream lines(output);
    std::string line, json_line;
    while (std::getline(lines, line))
      if (!line.empty() && line.front() == '{') json_line = line;
    auto j = nlohmann::json::parse(json_line, nullptr, false);
    if (j.is_discarded() || !j.contains("peak_rss_bytes")) return make_error("micro-batch " + std::to_string(b) + ": the probe reported nothing");
    t.peak_rss_bytes = std::max(seen, j.at("peak_rss_bytes").get<double>());
    t.samples_per_s = j.at("samples_per_s").get<double>();
    t.fits = t.peak_rss_bytes <= static_cast<double>(res.max_memory);
    if (!t.fits) t.why = "peak " + human_bytes(t.peak_rss_bytes) + " is over the budget";
    return t;
  };
  auto record = [&](const batch_trial& t) {
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
  };

  // Double, then bisect (Lightning's "binsearch" mode).
  int64_t lo = 0, hi = 0;  // largest that fit, smallest that did not
  int64_t b = opts.start;
  int trials = 0;
  while (trials < opts.max_trials) {
    auto t = trial(b);
    if (!t) return t.err();
    ++trials;
    record(t.value());
    if (!t->fits) {
      hi = b;
      break;
    }
    lo = b;
    if (b >= up_to) break;
    b = std::min(b * 2, up_to);
  }
  // Bisect to within 1/32 of the size: memory peaks vary by a few MiB from
  // run to run, so finer steps near the budget measure noise.
  while (hi > 0 && lo > 0 && hi - lo > std::max<int64_t>(1, lo / 32) && trials < opts.max_trials) {
    const int64_t mid = lo + (hi - lo) / 2;
    auto t = trial(mid);
    if (!t) return t.err();
    ++trials;
    record(t.value());
    if (t->fits) lo = mid;
    else hi = mid;
  }
  std::filesystem::remove(out_path);
  if (lo == 0) {
    jn.write(ev::batch_size_found{0, res.max_memory, std::nullopt, std::nullopt, std::nullopt, std::nullopt});
    return make_error("even micro-batch " + std::to_string(opts.start) + " does not fit in " + human_bytes(static_cast<double>(res.max_memory)) +
                      " per rank: " + res.trials.front().why);
  }
  res.micro_batch = lo;
  res.limited_by_up_to = hi == 0 && lo >= up_to;
  const batch_trial* best = nullptr;
  for (const auto& t : res.trials)
    if (t.fits && t.micro_batch == lo) best = &t;
  jn.write(ev::batch_size_found{lo, res.max_memory, best ? best->peak_rss_bytes : 0.0, best ? best->samples_per_s : 0.0, res.limited_by_up_to,
                                static_cast<int64_t>(res.trials.size())});
  return res;
}

}  // namespace dtactor
