#pragma once
// CPU time and memory of processes, read from /proc (Linux), for the node's
// per-rank series, the process's own process_* series, and the journal's
// `resources` events that `dtactor report` turns into the log book's table.
#include <sys/types.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "job/journal_events.hpp"

namespace dtactor {

class metrics;

struct proc_usage {
  double cpu_s = 0;           // user + system CPU time since the process started
  double rss_bytes = 0;       // resident memory now (VmRSS)
  double peak_rss_bytes = 0;  // peak resident memory (VmHWM)
  double age_s = 0;           // seconds since the process started
  double start_unix = 0;      // when it started (unix seconds)
};

// Training state a rank holds, as it reports it (0 = not reported).
struct state_bytes {
  uint64_t params = 0, grads = 0, optimizer = 0;
  uint64_t checkpoint_buffer = 0;
};

// This machine's host name ("localhost" when it has none).
std::string this_host_name();

// Usage of `pid` (0 = this process), or nothing when it has gone.
std::optional<proc_usage> read_proc_usage(pid_t pid = 0);

// The node's view of its rank processes: which pid each local rank has, and
// their usage as dtactor_rank_* series labelled rank="<local rank>" (bounded:
// the node's --nproc-per-node). Read at scrape time and when a rank's step
// report passes through. Thread-safe.
class rank_usage_tracker {
 public:
  explicit rank_usage_tracker(metrics& m);
  ~rank_usage_tracker();
  // A rank process announced itself (its rank_hello); `peer` is its link id.
  void track(const std::string& peer, int local_rank, pid_t pid);
  // Samples the rank behind `peer` now; nothing when unknown or gone.
  std::optional<proc_usage> sample(const std::string& peer);
  // The node's waiting spare processes now (nev::spares): their resident
  // memory, summed, is dtactor_spare_resident_memory_bytes, not a rank's
  // series (a spare that takes a slot is tracked as that rank from its hello).
  void track_spares(std::vector<pid_t> pids);
  // Samples every tracked rank and the spares (the metrics endpoint calls it
  // per scrape).
  void sample_all();

 private:
  struct entry {
    int local_rank = 0;
    pid_t pid = 0;
    double cpu_counted = 0;  // CPU seconds of this pid already added to the counter
  };
  void update(entry& e, const proc_usage& u);
  metrics& m_;
  std::mutex mu_;
  std::map<std::string, entry> by_peer_;
  std::vector<pid_t> spares_;
};

// The coordinator's (and `dtactor train`'s) book of each rank's latest usage,
// for the journal's `resources` event (ev::resources).
// Not thread-safe: one owner (the coordinator sink's job-actor events, or the training loop).
class resource_book {
 public:
  void note(int rank, const std::string& node, const proc_usage& u, const state_bytes& held = {});
  // Sharded data: the rank's reading (ev::rank_usage's), for the same rows.
  void note_data(int rank, const std::string& node, const ev::data_reading& d);
  bool empty() const { return ranks_.empty(); }
  // The event; peaks are the largest seen for the rank.
  ev::resources snapshot() const;
  // True at most every `period_s` (and the first time something was noted).
  bool due(double now_unix, double period_s = 30);

 private:
  struct row {
    std::string node;
    proc_usage u;
    state_bytes held;
    std::optional<ev::data_reading> data;
  };
  std::map<int, row> ranks_;
  double last_written_ = 0;
  bool changed_ = false;
};

}  // namespace dtactor
