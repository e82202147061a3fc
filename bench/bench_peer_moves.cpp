// The point-to-point state path on one host (comm/peer_moves): the 202M
// GPT's 2.42 GB of state moved from one rank process to another in 64 MiB
// pieces, four on their way at once (as a healing transfer sends them),
// through the sender's memory (process_vm_readv) against over a Gloo group
// of two TCP streams (the transfer group's), into a destination whose pages
// are already in (a rank that held the state) and into fresh pages (a
// joining rank's new windows). Every mode alternates within each round;
// prints one JSON object (bench/bench_meta.py stamp --kind peer_moves).
//
// Usage: bench_peer_moves [--bytes N] [--rounds R]
#include <sys/wait.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "comm/peer_moves.hpp"

using namespace dtactor;

namespace {

constexpr int64_t piece = 64ll << 20;
constexpr size_t in_flight = 4;

uint8_t pattern(int64_t i) { return static_cast<uint8_t>((i * 131 + i / 4096) & 0xff); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : (v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2);
}

p2p_waits waits() {
  return {nullptr, [](const c10::intrusive_ptr<c10d::Work>& w, const std::string& what) -> status {
            try {
              if (!w->wait(std::chrono::minutes(2))) return make_error(what + ": timed out");
            } catch (const std::exception& e) {
              return make_error(what + ": " + e.what());
            }
            return {};
          }};
}

// One move of `t` between rank 0 (sending) and rank 1; the receiver's seconds.
double move_once(c10d::ProcessGroup& pg, const local_peers& table, const torch::Tensor& t) {
  pg.barrier()->wait();
  const auto t0 = std::chrono::steady_clock::now();
  peer_moves mv(pg, table, waits());
  const int64_t n = t.numel();
  int tag = 1;
  for (int64_t at = 0; at < n; at += piece) {
    auto part = t.narrow(0, at, std::min(piece, n - at));
    if (pg.getRank() == 0)
      mv.send(part, 1, tag++);
    else
      mv.recv(part, 0, tag++);
    if (auto st = mv.complete_until(in_flight); !st) throw std::runtime_error(st.message());
  }
  if (auto st = mv.finish(); !st) throw std::runtime_error(st.message());
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int run(int rank, const std::string& store_path, int64_t bytes, int rounds) {
  auto store = c10::make_intrusive<c10d::FileStore>(store_path, 2);
  communicator_options o;
  o.timeout = std::chrono::minutes(2);
  o.streams = 2;  // rank/group_builder's state_transfer_streams
  auto pg = make_process_group(store, rank, 2, o);
  if (!pg) {
    std::fprintf(stderr, "bench_peer_moves: %s\n", pg.message().c_str());
    return 1;
  }
  auto agreed = local_peers::agree(*pg.value(), std::chrono::steady_clock::now() + std::chrono::minutes(1), {});
  if (!agreed || !agreed->reads(1, 0)) {
    std::fprintf(stderr, "bench_peer_moves: the two processes cannot read each other's memory here\n");
    return 1;
  }
  const local_peers none = local_peers::none(2);
  torch::Tensor source;
  if (rank == 0) {
    source = torch::empty({bytes}, torch::kUInt8);
    auto* p = source.data_ptr<uint8_t>();
    for (int64_t i = 0; i < bytes; ++i) p[i] = pattern(i);
  }
  std::map<std::string, std::vector<double>> gbps;
  std::vector<double> ratio_touched, ratio_fresh;
  for (int r = 0; r < rounds; ++r)
    for (bool fresh : {false, true}) {
      std::map<bool, double> s;
      for (bool memory : {true, false}) {
        torch::Tensor t = rank == 0 ? source : torch::empty({bytes}, torch::kUInt8);  // fresh: untouched pages
        if (rank == 1 && !fresh) t.zero_();
        s[memory] = move_once(*pg.value(), memory ? agreed.value() : none, t);
        if (rank == 1) {
          const auto* p = t.data_ptr<uint8_t>();
          for (int64_t i = 0; i < bytes; i += 4093)
            if (p[i] != pattern(i)) throw std::runtime_error("byte " + std::to_string(i) + " did not arrive");
          gbps[std::string(memory ? "memory" : "group") + (fresh ? "_fresh" : "_touched")].push_back(static_cast<double>(bytes) / s[memory] / 1e9);
        }
      }
      (fresh ? ratio_fresh : ratio_touched).push_back(s[false] / s[true]);
    }
  if (rank != 1) return 0;
  nlohmann::json out = {{"benchmark", "peer_moves"},
                        {"what", "bytes moved from one rank process to another on this host, 64 MiB pieces, 4 in flight, the receiver's time"},
                        {"bytes", bytes},
                        {"rounds", rounds}};
  for (const auto& [k, v] : gbps) out[k] = {{"gb_per_s_median", median(v)}, {"gb_per_s_runs", v}};
  out["group_s_over_memory_s_touched_paired_median"] = median(ratio_touched);
  out["group_s_over_memory_s_fresh_paired_median"] = median(ratio_fresh);
  std::printf("%s\n", out.dump(1).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t bytes = 2422043592;  // the 202M GPT's state (bench/gpt_join.py)
  int rounds = 5;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--bytes" && i + 1 < argc)
      bytes = std::max<int64_t>(1, std::atoll(argv[++i]));
    else if (a == "--rounds" && i + 1 < argc)
      rounds = std::max(1, std::atoi(argv[++i]));
    else {
      std::fprintf(stderr, "usage: bench_peer_moves [--bytes N] [--rounds R]\n");
      return 2;
    }
  }
  char dir[] = "/tmp/bench_peer_moves.XXXXXX";
  if (!::mkdtemp(dir)) return 1;
  const std::string store = std::string(dir) + "/store";
  const pid_t child = ::fork();  // before LibTorch starts any thread
  if (child < 0) return 1;
  int rc = 1;
  try {
    rc = run(child == 0 ? 1 : 0, store, bytes, rounds);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_peer_moves: rank %d: %s\n", child == 0 ? 1 : 0, e.what());
  }
  if (child == 0) {
    std::fflush(stdout);
    std::_Exit(rc);
  }
  int st = 0;
  ::waitpid(child, &st, 0);
  std::remove(store.c_str());
  ::rmdir(dir);
  return rc == 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : 1;
}
