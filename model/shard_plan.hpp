#pragma once
// Who holds which part of the sharded training state (train.zero >= 1): the
// optimizer's state of all parameter groups, concatenated in group order, is
// one index space [0, total) split into `world` contiguous shards; shard s
// has rank s as its primary (it writes the shard into checkpoints and sends
// its updated parameters to the others) and replicas on other ranks that
// keep a copy current by applying the same update to the same summed
// gradient, so that a lost rank or machine loses no optimizer state.
//
// A replica goes to a rank on a node holding no copy of the shard yet (else
// on another node than the primary's; on the same node only when there is
// no other), the one holding the fewest shards so far, the nearest after
// the primary on a tie: with equal nodes every rank holds `replicas` shards,
// and with at least R nodes a shard's R holders are on R nodes.
// The plan is a pure
// function of (total, nodes of the ranks, replicas): every rank computes the
// same plan without a message.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace dtactor {

struct shard_plan {
  struct shard {
    int64_t begin = 0, end = 0;  // elements [begin, end) of the index space
    std::vector<int> holders;    // holders[0] is the primary; no rank twice
  };
  int64_t total = 0;
  std::vector<shard> shards;  // one per rank, in rank order; shard s's primary is rank s

  int world() const { return static_cast<int>(shards.size()); }
  // Shards `rank` holds (as primary or replica), ascending.
  std::vector<int> held_by(int rank) const;
  // Their element ranges, ascending, adjacent ones merged.
  std::vector<std::pair<int64_t, int64_t>> ranges_of(int rank) const;
  // Elements `rank` holds.
  int64_t held_elements(int rank) const;
  // The largest shard (the all-gather's per-rank block).
  int64_t largest() const;
};

// node_of_rank[r]: the node (machine) of global rank r. replicas: holders of
// each shard (1 = no copy; clamped to the world size). Shard boundaries are
// multiples of the gradient norm's chunk (model/grad_norm: norm_chunk(total),
// a multiple of 64 elements), so that a rank holding shards computes whole
// ranges of the norm.
shard_plan make_shard_plan(int64_t total, const std::vector<std::string>& node_of_rank, int replicas);

// train.zero_replicas' default: 2 when the job spans more than one node, else 1.
int default_replicas(const std::vector<std::string>& node_of_rank);

}  // namespace dtactor
