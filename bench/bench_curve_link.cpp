// What CURVE costs per control-plane message (issue 27), measured on the
// sockets dtactor uses: a DEALER client and a ROUTER server, open or keyed
// exactly as zmq_bridge sets them up (make_curve_server/client and the ZAP
// handler with the job's client key), over ipc (node <-> rank) and TCP on
// 127.0.0.1 (coordinator <-> node). Frames are real envelopes: a heartbeat
// as the node sends it, and a step report, plus a 4 KiB and a 64 KiB frame
// (a generation plan is well under the latter).
//
// Per transport and frame: --round-trips ping-pongs, open and keyed runs
// interleaved --repeats times; median wall microseconds per round trip and
// process CPU microseconds per message (getrusage: the bench's own thread,
// the ZAP thread and libzmq's I/O threads; 2 messages per round trip).
// Plus the handshake: connect + first round trip of a fresh socket.
//
// Then the bound on a training job at the default settings: a rank process
// sends and receives cluster.heartbeat_interval_ms heartbeats (10/s each
// way) and a step report every train.log_every_steps steps; its node sends
// and receives the same to the coordinator, per rank a heartbeat each way.
// extra_cpu_fraction_of_a_core = (messages per second) x (keyed - open CPU
// per message). End-to-end throughput of a keyed job (bench/curve_cost.py)
// cannot resolve 1% on this shared machine (runs of one mode spread by
// ±15%); this is the figure that can.
//
//   build/bench/bench_curve_link [--round-trips 20000] [--repeats 5] [--out FILE]
// For bench/*.json: then `bench/bench_meta.py stamp FILE --in FILE --kind
// curve_link --command "..."` adds the command, machine and date.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <zmq.hpp>

#include "proto/wire.pb.h"
#include "base/job_key.hpp"
#include "net/zap_handler.hpp"

using namespace dtactor;
using clk = std::chrono::steady_clock;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0 : (n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2);
}

double cpu_seconds() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_utime.tv_sec + ru.ru_stime.tv_sec + (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

std::string heartbeat_frame() {
  pb::envelope env;
  env.set_protocol_version(1);
  env.set_job_id("job-4f2a9c1e7b3d");
  env.set_sender("node/ip-10-0-3-17");
  env.set_incarnation(0x9e3779b97f4a7c15ULL);
  env.set_generation(7);
  auto* hb = env.mutable_heartbeat();
  hb->set_seq(123456);
  hb->set_sent_steady_s(10234.125);
  hb->set_step(12345);
  return env.SerializeAsString();
}

std::string step_report_frame() {
  pb::envelope env;
  env.set_protocol_version(1);
  env.set_job_id("job-4f2a9c1e7b3d");
  env.set_sender("rank/ip-10-0-3-17/0");
  env.set_incarnation(0x9e3779b97f4a7c15ULL);
  env.set_generation(7);
  auto* r = env.mutable_step_report();
  r->set_step(12345);
  r->set_global_rank(3);
  r->set_world_size(8);
  r->set_loss(2.3456);
  r->set_step_s(2.5);
  r->set_allreduce_s(0.4);
  r->set_allreduce_exposed_s(0.1);
  r->set_samples(1600);
  r->set_lr(3e-4);
  r->set_steps_covered(50);
  r->set_cpu_s(1234.5);
  r->set_rss_bytes(2.5e9);
  r->set_peak_rss_bytes(2.6e9);
  r->set_process_age_s(4000);
  r->set_node_id("ip-10-0-3-17");
  r->set_data_wait_s(0.01);
  r->set_param_bytes(800000000);
  r->set_grad_bytes(800000000);
  r->set_optimizer_state_bytes(1600000000);
  return env.SerializeAsString();
}

struct sample {
  double us_per_round_trip = 0, cpu_us_per_message = 0, handshake_ms = 0;
};

sample run_once(zmq::context_t& ctx, const std::string& endpoint, const std::string& frame, int round_trips,
                const job_key* key) {
  std::unique_ptr<zap_handler> zap;
  if (key) {
    auto z = zap_handler::start(ctx, {curve_key_binary(key->client_public)}, "bench");
    if (!z) throw std::runtime_error(z.message());
    zap = std::move(*z);
  }
  zmq::socket_t server(ctx, zmq::socket_type::router);
  server.set(zmq::sockopt::linger, 0);
  if (key) make_curve_server(server, key->server_secret);
  server.bind(endpoint);
  const std::string bound = server.get(zmq::sockopt::last_endpoint);

  const auto t_connect = clk::now();
  zmq::socket_t client(ctx, zmq::socket_type::dealer);
  client.set(zmq::sockopt::linger, 0);
  if (key) make_curve_client(client, key->server_public, key->client_public, key->client_secret);
  client.connect(bound);

  zmq::message_t id, msg;
  auto round_trip = [&] {
    client.send(zmq::buffer(frame), zmq::send_flags::none);
    (void)server.recv(id);
    (void)server.recv(msg);
    server.send(id, zmq::send_flags::sndmore);
    server.send(msg, zmq::send_flags::none);
    (void)client.recv(msg);
    if (msg.size() != frame.size()) throw std::runtime_error("frame changed in flight");
  };
  round_trip();
  sample s;
  s.handshake_ms = std::chrono::duration<double, std::milli>(clk::now() - t_connect).count();
  for (int i = 0; i < 200; ++i) round_trip();  // warm

  const double c0 = cpu_seconds();
  const auto t0 = clk::now();
  for (int i = 0; i < round_trips; ++i) round_trip();
  const double wall = std::chrono::duration<double>(clk::now() - t0).count();
  const double cpu = cpu_seconds() - c0;
  s.us_per_round_trip = wall / round_trips * 1e6;
  s.cpu_us_per_message = cpu / (2.0 * round_trips) * 1e6;
  client.close();
  server.close();
  zap.reset();
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  int round_trips = 20000, repeats = 5;
  std::string out;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_curve_link: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--round-trips") round_trips = std::stoi(next());
    else if (a == "--repeats") repeats = std::stoi(next());
    else if (a == "--out") out = next();
    else {
      std::fprintf(stderr, "bench_curve_link: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  if (!curve_available()) {
    std::fprintf(stderr, "bench_curve_link: this libzmq has no CURVE\n");
    return 2;
  }
  auto key = generate_job_key();
  if (!key) {
    std::fprintf(stderr, "bench_curve_link: %s\n", key.message().c_str());
    return 2;
  }
  const std::string ipc_dir = "/tmp/dtactor-bench-curve-" + std::to_string(getpid());
  struct frame_kind {
    std::string name, bytes;
  };
  const std::vector<frame_kind> frames = {{"heartbeat", heartbeat_frame()},
                                          {"step_report", step_report_frame()},
                                          {"4KiB", std::string(4096, 'x')},
                                          {"64KiB", std::string(65536, 'x')}};
  const std::vector<std::pair<std::string, std::string>> transports = {{"ipc", "ipc://" + ipc_dir},
                                                                       {"tcp", "tcp://127.0.0.1:*"}};
  zmq::context_t ctx(1);
  nlohmann::json result;
  result["round_trips"] = round_trips;
  result["repeats"] = repeats;
  for (const auto& [tname, endpoint] : transports) {
    for (const auto& f : frames) {
      const int n = f.bytes.size() > 8192 ? std::max(1000, round_trips / 10) : round_trips;
      std::vector<double> rt[2], cpu[2], hs[2], cpu_ratio, cpu_delta;
      for (int r = 0; r < repeats; ++r) {
        sample s[2];
        for (int k = 0; k < 2; ++k) {
          const bool keyed = (k + r) % 2 == 1;  // alternate which mode goes first
          s[keyed] = run_once(ctx, endpoint, f.bytes, n, keyed ? &*key : nullptr);
        }
        for (int k = 0; k < 2; ++k) {
          rt[k].push_back(s[k].us_per_round_trip);
          cpu[k].push_back(s[k].cpu_us_per_message);
          hs[k].push_back(s[k].handshake_ms);
        }
        cpu_delta.push_back(s[1].cpu_us_per_message - s[0].cpu_us_per_message);
      }
      nlohmann::json j;
      j["frame_bytes"] = f.bytes.size();
      j["round_trips"] = n;
      for (int k = 0; k < 2; ++k) {
        auto& m = j[k ? "keyed" : "open"];
        m["us_per_round_trip"] = median(rt[k]);
        m["cpu_us_per_message"] = median(cpu[k]);
        m["handshake_ms"] = median(hs[k]);
      }
      j["extra_cpu_us_per_message_paired_median"] = median(cpu_delta);
      result[tname][f.name] = j;
      std::fprintf(stderr, "%s %-11s %6zu B: round trip %.1f -> %.1f us, cpu/msg %.2f -> %.2f us, handshake %.2f -> %.2f ms\n",
                   tname.c_str(), f.name.c_str(), f.bytes.size(), median(rt[0]), median(rt[1]), median(cpu[0]),
                   median(cpu[1]), median(hs[0]), median(hs[1]));
    }
  }
  // The bound at the default settings (cluster.heartbeat_interval_ms = 100,
  // train.log_every_steps = 50): per rank, a heartbeat each way every 100 ms
  // on node <-> rank (ipc) and on coordinator <-> node (tcp), a step report
  // every 50 steps up both. Even at 100 steps/s that is 2 reports/s.
  const double hb_per_s = 2 * 1000.0 / 100;  // sent + received
  const double reports_per_s = 100.0 / 50;
  const double extra_ipc = std::max(0.0, result["ipc"]["heartbeat"]["extra_cpu_us_per_message_paired_median"].get<double>());
  const double extra_tcp = std::max(0.0, result["tcp"]["heartbeat"]["extra_cpu_us_per_message_paired_median"].get<double>());
  const double extra_rep_ipc =
      std::max(0.0, result["ipc"]["step_report"]["extra_cpu_us_per_message_paired_median"].get<double>());
  const double rank_us_per_s = hb_per_s * extra_ipc + reports_per_s * extra_rep_ipc;
  const double node_us_per_s = hb_per_s * (extra_ipc + extra_tcp) + reports_per_s * (extra_rep_ipc + extra_tcp);
  result["default_settings_bound"] = {
      {"messages_per_s_per_link", hb_per_s + reports_per_s},
      {"rank_process_extra_cpu_fraction_of_a_core", rank_us_per_s / 1e6},
      {"node_process_extra_cpu_fraction_of_a_core_per_rank", node_us_per_s / 1e6},
      {"note", "both sides of each link counted in the per-message CPU, so this overstates each process"}};
  std::printf("%s\n", result.dump(2).c_str());
  if (!out.empty()) std::ofstream(out) << result.dump(2) << "\n";
  std::filesystem::remove(ipc_dir);
  return 0;
}
