// Builders the membership tests share (tests/membership_test.cpp,
// tests/membership_restart_test.cpp): registrations, options, a trained plan.
#pragma once

#include "actors/membership.hpp"

#include <chrono>
#include <string>
#include <vector>

namespace dtactor::membership_test {

using namespace std::chrono_literals;

inline clock_time t0() { return clock_time{} + 1h; }

inline std::vector<int32_t> all_ranks(int32_t nproc) {
  std::vector<int32_t> out;
  for (int32_t l = 0; l < nproc; ++l) out.push_back(l);
  return out;
}

// A node whose ranks are all up (ready_ranks lists them).
inline node_registration reg(const std::string& id, int32_t nproc = 2, uint64_t incarnation = 1) {
  return node_registration{node_id{id}, id + ".local", nproc, incarnation, "peer-" + id, all_ranks(nproc), 0, std::nullopt};
}

// A node whose rank processes are still starting.
inline node_registration cold(const std::string& id, int32_t nproc = 2, uint64_t incarnation = 1) {
  auto r = reg(id, nproc, incarnation);
  r.ready_ranks.clear();
  return r;
}

// Commits the plan and has every rank of it report READY in its generation
// (each then holds the generation's state), as a generation that trained.
inline const plan& trained(membership& m, plan p) {
  const auto& c = m.commit(std::move(p));
  for (const auto& r : c.ranks)
    if (const auto* n = m.find(r.node_id)) m.note_synced(r.node_id, n->incarnation, r.local_rank, c.generation);
  return c;
}

inline membership_options opts(int32_t min_nodes, int32_t max_nodes = 64) {
  membership_options o;
  o.min_nodes = min_nodes;
  o.max_nodes = max_nodes;
  return o;
}

}  // namespace dtactor::membership_test
