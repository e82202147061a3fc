#pragma once
// A generation plan's layout (generation_plan.node_rank_runs): how many
// ranks each node holds, in global rank order, as runs of nodes holding the
// same number. Every node gets the layout with its plan, so a count per node
// would grow the bytes sent to all with the square of the nodes (10,000
// nodes: 100 MB a plan); a job whose nodes all hold the same number of
// ranks has one run.
#include <cstdint>
#include <vector>

#include "wire.pb.h"

namespace dtactor {

// Appends the next node's rank count to the plan's layout (joining the last
// run when it holds as many).
void add_node_ranks(pb::generation_plan& plan, int32_t ranks);
// Each node's rank count, in order: the runs expanded until they place
// `world` ranks (a plan that claims more nodes than that is cut there; a
// run of nodes holding none gives at most `world` of them), none for a
// malformed run (a negative count, an odd length).
std::vector<int32_t> node_rank_counts(const pb::generation_plan& plan, int64_t world);

}  // namespace dtactor
