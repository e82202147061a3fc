#pragma once
// A generation's c10d group (and, with cluster.shm_allreduce, its
// shared-memory exchange plan), built through the coordinator's rendezvous
// store on a helper thread, so that a newer plan (or quit) abandons a
// rendezvous that waits for a member who will never come.
#include <memory>
#include <string>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "dtactor/result.hpp"
#include "rank/outcome.hpp"

namespace dtactor {

class shm_group;
class local_peers;

struct job_key;
struct generation_run;
struct rank_state;

// Where this rank reaches the store and how the others reach it.
struct group_endpoint {
  std::string advertise_addr;          // this machine's address for the collectives ("": 127.0.0.1)
  std::string default_store_host;      // when the plan names no store host
  std::shared_ptr<const job_key> key;  // the store is CURVE
};

// Nothing once g.pg (and g.exchange, g.backend) is built, the groups parked
// in rs; else the outcome that ends the generation.
generation_end build_group(generation_run& g, rank_state& rs, const group_endpoint& at);

// Another group of the generation's members, with `streams` connections to
// each peer, under its own `name` in the store (every member must build it):
// what a bulk transfer uses beside the generation's group. Parked in rs as
// that one is. Blocks until built, a newer plan or quit (an error then).
result<c10::intrusive_ptr<c10d::ProcessGroup>> build_side_group(generation_run& g, rank_state& rs, const std::string& name, int streams);

// The group a state transfer of this generation goes over, built by every
// member when the generation's first transfer begins (and kept for its
// others): over Gloo a side group of
// state_transfer_streams connections to each peer (one TCP stream is
// bounded by one socket's copy loop; bench/bench_state_path.py measures
// the rate), else the generation's own group.
inline constexpr int state_transfer_streams = 2;
result<c10::intrusive_ptr<c10d::ProcessGroup>> transfer_group(generation_run& g, rank_state& rs);
// When every rank of the generation is on this host and shares its
// gradient segment (cluster.shm_allreduce): that segment, which a state
// transfer's chunks go through (memory copies instead of loopback TCP);
// else null.
shm_group* transfer_shm(const generation_run& g);

// Which ranks of the generation read each other's memory (comm/peer_moves:
// the ranks of one host, where the kernel lets them): agreed over the
// generation's group the first time it is asked, which every member must
// do at the same point; then kept for the generation. Null alone.
result<const local_peers*> local_peers_of(generation_run& g);

}  // namespace dtactor
