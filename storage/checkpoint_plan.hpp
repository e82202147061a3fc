#pragma once
// The save and load planners of a checkpoint, in PyTorch DCP's shape: each
// rank describes what it holds, one planner decides. Torch-free and
// store-free: the ranks (rank/state_io), the coordinator's committer
// (actors/), `dtactor train` and the tests plan through these functions.
//
// The state is one byte stream, its tensors back to back, stored as parts
// (storage/checkpoint_store.hpp).
// - A rank describes the stream (stream_of: the manifest's tensors, with
//   what only the ranks know: which tensors are sharded by element across
//   the ranks, ZeRO, and where each starts in the shards' index space) and
//   its place in the world (rank_share).
// - rank_ranges is the one function that decides which bytes of the stream
//   a rank writes (stream_scope::owned) and which it loads (the others), for
//   any world size and ZeRO level. Its balanced split of the bytes every
//   rank holds is part_range.
// - Save: local_save_plan is a rank's local plan (its owned ranges, each
//   stored as a part); plan_manifest (storage/manifest_plan.hpp) is the
//   global plan: every rank's stored parts merged into the manifest, checked
//   to tile the stream exactly once.
// - Load: plan_load turns the ranges a rank needs into the parts it reads
//   (each whole, so that its checksum is checked) and the bytes of each it
//   keeps, from a manifest written by any number of ranks: resharding is the
//   planner's, not the caller's.
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint.pb.h"
#include "dtactor/result.hpp"

namespace dtactor {

using byte_range = std::pair<uint64_t, uint64_t>;  // stream bytes [first, second)
using index_range = std::pair<int64_t, int64_t>;   // shard index-space elements [first, second)

// Bytes [first, second) of an n-byte stream that part `rank` of `world` holds
// (balanced; every part but possibly the last is a multiple of 4096 bytes).
byte_range part_range(uint64_t n, int rank, int world);

// DiLoCo: the tensors of worker r's own inner state follow the stream proper
// as "workers/<r>/<tensor>" (rank/state_io's with_worker_sections).
inline constexpr const char* worker_section_prefix = "workers/";

// One tensor of the stream as a rank sees it.
struct stream_tensor {
  std::string name;
  uint64_t offset = 0, size = 0;  // stream bytes [offset, offset + size)
  uint64_t element_bytes = 1;
  bool sharded = false;    // ZeRO: its elements are split across the ranks by index range
  int64_t index_base = 0;  // sharded: the index-space element of its element 0
  int worker = -1;         // DiLoCo: the worker whose own section holds it; -1: the stream proper
};

// The manifest's tensors, in stream order. `sharded` maps each tensor the
// ranks shard to its index base (a rank knows; the manifest does not say);
// the others are held whole.
std::vector<stream_tensor> stream_of(const pb::checkpoint_meta& meta, const std::map<std::string, int64_t>& sharded = {});

// A rank's place in the world.
struct rank_share {
  int rank = 0, world = 1;
  // ZeRO: index ranges of the shards it is the primary of (it writes them;
  // over the world they tile the index space) and of those it holds, as
  // primary or replica (it loads them). Empty when nothing is sharded.
  std::vector<index_range> primary, held;
  // DiLoCo: every worker holds a whole state of its own. Worker 0 owns the
  // stream proper, worker r > 0 its own section (none: nothing).
  bool per_worker = false;
};

enum class stream_scope {
  owned,        // what it writes at a save: its balanced share (part_range) of the bytes held
                // whole and its windows of the shards it is the primary of (per_worker: above)
  whole,        // its whole state: the stream proper's tensors held whole, its windows of held shards
  replicated,   // the stream proper's tensors that every rank holds whole
  shards,       // its windows of the sharded tensors (`held`)
  own_section,  // DiLoCo: its own section (none for worker 0, or in a checkpoint of fewer workers)
};

// The one function deciding a rank's bytes of the stream: ascending,
// disjoint, adjacent ones merged, empty ones left out. `owned` over every
// rank of the world tiles the stream exactly once when the primaries tile
// the index space.
std::vector<byte_range> rank_ranges(const std::vector<stream_tensor>& tensors, const rank_share& share, stream_scope scope);

// A rank's local save plan: its owned ranges, each stored as a part of its
// own. A rank that owns no byte (a stream smaller than the world's shares;
// DiLoCo without sections) stores one empty part at the stream's end, so
// that its report names a part.
std::vector<byte_range> local_save_plan(const std::vector<stream_tensor>& tensors, const rank_share& share);

// What a rank reads of a checkpoint.
struct load_plan {
  struct read {
    int part = 0;                  // index into meta.parts()
    std::vector<byte_range> keep;  // its stream bytes the rank needs, ascending
  };
  std::vector<read> reads;  // ascending by offset; parts holding none of the bytes are not read
  uint64_t read_bytes = 0;  // of the parts read
  uint64_t kept_bytes = 0;  // of the ranges needed
};
// The parts of `meta` (its parts ascending and tiling the stream, as
// check_manifest has it) that hold bytes of `needed` (rank_ranges). An
// error names bytes outside the stream or in no part.
result<load_plan> plan_load(const pb::checkpoint_meta& meta, const std::vector<byte_range>& needed);

}  // namespace dtactor
