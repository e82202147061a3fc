// Data-parallel scaling of the ViT step: samples/s of the global batch with 1
// rank and with 2 ranks as 2 real processes (Gloo over a c10d::TCPStore on
// 127.0.0.1, rank 0 serves the store), each rank with train.threads=1, plus
// where a step's time goes (compute, exposed allreduce, optimizer). Prints JSON.
//
//   build/bench/bench_dp [--config examples/vit_fashion_mnist.toml] [--warmup N]
//                        [--steps N] [--repeats K] [--bucket-kb KB] [--worlds 1,2]
//                        [--global-batch 128] [--shm 1|0]
//
// --shm 0 makes the 2 ranks exchange gradients through Gloo (loopback TCP)
// instead of shared memory (cluster.shm_allreduce).
//
// The parent only orchestrates: every measurement runs in fresh child
// processes (this binary again, with --rank R --world W --out FILE), so one
// world's thread pools and allocator never warm the other's.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/trainer.hpp"
#include "comm/communicator.hpp"
#include "comm/grad_sync.hpp"
#include "comm/shm_group.hpp"
#include "comm/step_control.hpp"

extern char** environ;

using namespace dtactor;

namespace {

struct options {
  std::string config = "examples/vit_fashion_mnist.toml";
  int warmup = 3, steps = 8, repeats = 5, bucket_kb = 0, global_batch = 128, rank = -1, world = 1, port = 0, shm = 1;
  std::string worlds = "1,2", out;
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// CPU seconds this process used so far (all its threads: compute and Gloo's).
double cpu_seconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + 1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / static_cast<double>(v.size());
}

// A port the kernel just said was free on 127.0.0.1.
int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  int port = 29500;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 && ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

// One rank: trains warm-up + repeats*steps steps and writes its figures to opts.out.
int run_rank(const options& o) {
  std::vector<std::string> overrides = {"train.threads=1", "train.global_batch_size=" + std::to_string(o.global_batch), "eval.every_steps=0", "checkpoint.every_steps=0"};
  if (o.bucket_kb > 0) overrides.push_back("cluster.bucket_kb=" + std::to_string(o.bucket_kb));
  overrides.push_back(std::string("cluster.shm_allreduce=") + (o.shm ? "true" : "false"));
  auto cfg = config::load(o.config, overrides);
  if (!cfg) {
    std::fprintf(stderr, "bench_dp: %s\n", cfg.message().c_str());
    return 1;
  }
  configure_threads(1);  // train.threads=1
  auto created = training_state::create(cfg.value());
  if (!created) {
    std::fprintf(stderr, "bench_dp: %s\n", created.message().c_str());
    return 1;
  }
  auto& s = *created.value();
  const cluster_settings& cluster = s.settings().cluster;
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  c10::intrusive_ptr<c10d::Store> store;
  std::shared_ptr<shm_group> shm;
  if (o.world > 1) {
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(o.port);
    so.isServer = o.rank == 0;
    so.numWorkers = o.world;
    so.timeout = std::chrono::seconds(120);
    store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
    communicator_options co;
    co.timeout = cluster.collective_timeout;
    auto made = make_process_group(store, o.rank, o.world, co);
    if (!made) {
      std::fprintf(stderr, "bench_dp: %s\n", made.message().c_str());
      return 1;
    }
    pg = made.value();
    if (cluster.shm_allreduce) {
      int64_t floats = step_control::words, largest = 0;
      for (const auto& p : s.the_task().module()->parameters()) {
        floats += p.numel();
        largest = std::max<int64_t>(largest, p.numel());
      }
      auto prefixed = c10::make_intrusive<c10d::PrefixStore>("shm", store);
      std::string why;
      largest += cluster.bucket_kb * 256 + step_control::words;
      auto joined = shm_group::join(*prefixed, o.rank, o.world,
                                    shm_slot_floats(floats, largest, cluster.shm_ring_mb * (int64_t{1} << 18), false), &why);
      if (!joined) {
        std::fprintf(stderr, "bench_dp: %s\n", joined.message().c_str());
        return 1;
      }
      if (!joined.value()) std::fprintf(stderr, "bench_dp: rank %d: no shared memory (%s), Gloo carries the gradients\n", o.rank, why.c_str());
      shm = joined.value();
    }
  }
  grad_sync_options gso;
  gso.bucket_bytes = cluster.bucket_kb * 1024;
  gso.spin_wait = cluster.spin_wait;
  gso.exchange = exchange_spec_of(cluster);
  gso.exchange.transport = shm ? exchange_transport::shared_memory : exchange_transport::process_group;
  gso.shm = shm;
  gso.timeout = cluster.collective_timeout;
  grad_sync sync(s.the_task().module()->parameters(), pg, gso);

  std::vector<training_state::dp_step> records;
  auto step = [&]() -> bool {
    auto r = s.train_step(step_context::every_step(o.rank < 0 ? 0 : o.rank, o.world, sync));
    if (!r) {
      std::fprintf(stderr, "bench_dp: rank %d: %s\n", o.rank, r.message().c_str());
      return false;
    }
    records.push_back(r.value());
    return true;
  };
  for (int i = 0; i < o.warmup; ++i)
    if (!step()) return 1;
  records.clear();
  const double global_batch = static_cast<double>(s.settings().train.global_batch_size);
  std::vector<double> sps, step_s;
  const double cpu0 = cpu_seconds();
  for (int r = 0; r < o.repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < o.steps; ++i)
      if (!step()) return 1;
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    sps.push_back(o.steps * global_batch / dt);
    step_s.push_back(dt / o.steps);
  }
  const double cpu_per_step = (cpu_seconds() - cpu0) / static_cast<double>(o.repeats * o.steps);
  std::vector<double> compute, update, allreduce, exposed;
  for (const auto& r : records) {
    compute.push_back(r.compute_s);
    update.push_back(r.update_s);
    allreduce.push_back(r.allreduce_s);
    exposed.push_back(r.exposed_s);
  }
  nlohmann::json out = {{"world", o.world},
                        {"rank", o.rank < 0 ? 0 : o.rank},
                        {"samples_per_s", median(sps)},
                        {"samples_per_s_runs", sps},
                        {"step_s", median(step_s)},
                        {"cpu_s_per_step", cpu_per_step},  // this rank's process, all threads
                        {"compute_s_per_step", mean(compute)},
                        {"update_s_per_step", mean(update)},
                        {"allreduce_s_per_step", mean(allreduce)},
                        {"exposed_allreduce_s_per_step", mean(exposed)},
                        {"buckets", sync.bucket_count()},
                        {"shared_memory", sync.uses_shm()},
                        {"bucket_kb", cluster.bucket_kb},
                        {"samples_per_rank", records.empty() ? 0 : records.back().samples},
                        {"params_digest", s.params_digest()}};
  std::ofstream(o.out) << out.dump() << "\n";
  return 0;
}

// Starts `world` ranks of this binary and returns their JSON, rank order.
std::vector<nlohmann::json> run_world(const options& o, int world, const char* self) {
  const int port = free_port();
  std::vector<pid_t> pids;
  std::vector<std::string> outs;
  for (int r = 0; r < world; ++r) {
    outs.push_back("/tmp/bench_dp." + std::to_string(::getpid()) + "." + std::to_string(world) + "." + std::to_string(r) + ".json");
    std::vector<std::string> args = {self,      "--rank",   std::to_string(r),         "--world", std::to_string(world),
                                     "--port",  std::to_string(port), "--out",     outs.back(),      "--config",
                                     o.config,  "--warmup", std::to_string(o.warmup), "--steps", std::to_string(o.steps),
                                     "--repeats", std::to_string(o.repeats), "--bucket-kb", std::to_string(o.bucket_kb),
                                     "--global-batch", std::to_string(o.global_batch), "--shm", std::to_string(o.shm)};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = 0;
    if (::posix_spawn(&pid, self, nullptr, nullptr, argv.data(), environ) != 0) {
      std::fprintf(stderr, "bench_dp: cannot start rank %d\n", r);
      return {};
    }
    pids.push_back(pid);
  }
  bool ok = true;
  for (pid_t p : pids) {
    int st = 0;
    ::waitpid(p, &st, 0);
    ok = ok && WIFEXITED(st) && WEXITSTATUS(st) == 0;
  }
  std::vector<nlohmann::json> res;
  for (auto& f : outs) {
    std::ifstream in(f);
    if (ok && in) res.push_back(nlohmann::json::parse(in));
    std::remove(f.c_str());
  }
  if (!ok || res.size() != static_cast<size_t>(world)) return {};
  return res;
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--config") o.config = v;
    else if (a == "--warmup") o.warmup = std::stoi(v);
    else if (a == "--steps") o.steps = std::stoi(v);
    else if (a == "--repeats") o.repeats = std::stoi(v);
    else if (a == "--bucket-kb") o.bucket_kb = std::stoi(v);
    else if (a == "--worlds") o.worlds = v;
    else if (a == "--global-batch") o.global_batch = std::stoi(v);
    else if (a == "--rank") o.rank = std::stoi(v);
    else if (a == "--world") o.world = std::stoi(v);
    else if (a == "--port") o.port = std::stoi(v);
    else if (a == "--out") o.out = v;
    else if (a == "--shm") o.shm = std::stoi(v);
    else {
      std::fprintf(stderr, "bench_dp: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if (o.rank >= 0) return run_rank(o);

  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return 1;
  self[n] = 0;
  nlohmann::json out = {{"benchmark", "dp"}, {"config", o.config}, {"global_batch_size", o.global_batch}, {"threads_per_rank", 1},
                        {"warmup_steps", o.warmup}, {"steps_per_run", o.steps}, {"runs", o.repeats},
                        {"cores", static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN))}};
  std::stringstream ws(o.worlds);
  std::string w;
  std::map<int, double> sps;
  while (std::getline(ws, w, ',')) {
    const int world = std::stoi(w);
    auto ranks = run_world(o, world, self);
    if (ranks.empty()) {
      std::fprintf(stderr, "bench_dp: world %d failed\n", world);
      return 1;
    }
    auto r0 = ranks[0];
    bool same = true;
    for (auto& r : ranks) same = same && r.at("params_digest") == r0.at("params_digest");
    r0["ranks_agree"] = same;
    // Per rank: a rank that waits much longer than the other waits for its
    // slower peer (skew), not for the wire.
    nlohmann::json by_rank = nlohmann::json::array(), compute_by_rank = nlohmann::json::array();
    for (auto& r : ranks) {
      by_rank.push_back(r.at("exposed_allreduce_s_per_step"));
      compute_by_rank.push_back(r.at("compute_s_per_step"));
    }
    r0["exposed_allreduce_s_per_step_by_rank"] = by_rank;
    r0["compute_s_per_step_by_rank"] = compute_by_rank;
    r0.erase("rank");
    out["world_" + w] = r0;
    sps[world] = r0.at("samples_per_s").get<double>();
  }
  if (sps.count(1) && sps.count(2)) {
    out["speedup_2_over_1"] = sps[2] / sps[1];
    const auto& w2 = out["world_2"];
    const double ar = w2.at("allreduce_s_per_step").get<double>(), ex = w2.at("exposed_allreduce_s_per_step").get<double>();
    out["allreduce_s_per_step"] = ar;
    out["exposed_allreduce_s_per_step"] = ex;
    out["overlap_fraction"] = ar > 0 ? std::max(0.0, 1.0 - ex / ar) : 1.0;
    out["buckets"] = w2.at("buckets");
    out["shared_memory"] = w2.at("shared_memory");
  }
  std::printf("%s\n", out.dump(2).c_str());
  return 0;
}
