#pragma once
// A generation's c10d group (and, with cluster.shm_allreduce, its
// shared-memory exchange plan), built through the coordinator's rendezvous
// store on a helper thread, so that a newer plan (or quit) abandons a
// rendezvous that waits for a member who will never come.
#include <memory>
#include <string>

#include "rank/outcome.hpp"

namespace dtactor {

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

}  // namespace dtactor
