#pragma once
// data.sample_log (docs/data.md, "Auditing the order"): a record, from the
// processes that trained, of which sample indices every completed step
// trained on, so that exactly-once per epoch can be checked from outside
// (bench/check_sample_log.py) through kills, joins and resumes.
//
// Each training process appends to a file of its own,
// `<dir>/samples-<who>-<pid>.tsv` (`...-<pid>.<n>.tsv` when an earlier
// process with that pid left one), one line per step whose optimizer update
// it applied:
//
//   step \t generation \t global rank \t world size \t i0,i1,...\n
//
// the indices being those it passed to the task's loss_sum for that step,
// micro-batches in order. With train.sync = diloco, a rank also writes,
// when an outer step whose pseudo-gradient was taken at step b lands,
//
//   b \t generation \t global rank \t world size \t synced\n          (one fragment)
//   b \t generation \t global rank \t world size \t synced f/F\n      (streaming: fragment f of F)
//
// saying that its lines of steps before b are in (that fragment of) the
// global parameters; a worker's lines that no such line covers went with it
// when it was lost (the checker's --diloco mode). A lost worker's slice that
// a survivor trains again for some fragments only (those that had not
// taken it yet) carries a sixth field: `\tfragments 0,2`. Each line is one write(2) on an O_APPEND
// descriptor: once append() returns, the line survives the process being
// killed (not a machine crash: nothing is fsynced). Torch-free.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dtactor/result.hpp"

namespace dtactor {

class sample_log {
 public:
  // Creates `dir` if needed and opens this process's file in it. `who` names
  // the process in the file name (a node id and local rank, a host name);
  // characters other than [A-Za-z0-9._-] become '_'.
  static result<std::unique_ptr<sample_log>> open(const std::string& dir, const std::string& who);
  ~sample_log();
  sample_log(const sample_log&) = delete;
  sample_log& operator=(const sample_log&) = delete;

  // One line, one write(2). Error: "data.sample_log: cannot append to
  // '/x/samples-a-r0-123.tsv': No space left on device".
  // `fragments`: the sixth field above (null: none).
  status append(int64_t step, uint64_t generation, int global_rank, int world_size, const std::vector<int64_t>& samples,
                const std::vector<int>* fragments = nullptr);
  // DiLoCo: an outer step whose pseudo-gradient was taken at `step` landed
  // on this rank (the "synced" line above); fragment -1: not streaming.
  status append_synced(int64_t step, uint64_t generation, int global_rank, int world_size, int fragment = -1, int fragments = 1);
  const std::string& path() const { return path_; }

  // The line append() writes (tests, the checker's fixtures).
  static std::string format_line(int64_t step, uint64_t generation, int global_rank, int world_size, const std::vector<int64_t>& samples,
                                 const std::vector<int>* fragments = nullptr);
  static std::string format_synced_line(int64_t step, uint64_t generation, int global_rank, int world_size, int fragment = -1, int fragments = 1);

 private:
  sample_log(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  status write_line(const std::string& line);
  int fd_ = -1;
  std::string path_;
};

// The newest generation any file of `dir` records (0: none, or no such
// directory). Reads the last whole line of each samples-*.tsv only: a
// process logs its generations in increasing order. A coordinator (and
// `dtactor train`) numbers its generations above it, so that a resumed
// job's records of a step it redoes supersede the earlier run's.
result<uint64_t> newest_logged_generation(const std::string& dir);

// The startup check of data.sample_log (empty: off, always fine): the
// directory exists or can be made, and can be written. Error, one line:
// "data.sample_log: directory '/x' is not writable: Not a directory (set it
// to a directory this user can write, or leave it empty: no audit log)".
status check_sample_log_dir(const std::string& dir);

}  // namespace dtactor
