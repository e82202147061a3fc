#pragma once
// Committing a checkpoint whose parts the ranks of one generation stored:
// one code path for the coordinator's checkpoint writer
// (actors/checkpoint_writer) and `dtactor train`'s world of one
// (app/train_command). Torch-free; it blocks on the store.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "checkpoint.pb.h"
#include "dtactor/result.hpp"
#include "job/journal_events.hpp"
#include "storage/checkpoint_store.hpp"

namespace dtactor {

// What a commit wrote (the manifest, its checks, rotation).
struct saved_checkpoint {
  std::string path;
  int64_t bytes = 0;
  double duration_s = 0;      // the commit (manifest, checks, rotation)
  std::vector<int64_t> kept;  // steps of the checkpoints left in the store after rotation (empty: not known)
};
// Writes the manifest `meta` (every part, generation set) to a store.
// May block.
using commit_fn = std::function<result<saved_checkpoint>(pb::checkpoint_meta)>;

// checkpoint_store::commit, timed. `store` must outlive the function.
commit_fn commit_to(checkpoint_store& store);

// What the ranks of one generation reported they stored for one step.
struct written_parts {
  uint64_t generation = 0;
  int32_t world = 0;
  std::map<int32_t, std::vector<pb::checkpoint_part>> parts;  // by global rank: each rank's, one or several ranges
  std::string meta;                                           // rank 0's
  double stall_s = 0, write_s = 0;                            // the slowest rank's
  int32_t direct = 0;                                         // ranks that wrote from the state (checkpoint.direct)
  int64_t due_step = 0;                                       // deferred (checkpoint.defer_while_writing): the step it fell due at (0: when due)
};

struct committed_step {
  ev::checkpoint_saved saved;  // to journal (generation set)
  std::vector<int64_t> kept;   // what rotation left in the store (saved_checkpoint::kept)
};

// Plans the manifest of `step` from every rank's parts (plan_manifest: the
// parts must cover the state stream exactly) and commits it through
// `commit`. The error is the bare reason (the plan's or the commit's); the
// caller says which step was not saved. `parts` complete: one entry per
// rank of `parts.world`, rank 0's meta among them.
result<committed_step> commit_checkpoint(int64_t step, const written_parts& parts, const commit_fn& commit);

}  // namespace dtactor
