#pragma once
// The global save plan: a checkpoint's manifest from what its ranks stored
// (each rank's local plan: storage/checkpoint_plan.hpp). Torch-free and
// store-free, so the coordinator's committer (actors/), `dtactor train` and
// the tests build manifests through this one function.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "checkpoint.pb.h"
#include "dtactor/result.hpp"

namespace dtactor {

// The one planner of a checkpoint's manifest (the coordinator's committer,
// `dtactor train`, the tests): rank 0's meta (the state's header and
// tensors, `meta_bytes` as the rank sent it) with every rank's parts, by
// global rank, one or several ranges each (ZeRO's scattered shards), put in
// stream order. They must tile the state's bytes exactly once, or a resume
// would read a torn state: a gap, an overlap or a short cover is one line
// naming the bytes. Generation and world size are set from the arguments.
result<pb::checkpoint_meta> plan_manifest(const std::string& meta_bytes, uint64_t generation, int32_t world,
                                          const std::map<int32_t, std::vector<pb::checkpoint_part>>& parts);
}  // namespace dtactor
