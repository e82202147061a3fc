// Throughput of the whole runtime against the single-process engine, from
// the journals of real runs of the dtactor binary (wall-clock time between
// `step` events, so every cost between steps counts):
//   train   : `dtactor train`, 1 process, 1 compute thread
//   local1  : `dtactor local --nodes 1` (coordinator + node + 1 rank, 1 thread)
//   local2  : `dtactor local --nodes 2` (2 ranks, 1 thread each)
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
//   build/bench/bench_runtime [--bin build/dtactor] [--config examples/vit_fashion_mnist.toml]
//                             [--steps 600] [--repeats 3] [--work DIR] [--baseline-bin B]
//                             [--modes train,local1,local2,base_local1,base_local2]
#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/process.hpp"

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

// Samples/s between consecutive `step` events after the first quarter (warm-up).
run_figures read_run(const std::string& journal, int64_t global_batch) {
  std::ifstream in(journal);
  std::string line;
  std::vector<std::pair<int64_t, double>> pts;
  std::vector<double> ar, ex;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || j.value("event", "") != "step") continue;
    pts.emplace_back(j.at("step").get<int64_t>(), j.at("t").get<double>());
    if (j.contains("allreduce_s")) ar.push_back(1000 * j["allreduce_s"].get<double>());
    if (j.contains("allreduce_exposed_s")) ex.push_back(1000 * j["allreduce_exposed_s"].get<double>());
  }
  std::vector<double> rates;
  for (size_t i = std::max<size_t>(1, pts.size() / 4); i < pts.size(); ++i) {
    const double dt = pts[i].second - pts[i - 1].second;
    if (dt > 0) rates.push_back(static_cast<double>((pts[i].first - pts[i - 1].first) * global_batch) / dt);
  }
  return {median(rates), median(ar), median(ex)};
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

}  // namespace

int main(int argc, char** argv) {
  std::string baseline, modes_arg, bin = "build/dtactor", cfg = "examples/vit_fashion_mnist.toml", work = "/tmp/dtactor-bench-runtime";
  int steps = 600, repeats = 3;
  for (int i = 1; i < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf("usage: bench_runtime [--bin build/dtactor] [--config FILE] [--steps 600] [--repeats 3] [--work DIR]\n"
                  "                     [--baseline-bin B] [--modes train,local1,local2,base_local1,base_local2]\n");
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
    else {
      std::fprintf(stderr, "bench_runtime: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  const int64_t batch = 128;
  const std::vector<std::string> sets = {"--set", "train.max_steps=" + std::to_string(steps), "--set", "train.global_batch_size=128",
                                         "--set", "eval.every_steps=0", "--set", "eval.max_samples=1000", "--set",
                                         "checkpoint.every_steps=0", "--set", "train.log_every_steps=10", "--set", "train.threads=1"};
  std::map<std::string, std::vector<run_figures>> all;
  std::vector<std::string> modes = {"train", "local1", "local2"};
  if (!baseline.empty()) modes.insert(modes.end(), {"base_local1", "base_local2"});
  if (!modes_arg.empty()) {
    modes.clear();
    for (size_t at = 0; at <= modes_arg.size();) {
      size_t comma = modes_arg.find(',', at);
      if (comma == std::string::npos) comma = modes_arg.size();
      const std::string m = modes_arg.substr(at, comma - at);
      if (m != "train" && m != "local1" && m != "local2" && !(m.rfind("base_", 0) == 0 && !baseline.empty() && (m == "base_local1" || m == "base_local2"))) {
        std::fprintf(stderr, "bench_runtime: unknown mode '%s' (train, local1, local2; base_local1, base_local2 need --baseline-bin)\n", m.c_str());
        return 2;
      }
      modes.push_back(m);
      at = comma + 1;
    }
  }
  for (int r = 0; r < repeats; ++r) {
    for (const std::string& mode : modes) {
      const bool base = mode.rfind("base_", 0) == 0;
      const std::string& exe = base ? baseline : bin;
      const std::string dir = work + "/" + mode + "-" + std::to_string(r);
      std::filesystem::remove_all(dir);
      std::vector<std::string> args;
      if (mode == "train")
        args = {exe, "train", "--config", cfg, "--run-dir", dir, "--no-resume"};
      else
        args = {exe, "local", "--nodes", mode.back() == '1' ? "1" : "2", "--config", cfg, "--run-dir", dir};
      args.insert(args.end(), sets.begin(), sets.end());
      std::filesystem::create_directories(dir);
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
    out["modes"][mode] = {{"samples_per_s_median", med[mode]}, {"samples_per_s_runs", sps}, {"minor_page_faults_per_step_median", median(pf)}};
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
  if (!baseline.empty()) {
    out["baseline_bin"] = baseline;
    ratio("ratio_local1_vs_baseline", "local1", "base_local1");
    ratio("ratio_local2_vs_baseline", "local2", "base_local2");
  }
  std::printf("%s\n", out.dump(2).c_str());
  return 0;
}
