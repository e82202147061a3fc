#include "net/plan_layout.hpp"

#include <algorithm>

namespace dtactor {

void add_node_ranks(pb::generation_plan& plan, int32_t ranks) {
  auto& runs = *plan.mutable_node_rank_runs();
  const int n = runs.size();
  if (n >= 2 && runs[n - 1] == ranks) {
    ++runs[n - 2];
    return;
  }
  runs.Add(1);
  runs.Add(ranks);
}

std::vector<int32_t> node_rank_counts(const pb::generation_plan& plan, int64_t world) {
  const auto& runs = plan.node_rank_runs();
  std::vector<int32_t> out;
  if (runs.size() % 2 != 0) return out;
  int64_t placed = 0;
  for (int k = 0; k + 1 < runs.size() && placed < world; k += 2) {
    if (runs[k] < 0 || runs[k + 1] < 0) return {};
    // A run of nodes holding no rank places none: at most `world` of them.
    const int64_t nodes = runs[k + 1] > 0 ? std::min<int64_t>(runs[k], (world - placed + runs[k + 1] - 1) / runs[k + 1]) : std::min<int64_t>(runs[k], world);
    out.insert(out.end(), static_cast<size_t>(nodes), runs[k + 1]);
    placed += nodes * runs[k + 1];
  }
  return out;
}

}  // namespace dtactor
