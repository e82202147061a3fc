// Throughput of the whole runtime against the single-process engine, from
// the journals of real runs of the dtactor binary (wall-clock time between
// `step` events, so every cost between steps counts):
//   train   : `dtactor train`, 1 process, 1 compute thread
//   local1  : `dtactor local --nodes 1` (coordinator + node + 1 rank, 1 thread)
//   local2  : `dtactor local --nodes 2` (2 ranks, 1 thread each)
//   train_default, local1_default, local2_default: the same with the
//            default settings (no train.threads: what a user gets)
// Every mode reports its spread over the repeats (min, max, max/min).
// Prints JSON with the median samples/s of each, the ratios the project
// targets (local2/train >= 1.8, local1/train >= 0.97) and the allreduce time
// per step. Ratios are given twice: of the medians, and the median of the
// ratios within each repeat (the modes of one repeat run back to back, so the
// second is less sensitive to the load of this shared machine drifting).
//
// minor_page_faults_per_step: page faults of all the run's processes, start-up
// included, divided by the steps (a step that maps fresh memory shows here).
//
// --baseline-bin B also runs `local --nodes 1/2` of another build (e.g. a
// commit before a feature) in every repeat, as base_local1/base_local2, and
// prints local1/base_local1 and local2/base_local2: what the feature costs.
// --pair A,B (two of train, local1, base_local1) runs A and B at the same
// time instead, in every repeat (which starts first alternates), each on its
// own core (1 compute thread each), and prints the median of B/A over the
// seconds both were training. Load on this shared host drifts by ±10% over
// tens of seconds; side by side both runs see the same drift, so their ratio
// is steadier than that of runs one after the other. A 2-rank mode needs
// both cores and cannot be paired this way.
//
//   build/bench/bench_runtime [--bin build/dtactor] [--config examples/vit_fashion_mnist.toml]
//                             [--steps 600] [--repeats 3] [--work DIR] [--baseline-bin B]
//                             [--modes train,local1,local2,train_default,local1_default,local2_default,base_local1,base_local2]
//                             [--pair train,local1]
// For bench/*.json: pipe the JSON through `bench/bench_meta.py stamp FILE
// --kind runtime --command "..."`, which adds the command, machine and date.
#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "job/journal_events.hpp"
#include "base/process.hpp"

using namespace dtactor;

namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct run_figures {
  double samples_per_s = 0;
  double allreduce_ms = 0, exposed_ms = 0;
  double faults_per_step = 0;
};

// Minor page faults of every waited-for descendant so far (a rank's count
// reaches us through its node, which waits for it, and `local`).
long child_minor_faults() {
  rusage ru{};
  ::getrusage(RUSAGE_CHILDREN, &ru);
  return ru.ru_minflt;
}

struct step_point {
  int64_t step;
  double t;
  double allreduce_ms = -1, exposed_ms = -1;  // -1: not in the event (train)
};

std::vector<step_point> step_points(const std::string& journal) {
  std::ifstream in(journal);
  std::string line;
  std::vector<step_point> pts;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || j.value("event", "") != ev::step_completed::name) continue;
    step_point p{j.at("step").get<int64_t>(), j.at("t").get<double>()};
    if (j.contains("allreduce_s")) p.allreduce_ms = 1000 * j["allreduce_s"].get<double>();
    if (j.contains("allreduce_exposed_s")) p.exposed_ms = 1000 * j["allreduce_exposed_s"].get<double>();
    pts.push_back(p);
  }
  return pts;
}

// Median samples/s between consecutive `step` events that both fall inside
// [lo, hi] (wall-clock seconds of the journals' `t`).
double median_rate_within(const std::vector<step_point>& pts, int64_t global_batch, double lo, double hi) {
  std::vector<double> rates;
  for (size_t i = 1; i < pts.size(); ++i) {
    if (pts[i - 1].t < lo || pts[i].t > hi) continue;
    const double dt = pts[i].t - pts[i - 1].t;
    if (dt > 0) rates.push_back(static_cast<double>((pts[i].step - pts[i - 1].step) * global_batch) / dt);
  }
  return median(rates);
}

// Samples/s between consecutive `step` events after the first quarter (warm-up).
run_figures read_run(const std::string& journal, int64_t global_batch) {
  const auto pts = step_points(journal);
  std::vector<double> ar, ex;
  for (const auto& p : pts) {
    if (p.allreduce_ms >= 0) ar.push_back(p.allreduce_ms);
    if (p.exposed_ms >= 0) ex.push_back(p.exposed_ms);
  }
  const double lo = pts.empty() ? 0 : pts[std::max<size_t>(1, pts.size() / 4) - 1].t;
  return {median_rate_within(pts, global_batch, lo, std::numeric_limits<double>::infinity()), median(ar), median(ex)};
}

int run(const std::vector<std::string>& args, const std::string& log) {
  auto c = child_process::spawn(args, false, log);
  if (!c) {
    std::fprintf(stderr, "bench_runtime: %s\n", c.message().c_str());
    return -1;
  }
  auto e = c->wait();
  return e ? (e->signaled ? 128 + e->signal : e->exit_code) : -1;
}

// --pair A,B: both at once in every repeat; B/A over the seconds both trained.
int run_pair(const std::string& pair_arg, const std::string& baseline, int repeats, int steps, int64_t batch, const std::string& cfg,
             const std::string& work, const std::function<std::vector<std::string>(const std::string&, const std::string&)>& args_of) {
  const size_t comma = pair_arg.find(',');
  const std::string a = pair_arg.substr(0, comma), b = comma == std::string::npos ? "" : pair_arg.substr(comma + 1);
  auto one_rank = [&](const std::string& m) { return m == "train" || m == "local1" || (m == "base_local1" && !baseline.empty()); };
  if (!one_rank(a) || !one_rank(b) || a == b) {
    std::fprintf(stderr, "bench_runtime: --pair takes two different 1-rank modes, e.g. train,local1 (base_local1 needs --baseline-bin), got '%s'\n",
                 pair_arg.c_str());
    return 2;
  }
  std::vector<double> ratios, rate_a, rate_b, overlap;
  for (int r = 0; r < repeats; ++r) {
    const std::string dir_a = work + "/pair-" + a + "-" + std::to_string(r), dir_b = work + "/pair-" + b + "-" + std::to_string(r);
    const auto args_a = args_of(a, dir_a), args_b = args_of(b, dir_b);
    std::optional<child_process> ca, cb;
    for (int k = 0; k < 2; ++k) {  // which one starts first alternates
      const bool first_a = (r % 2 == 0) == (k == 0);
      auto c = child_process::spawn(first_a ? args_a : args_b, false, (first_a ? dir_a : dir_b) + "/output.log");
      if (!c) {
        std::fprintf(stderr, "bench_runtime: %s\n", c.message().c_str());
        return 1;
      }
      (first_a ? ca : cb) = std::move(c.value());
    }
    for (auto* c : {&ca, &cb}) {
      auto e = (*c)->wait();
      if (!e || e->signaled || e->exit_code != 0) {
        std::fprintf(stderr, "bench_runtime: %s run failed, see %s/output.log\n", c == &ca ? a.c_str() : b.c_str(), (c == &ca ? dir_a : dir_b).c_str());
        return 1;
      }
    }
    const auto pa = step_points(dir_a + "/journal.jsonl"), pb = step_points(dir_b + "/journal.jsonl");
    if (pa.size() < 8 || pb.size() < 8) {
      std::fprintf(stderr, "bench_runtime: too few step events to compare (raise --steps)\n");
      return 1;
    }
    // From the later of the two warm-ups (first quarter) to the earlier end.
    const double lo = std::max(pa[pa.size() / 4].t, pb[pb.size() / 4].t), hi = std::min(pa.back().t, pb.back().t);
    const double ra = median_rate_within(pa, batch, lo, hi), rb = median_rate_within(pb, batch, lo, hi);
    if (hi <= lo || ra <= 0 || rb <= 0) {
      std::fprintf(stderr, "bench_runtime: the two runs of repeat %d hardly overlapped (raise --steps)\n", r);
      return 1;
    }
    rate_a.push_back(ra);
    rate_b.push_back(rb);
    ratios.push_back(rb / ra);
    overlap.push_back(hi - lo);
  }
  nlohmann::json out = {{"benchmark", "runtime_side_by_side"},
                        {"config", cfg},
                        {"steps", steps},
                        {"repeats", repeats},
                        {"global_batch_size", batch},
                        {"pair", {a, b}},
                        {"samples_per_s_runs", {{a, rate_a}, {b, rate_b}}},
                        {"overlap_s_runs", overlap},
                        {"ratio_runs", ratios},
                        {"ratio_" + b + "_vs_" + a + "_median", median(ratios)}};
  std::printf("%s\n", out.dump(2).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string baseline, modes_arg, pair_arg, bin = "build/dtactor", cfg = "examples/vit_fashion_mnist.toml", work = "/tmp/dtactor-bench-runtime";
  int steps = 600, repeats = 3;
  for (int i = 1; i < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf("usage: bench_runtime [--bin build/dtactor] [--config FILE] [--steps 600] [--repeats 3] [--work DIR]\n"
                  "                     [--baseline-bin B] [--modes train,local1,local2,base_local1,base_local2]\n"
                  "                     [--pair train,local1]   (run two 1-rank modes side by side instead)\n");
      return 0;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "bench_runtime: %s needs a value\n", a.c_str());
      return 2;
    }
    if (a == "--bin") bin = argv[i + 1];
    else if (a == "--config") cfg = argv[i + 1];
    else if (a == "--steps") steps = std::atoi(argv[i + 1]);
    else if (a == "--repeats") repeats = std::atoi(argv[i + 1]);
    else if (a == "--work") work = argv[i + 1];
    else if (a == "--baseline-bin") baseline = argv[i + 1];
    else if (a == "--modes") modes_arg = argv[i + 1];
    else if (a == "--pair") pair_arg = argv[i + 1];
    else {
      std::fprintf(stderr, "bench_runtime: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  const int64_t batch = 128;
  const std::vector<std::string> sets = {"--set", "train.max_steps=" + std::to_string(steps), "--set", "train.global_batch_size=128",
                                         "--set", "eval.every_steps=0", "--set", "eval.max_samples=1000", "--set",
                                         "checkpoint.every_steps=0", "--set", "train.log_every_steps=10"};
  // The tuned modes fix one compute thread per process; *_default leave the
  // thread count to dtactor, as a user who sets nothing gets it.
  const std::vector<std::string> tuned = {"--set", "train.threads=1"};
  std::map<std::string, std::vector<run_figures>> all;
  std::vector<std::string> modes = {"train", "local1", "local2"};
  if (!baseline.empty()) modes.insert(modes.end(), {"base_local1", "base_local2"});
  if (!modes_arg.empty()) {
    modes.clear();
    for (size_t at = 0; at <= modes_arg.size();) {
      size_t comma = modes_arg.find(',', at);
      if (comma == std::string::npos) comma = modes_arg.size();
      const std::string m = modes_arg.substr(at, comma - at);
      static const std::set<std::string> known = {"train", "local1", "local2", "train_default", "local1_default", "local2_default"};
      if (!known.count(m) && !(m.rfind("base_", 0) == 0 && !baseline.empty() && (m == "base_local1" || m == "base_local2"))) {
        std::fprintf(stderr,
                     "bench_runtime: unknown mode '%s' (train, local1, local2, train_default, local1_default, local2_default; base_local1, "
                     "base_local2 need --baseline-bin)\n",
                     m.c_str());
        return 2;
      }
      modes.push_back(m);
      at = comma + 1;
    }
  }
  auto args_of = [&](const std::string& mode, const std::string& dir) {
    const std::string& exe = mode.rfind("base_", 0) == 0 ? baseline : bin;
    const bool defaults = mode.size() > 8 && mode.compare(mode.size() - 8, 8, "_default") == 0;
    const std::string kind = defaults ? mode.substr(0, mode.size() - 8) : mode;
    std::vector<std::string> args;
    if (kind == "train")
      args = {exe, "train", "--config", cfg, "--run-dir", dir, "--no-resume"};
    else
      args = {exe, "local", "--nodes", kind.back() == '1' ? "1" : "2", "--config", cfg, "--run-dir", dir, "--no-resume"};
    args.insert(args.end(), sets.begin(), sets.end());
    if (!defaults) args.insert(args.end(), tuned.begin(), tuned.end());
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    return args;
  };
  if (!pair_arg.empty()) return run_pair(pair_arg, baseline, repeats, steps, batch, cfg, work, args_of);
  for (int r = 0; r < repeats; ++r) {
    for (const std::string& mode : modes) {
      const std::string dir = work + "/" + mode + "-" + std::to_string(r);
      const auto args = args_of(mode, dir);
      const long faults0 = child_minor_faults();
      if (int rc = run(args, dir + "/output.log"); rc != 0) {
        std::fprintf(stderr, "bench_runtime: %s run failed (exit %d), see %s/output.log\n", mode.c_str(), rc, dir.c_str());
        return 1;
      }
      all[mode].push_back(read_run(dir + "/journal.jsonl", batch));
      all[mode].back().faults_per_step = static_cast<double>(child_minor_faults() - faults0) / steps;
    }
  }
  nlohmann::json out = {{"benchmark", "runtime"}, {"config", cfg}, {"steps", steps}, {"repeats", repeats}, {"global_batch_size", batch}};
  std::map<std::string, double> med;
  for (auto& [mode, figs] : all) {
    std::vector<double> sps, ar, ex, pf;
    for (auto& f : figs) sps.push_back(f.samples_per_s), ar.push_back(f.allreduce_ms), ex.push_back(f.exposed_ms), pf.push_back(f.faults_per_step);
    med[mode] = median(sps);
    const double lo = *std::min_element(sps.begin(), sps.end()), hi = *std::max_element(sps.begin(), sps.end());
    out["modes"][mode] = {{"samples_per_s_median", med[mode]},
                          {"samples_per_s_runs", sps},
                          {"samples_per_s_min", lo},
                          {"samples_per_s_max", hi},
                          {"spread_max_over_min", lo > 0 ? hi / lo : 0.0},
                          {"minor_page_faults_per_step_median", median(pf)}};
    if (mode.find("local2") != std::string::npos) {
      out["modes"][mode]["allreduce_ms_per_step_median"] = median(ar);
      out["modes"][mode]["allreduce_exposed_ms_per_step_median"] = median(ex);
    }
  }
  // ratio of the medians, and the median of each repeat's own ratio
  auto ratio = [&](const std::string& name, const std::string& a, const std::string& b) {
    if (!all.count(a) || !all.count(b)) return;
    std::vector<double> per_repeat;
    for (size_t r = 0; r < all[a].size() && r < all[b].size(); ++r)
      if (all[b][r].samples_per_s > 0) per_repeat.push_back(all[a][r].samples_per_s / all[b][r].samples_per_s);
    out[name] = med[b] > 0 ? med[a] / med[b] : 0.0;
    out[name + "_paired_median"] = median(per_repeat);
  };
  ratio("ratio_2_ranks_vs_1_process", "local2", "train");
  ratio("ratio_runtime_1_rank_vs_train", "local1", "train");
  ratio("ratio_2_ranks_vs_1_process_default_settings", "local2_default", "train_default");
  ratio("ratio_runtime_1_rank_vs_train_default_settings", "local1_default", "train_default");
  ratio("ratio_train_default_vs_tuned", "train_default", "train");
  if (!baseline.empty()) {
    out["baseline_bin"] = baseline;
    ratio("ratio_local1_vs_baseline", "local1", "base_local1");
    ratio("ratio_local2_vs_baseline", "local2", "base_local2");
  }
  std::printf("%s\n", out.dump(2).c_str());
  return 0;
}
