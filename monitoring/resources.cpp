#include "monitoring/resources.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "monitoring/journal.hpp"
#include "monitoring/metrics.hpp"

namespace dtactor {

namespace {

double boot_time_unix() {
  static const double boot = [] {
    std::ifstream in("/proc/stat");
    std::string key;
    double v = 0;
    while (in >> key) {
      if (key == "btime") {
        in >> v;
        return v;
      }
      in.ignore(1 << 20, '\n');
    }
    return 0.0;
  }();
  return boot;
}

}  // namespace

std::string this_host_name() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0 || !host[0]) return "localhost";
  return host;
}

std::optional<proc_usage> read_proc_usage(pid_t pid) {
  const std::string dir = pid == 0 ? "/proc/self" : "/proc/" + std::to_string(pid);
  std::ifstream stat(dir + "/stat");
  std::string line;
  if (!stat || !std::getline(stat, line)) return std::nullopt;
  // The command name (field 2) may contain spaces: fields are counted after its ')'.
  const auto close = line.rfind(')');
  if (close == std::string::npos) return std::nullopt;
  std::istringstream rest(line.substr(close + 2));
  std::string f;
  double utime = 0, stime = 0, starttime = 0;
  for (int field = 3; rest >> f; ++field) {
    if (field == 14) utime = std::atof(f.c_str());
    if (field == 15) stime = std::atof(f.c_str());
    if (field == 22) {
      starttime = std::atof(f.c_str());
      break;
    }
  }
  static const double hz = static_cast<double>(::sysconf(_SC_CLK_TCK));
  proc_usage u;
  u.cpu_s = (utime + stime) / hz;
  u.start_unix = boot_time_unix() + starttime / hz;
  u.age_s = std::max(0.0, unix_time_now() - u.start_unix);
  std::ifstream status(dir + "/status");
  while (std::getline(status, line)) {
    auto kb = [&](const char* key) { return std::atof(line.c_str() + std::strlen(key)) * 1024.0; };
    if (line.rfind("VmRSS:", 0) == 0) u.rss_bytes = kb("VmRSS:");
    if (line.rfind("VmHWM:", 0) == 0) u.peak_rss_bytes = kb("VmHWM:");
  }
  return u;
}

rank_usage_tracker::rank_usage_tracker(metrics& m) : m_(m) {}
rank_usage_tracker::~rank_usage_tracker() = default;

void rank_usage_tracker::track(const std::string& peer, int local_rank, pid_t pid) {
  std::lock_guard<std::mutex> lock(mu_);
  // A restarted rank is a new process: its CPU time starts from zero again
  // while the counter of its rank slot keeps growing.
  for (auto it = by_peer_.begin(); it != by_peer_.end();)
    it = it->second.local_rank == local_rank && it->first != peer ? by_peer_.erase(it) : std::next(it);
  auto& e = by_peer_[peer];
  if (e.pid != pid) e = entry{local_rank, pid, 0};
}

void rank_usage_tracker::update(entry& e, const proc_usage& u) {
  const std::string r = std::to_string(e.local_rank);
  if (u.cpu_s > e.cpu_counted) {
    m_.rank_cpu_seconds(r).Increment(u.cpu_s - e.cpu_counted);
    e.cpu_counted = u.cpu_s;
  }
  m_.rank_resident_memory(r).Set(u.rss_bytes);
  m_.rank_peak_resident_memory(r).Set(u.peak_rss_bytes);
}

std::optional<proc_usage> rank_usage_tracker::sample(const std::string& peer) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_peer_.find(peer);
  if (it == by_peer_.end()) return std::nullopt;
  auto u = read_proc_usage(it->second.pid);
  if (u) update(it->second, *u);
  return u;
}

void rank_usage_tracker::track_spares(std::vector<pid_t> pids) {
  std::lock_guard<std::mutex> lock(mu_);
  spares_ = std::move(pids);
}

void rank_usage_tracker::sample_all() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [peer, e] : by_peer_)
    if (auto u = read_proc_usage(e.pid)) update(e, *u);
  double spare_bytes = 0;
  for (pid_t pid : spares_)
    if (auto u = pid > 0 ? read_proc_usage(pid) : std::nullopt) spare_bytes += u->rss_bytes;
  m_.spare_resident_memory().Set(spare_bytes);
}

void resource_book::note(int rank, const std::string& node, const proc_usage& u, const state_bytes& held) {
  auto& r = ranks_[rank];
  if (held.params > 0) r.held = held;
  const double peak = std::max(r.u.peak_rss_bytes, u.peak_rss_bytes);
  r.node = node;
  r.u = u;
  r.u.peak_rss_bytes = peak;
  changed_ = true;
}

void resource_book::note_data(int rank, const std::string& node, const ev::data_reading& d) {
  auto& r = ranks_[rank];
  r.node = node;
  r.data = d;
  changed_ = true;
}

ev::resources resource_book::snapshot() const {
  ev::resources out;
  for (const auto& [rank, r] : ranks_) {
    ev::rank_resources x;
    x.rank = rank;
    x.node = r.node;
    x.rss_bytes = r.u.rss_bytes;
    x.peak_rss_bytes = r.u.peak_rss_bytes;
    x.cpu_s = r.u.cpu_s;
    x.elapsed_s = r.u.age_s;
    if (r.held.params > 0) {
      x.param_bytes = r.held.params;
      x.grad_bytes = r.held.grads;
      x.optimizer_state_bytes = r.held.optimizer;
      x.checkpoint_buffer_bytes = r.held.checkpoint_buffer;
    }
    if (r.data) {
      x.data_bytes_s3 = r.data->bytes_s3;
      x.data_bytes_local = r.data->bytes_local;
      x.data_cache_hits = r.data->cache_hits;
      x.data_cache_misses = r.data->cache_misses;
      x.data_shards_verified = r.data->shards_verified;
      x.data_shards_failed = r.data->shards_failed;
      x.data_read_ahead_depth = r.data->read_ahead_depth;
      x.data_cache_bytes = r.data->cache_bytes;
      x.data_cache_peak_bytes = r.data->cache_peak_bytes;
    }
    out.ranks.push_back(std::move(x));
  }
  return out;
}

bool resource_book::due(double now_unix, double period_s) {
  if (!changed_ || now_unix - last_written_ < period_s) return false;
  last_written_ = now_unix;
  changed_ = false;
  return true;
}

}  // namespace dtactor
