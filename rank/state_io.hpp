#pragma once
// The training state (training_state::state_tensors) as a checkpoint's byte
// stream (storage/checkpoint_store.hpp) and over the data plane: what a rank
// copies into its host buffer at a checkpoint step, what it loads from the
// store, and what a live peer sends a joining rank.
#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <map>
#include <vector>

#include "checkpoint.pb.h"
#include "dtactor/result.hpp"
#include "storage/checkpoint_plan.hpp"

namespace c10d {
class ProcessGroup;
}

namespace dtactor {

class shm_group;

class training_state;
class checkpoint_store;

// The stream is the logical tensors back to back (the same on every rank
// and at every world size); entries are what this rank holds of it: every
// tensor whole, and with a sharded optimizer (train.zero >= 1) only its
// windows of the optimizer's moments.
struct state_layout {
  struct tensor {
    std::string name;
    c10::ScalarType dtype = c10::kFloat;
    std::vector<int64_t> shape;
    uint64_t offset = 0, size = 0;
    bool sharded = false;
  };
  struct entry {
    std::string name;
    torch::Tensor t;  // contiguous CPU: stream[offset, offset + size)
    uint64_t offset = 0, size = 0;
    bool sharded = false;  // a window of a sharded tensor
  };
  std::vector<tensor> tensors;
  std::vector<entry> entries;  // ascending by offset; empty windows left out
  uint64_t bytes = 0;
  bool sharded() const;
  // Bytes of the entries that every rank holds whole.
  uint64_t replicated_bytes() const;
};

// The state's tensors at consecutive offsets (training_state order).
state_layout layout_of(training_state& state);

// The planners' view of this rank's stream (storage/checkpoint_plan): the
// layout's tensors, the sharded ones (ZeRO's moments, "optim/exp_avg.<g>")
// with their index base (`group_bases`: each parameter group's first
// element, flat_adamw::group_bases).
std::vector<stream_tensor> stream_tensors(const state_layout& layout, const std::vector<int64_t>& group_bases);
// The byte ranges this rank writes into a checkpoint: its local save plan
// (local_save_plan over stream_tensors). Ascending, disjoint; over all
// ranks of the world they cover the stream exactly.
// train.zero = 3: "model/<name>" of each parameter the optimizer steps,
// with its first element in the index space (empty at other levels). Its
// elements are held as shards: the primaries write them into checkpoints
// and they move with the shards, not with the replicated state.
std::map<std::string, int64_t> sharded_params(training_state& state);
// `params_sharded` (sharded_params): "model/<name>" of each parameter the
// optimizer steps, with its first element in the index space; the
// primaries of its elements write them, as the moments' (the stream is the
// same, only who writes which bytes changes).
std::vector<byte_range> save_ranges(const state_layout& layout, const rank_share& share, const std::vector<int64_t>& group_bases,
                                    const std::map<std::string, int64_t>& params_sharded = {});

// DiLoCo: the checkpoint holds, after the stream above (which is global
// rank 0's whole state), each other worker's own inner state as a section
// of its own: "workers/<r>/<name>" for ranks r = 1 .. world - 1 and every
// parameter, buffer and inner optimizer tensor (model/, buffer/, optim/
// but optim/steps). `layout` (layout_of) gains those tensors, and entries
// for this rank's section only (rank 0 has none: its state is the stream).
// The section a rank writes is section_range.
// (worker_section_prefix: storage/checkpoint_plan.hpp.)
bool worker_owned(const std::string& tensor_name);
state_layout with_worker_sections(state_layout layout, int rank, int world);
std::pair<uint64_t, uint64_t> section_range(const state_layout& with_sections, int rank);
// Where the stream proper ends in a checkpoint (the first section's offset;
// state_bytes without sections).
uint64_t stream_bytes(const pb::checkpoint_meta& meta);

// Sets meta.tensors and meta.state_bytes from the layout.
void describe_layout(const state_layout& layout, pb::checkpoint_meta& meta);

// Copies stream bytes [begin, end) into dst (end - begin bytes).
void copy_range(const state_layout& layout, uint64_t begin, uint64_t end, char* dst);

// Whether the state tensor `name` (a layout entry's, a DiLoCo worker
// section's included) stays as it is through a step's forward and backward
// and changes only in what calls training_state's before-update hook: the
// parameters (model/), the optimizer's moments (optim/exp_avg*) and
// DiLoCo's outer parameters and momentum. Everything else (a module's
// buffers, which a forward may change; the step counter, the generator,
// anchors) is not. checkpoint.direct reads the first kind live and clones
// the rest.
bool stable_until_update(const std::string& name);

// Whether a checkpoint's tensors are this state's: same names, dtypes and
// shapes in the same order. "checkpoint does not fit this model: tensor
// 'model/fc.weight' is [10, 64] in the checkpoint, [10, 32] here".
status check_fits(const state_layout& layout, const pb::checkpoint_meta& meta);

// Loads a committed checkpoint into the state (straight into its tensors,
// chunk by chunk; each part's checksum checked), reading what the load
// planner (storage/checkpoint_plan: rank_ranges, plan_load) names for this
// rank, whatever world size and ZeRO level wrote it. When it fails after
// some bytes landed, the state is reset to the initial one (never left
// torn). `which` (sharded states): `replicated` reads only the parts holding
// the replicated tensors (and sets step() and the scalars), `shards` only
// the parts overlapping this rank's windows of the sharded ones (step() is
// left alone: the replicated part came from elsewhere). At train.zero = 3
// the parameters are sharded ones: no rank reads the whole model.
// `bytes_read`: of parts.
enum class load_which { all, replicated, shards };
status load_checkpoint(training_state& state, checkpoint_store& store, const pb::checkpoint_meta& meta, load_which which = load_which::all,
                       uint64_t* bytes_read = nullptr);

// DiLoCo: loads this rank's own section of a checkpoint written with
// worker sections into its parameters, buffers and inner moments (each part
// read whole, its checksum checked). False, with nothing read, when the
// checkpoint has no section for `rank` (rank 0, a checkpoint of fewer
// workers, or checkpoint.diloco_workers = "first"). A failure after some
// bytes landed resets the state to the initial one.
result<bool> load_worker_section(training_state& state, checkpoint_store& store, const pb::checkpoint_meta& meta, int rank);

// Sends the whole state of `root` (sharded: the replicated tensors only;
// rank/zero moves the shards) to every rank of the group in place, in
// chunks of at most `chunk_bytes` (no extra copy of the state on either
// side; adjacent tensors travel together). `step` is root's step on return
// everywhere. A receiver whose transfer fails is reset to the initial state.
struct transfer_stats {
  uint64_t bytes = 0;
  double seconds = 0;
};
// `tag` travels with the header: root's value reaches every rank (the
// rank worker says whether root's state came from disk). Up to `in_flight`
// chunks are on their way at once (a group of as many streams carries
// them side by side: rank/group_builder's build_side_group). With `shm`
// (the group's ranks all on one host, in the same rank order: the
// generation's gradient segment), the chunks go through its ring instead,
// root copying each into its slot and the others out of it (the header
// still over `pg`). At train.zero = 3 the parameters the optimizer steps
// are not sent: they are held as shards and move with them (rank/zero's
// reshard), so a rank holding the agreed step keeps its own; from a root
// that read the state from a checkpoint (`tag` not 0, the replicated part
// only: load_checkpoint), each rank reads its own shards' parameters there.
result<transfer_stats> broadcast_state(c10d::ProcessGroup& pg, int root, training_state& state, std::chrono::milliseconds timeout,
                                       const std::function<bool()>& abandon, int64_t& tag, int in_flight = 1, uint64_t chunk_bytes = 64ull << 20,
                                       shm_group* shm = nullptr);

}  // namespace dtactor
