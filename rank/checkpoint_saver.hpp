#pragma once
// The writing side of a rank's checkpoints: which bytes of the state this
// rank stores (the save planner's ranges), whether they go through a host
// buffer or straight from the state (checkpoint.direct), and the part
// writer that stores them in the background (rank/part_writer). No LibTorch
// in this header.
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "job/modes.hpp"
#include "rank/part_writer.hpp"

namespace dtactor {

class training_state;
struct shard_plan;
struct generation_run;
class sync_strategy;

struct checkpoint_saver_options {
  std::string node_id;
  std::string s3_endpoint;  // checkpoint.s3_endpoint
  bool keep_buffer = true;  // checkpoint.keep_buffer
  job_modes modes;          // checkpoint.direct, checkpoint.diloco_workers
  const sync_strategy* sync = nullptr;  // train.sync's: its sections of a checkpoint; outlives the saver
  int local_world = 1;      // ranks of this node (each may want a buffer)
  part_writer::done_fn on_written;
};

class checkpoint_saver {
 public:
  explicit checkpoint_saver(checkpoint_saver_options o);
  ~checkpoint_saver();  // finishes the write in flight
  checkpoint_saver(const checkpoint_saver&) = delete;
  checkpoint_saver& operator=(const checkpoint_saver&) = delete;

  // The host buffer of this rank's part, made ahead of the first checkpoint
  // (checkpoint.direct = false and checkpoint.keep_buffer; else made at a
  // checkpoint that uses it). Nothing when the plan names no store.
  void prepare(training_state& state, const std::optional<shard_plan>& shards, const generation_run& g);
  // After the generation's first step (its peak memory now known):
  // checkpoint.direct = auto makes the buffer in the background there when
  // it fits, so that the first checkpoint is a copy into touched pages (or,
  // still being made when a checkpoint falls due, defers it:
  // checkpoint.defer_while_writing), not page faults in the stall.
  void after_first_step(training_state& state, const std::optional<shard_plan>& shards, const generation_run& g);
  // This rank's part of a checkpoint of the current step: copied at once,
  // stored in the background. Nothing when the plan names no store.
  // `due_step`: deferred (checkpoint.defer_while_writing), the step it fell due at.
  void write(training_state& state, const std::optional<shard_plan>& shards, const generation_run& g,
             const std::map<std::string, double>& eval_at_step, int64_t due_step = 0);
  // Every part handed to the writer is stored (before STATE_FINISHED).
  void finish();
  // No direct write reads the state any more (before anything else touches
  // it: the next generation's reshard or load, the caller after quit). A
  // buffered write goes on storing its own copy meanwhile.
  void release_state();
  // Bytes of host buffer held; nothing before the first checkpoint.
  std::optional<uint64_t> buffer_bytes();
  // A part is still being stored (or the buffer is being made), or the
  // buffer is still to be made after the generation's first step: a write
  // now would stall on it (checkpoint.defer_while_writing defers it).
  bool writing();

 private:
  void ensure_writer();
  bool direct(const generation_run& g, uint64_t bytes, int64_t step);
  int host_ranks(const generation_run& g) const;

  checkpoint_saver_options o_;
  std::unique_ptr<part_writer> writer_;  // made at the first checkpoint
  std::optional<bool> wrote_direct_;     // how the last part was written (checkpoint.direct = auto says when it changes)
  bool prepare_after_step_ = false;      // checkpoint.direct = auto: the buffer is weighed after the first step
  bool buffer_owed_ = false;             // ... and the one held now is too small for this generation's part
};

}  // namespace dtactor
