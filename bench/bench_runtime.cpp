// Throughput of the whole runtime against the single-process engine, from
// the journals of real runs of the dtactor binary (wall-clock time between
// `step` events, so every cost between steps counts):
//   train   : `dtactor train`, 1 process, 1 compute thread
//   local1  : `dtactor local --nodes 1` (coordinator + node + 1 rank, 1 thread)
//   local2  : `dtactor local --nodes 2` (2 ranks, 1 thread each)
// Prints JSON with the median samples/s of each, the ratios the project
// targets (local2/train >= 1.8, local1/train >= 0.97) and the allreduce time
// per step.
//   build/bench/bench_runtime [--bin build/dtactor] [--config examples/vit_fashion_mnist.toml]
//                             [--steps 600] [--repeats 3] [--work DIR]
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
};

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
  std::string bin = "build/dtactor", cfg = "examples/vit_fashion_mnist.toml", work = "/tmp/dtactor-bench-runtime";
  int steps = 600, repeats = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--bin") bin = argv[i + 1];
    else if (a == "--config") cfg = argv[i + 1];
    else if (a == "--steps") steps = std::atoi(argv[i + 1]);
    else if (a == "--repeats") repeats = std::atoi(argv[i + 1]);
    else if (a == "--work") work = argv[i + 1];
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
  for (int r = 0; r < repeats; ++r) {
    for (const std::string mode : {"train", "local1", "local2"}) {
      const std::string dir = work + "/" + mode + "-" + std::to_string(r);
      std::filesystem::remove_all(dir);
      std::vector<std::string> args;
      if (mode == "train")
        args = {bin, "train", "--config", cfg, "--run-dir", dir, "--no-resume"};
      else
        args = {bin, "local", "--nodes", mode == "local1" ? "1" : "2", "--config", cfg, "--run-dir", dir};
      args.insert(args.end(), sets.begin(), sets.end());
      std::filesystem::create_directories(dir);
      if (int rc = run(args, dir + "/output.log"); rc != 0) {
        std::fprintf(stderr, "bench_runtime: %s run failed (exit %d), see %s/output.log\n", mode.c_str(), rc, dir.c_str());
        return 1;
      }
      all[mode].push_back(read_run(dir + "/journal.jsonl", batch));
    }
  }
  nlohmann::json out = {{"benchmark", "runtime"}, {"config", cfg}, {"steps", steps}, {"repeats", repeats}, {"global_batch_size", batch}};
  std::map<std::string, double> med;
  for (auto& [mode, figs] : all) {
    std::vector<double> sps, ar, ex;
    for (auto& f : figs) sps.push_back(f.samples_per_s), ar.push_back(f.allreduce_ms), ex.push_back(f.exposed_ms);
    med[mode] = median(sps);
    out["modes"][mode] = {{"samples_per_s_median", med[mode]}, {"samples_per_s_runs", sps}};
    if (mode == "local2") {
      out["modes"][mode]["allreduce_ms_per_step_median"] = median(ar);
      out["modes"][mode]["allreduce_exposed_ms_per_step_median"] = median(ex);
    }
  }
  out["ratio_2_ranks_vs_1_process"] = med["local2"] / med["train"];
  out["ratio_runtime_1_rank_vs_train"] = med["local1"] / med["train"];
  std::printf("%s\n", out.dump(2).c_str());
  return 0;
}
