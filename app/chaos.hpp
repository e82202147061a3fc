#pragma once
// `dtactor local --chaos`: a fault you can watch. While the local job
// trains, a node process is killed with SIGKILL at intervals (its ranks die
// with it, as when a machine vanishes) and, once the survivors train again,
// a replacement node is started. After each recovery one line says how long
// the loss took to detect, how long until the first step at the new world
// size, and how many steps were lost; at the end, a summary.
//
// What happened is read from the run's journal (journal.jsonl), the same
// record the status page and `dtactor report` show: the monkey never asks
// the coordinator anything.
#include <cstdint>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "job/journal_events.hpp"

namespace dtactor {

struct chaos_options {
  double every_s = 20;  // seconds of training between a recovery and the next kill
  double give_up_s = 120;  // a recovery or join not seen within this long is reported and skipped
  uint64_t seed = 0;    // which node is killed (0: from the clock)
};

// One recovery from a kill, as measured (seconds from the kill).
struct chaos_recovery {
  std::string node;
  double detected_s = -1;    // the coordinator declared it lost
  double first_step_s = -1;  // every survivor completed a step at the new world size
  int32_t world = 0;
  int64_t lost_steps = 0;
  std::string replacement;
  double joined_s = -1;  // from the replacement's start to a step at the grown world size
};

class chaos_monkey {
 public:
  // kill(id): SIGKILL to that node's process; start(): a new node, its id returned.
  struct hooks {
    std::function<std::vector<std::string>()> alive;  // ids of the node processes running
    std::function<void(const std::string&)> kill;
    std::function<std::optional<std::string>()> start;
    std::function<void(const std::string&)> say;  // one line for the user
  };
  chaos_monkey(chaos_options o, hooks h);

  // One journal line, at unix time `now` (the line's own time).
  void on(const ev::journal_event& e, double t);
  // Called often (every 100 ms) with the unix time: kills when due.
  void tick(double now);
  // The summary line ("" before any kill).
  std::string summary() const;
  const std::vector<chaos_recovery>& recoveries() const { return done_; }

 private:
  enum class phase { warming, armed, awaiting_recovery, awaiting_join, ended };
  void kill_one(double now);
  void recovered(const ev::recovery_done& e, double t);
  void report(const chaos_recovery& r);

  chaos_options opts_;
  hooks h_;
  std::mt19937_64 rng_;
  phase phase_ = phase::warming;
  double due_ = 0, kill_t_ = 0, started_t_ = 0;
  int32_t world_ = 0;
  chaos_recovery current_;
  std::vector<chaos_recovery> done_;
};

// Reads the lines a growing journal file gained since the last call (whole
// lines only; a line being written waits for the next call).
class journal_tail {
 public:
  explicit journal_tail(std::string path) : path_(std::move(path)) {}
  std::vector<ev::journal_line> read_new();

 private:
  std::string path_;
  uint64_t offset_ = 0;
  std::string partial_;
};

}  // namespace dtactor
