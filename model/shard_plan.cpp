#include "model/shard_plan.hpp"

#include <algorithm>
#include <set>

#include "model/grad_norm.hpp"

namespace dtactor {

std::vector<int> shard_plan::held_by(int rank) const {
  std::vector<int> out;
  for (size_t s = 0; s < shards.size(); ++s)
    if (std::find(shards[s].holders.begin(), shards[s].holders.end(), rank) != shards[s].holders.end()) out.push_back(static_cast<int>(s));
  return out;
}

std::vector<std::pair<int64_t, int64_t>> shard_plan::ranges_of(int rank) const {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int s : held_by(rank)) {
    const auto& sh = shards[static_cast<size_t>(s)];
    if (sh.begin == sh.end) continue;
    if (!out.empty() && out.back().second == sh.begin)
      out.back().second = sh.end;
    else
      out.emplace_back(sh.begin, sh.end);
  }
  return out;
}

int64_t shard_plan::held_elements(int rank) const {
  int64_t n = 0;
  for (const auto& [a, b] : ranges_of(rank)) n += b - a;
  return n;
}

int64_t shard_plan::largest() const {
  int64_t n = 0;
  for (const auto& s : shards) n = std::max(n, s.end - s.begin);
  return n;
}

shard_plan make_shard_plan(int64_t total, const std::vector<std::string>& node_of_rank, int replicas) {
  shard_plan p;
  p.total = total;
  const int world = static_cast<int>(node_of_rank.size());
  if (world == 0) return p;
  const int64_t align = norm_chunk(total);
  replicas = std::clamp(replicas, 1, world);
  // Equal shards rounded up to `align`; the last ones may be shorter or empty.
  const int64_t per = ((total + world - 1) / world + align - 1) / align * align;
  std::vector<int> load(static_cast<size_t>(world), 1);  // shards each rank holds so far
  for (int s = 0; s < world; ++s) {
    shard_plan::shard sh;
    sh.begin = std::min(total, per * s);
    sh.end = std::min(total, per * (s + 1));
    sh.holders.push_back(s);
    // Each replica: a rank on a node that holds no copy of the shard yet
    // when there is one (R holders on R nodes: any R - 1 lost machines leave
    // a copy), else on another node than the primary's, else on the same
    // node; among those, the one holding the fewest shards so far, the
    // nearest after the primary on a tie (so that every rank holds about
    // `replicas` shards).
    while (static_cast<int>(sh.holders.size()) < replicas) {
      int best = -1;
      for (int pass = 0; pass < 3 && best < 0; ++pass)
        for (int k = 1; k < world; ++k) {
          const int r = (s + k) % world;
          const auto& node = node_of_rank[static_cast<size_t>(r)];
          const bool other_node = node != node_of_rank[static_cast<size_t>(s)];
          bool new_node = true;
          for (int h : sh.holders) new_node = new_node && node != node_of_rank[static_cast<size_t>(h)];
          if (pass == 0 && !new_node) continue;
          if (pass == 1 && !other_node) continue;
          if (pass == 2 && other_node) continue;
          if (std::find(sh.holders.begin(), sh.holders.end(), r) != sh.holders.end()) continue;
          if (best < 0 || load[static_cast<size_t>(r)] < load[static_cast<size_t>(best)]) best = r;
        }
      if (best < 0) break;
      sh.holders.push_back(best);
      ++load[static_cast<size_t>(best)];
    }
    p.shards.push_back(std::move(sh));
  }
  return p;
}

int default_replicas(const std::vector<std::string>& node_of_rank) {
  std::set<std::string> nodes(node_of_rank.begin(), node_of_rank.end());
  return nodes.size() > 1 ? 2 : 1;
}

}  // namespace dtactor
