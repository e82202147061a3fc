#include "net/plan_layout.hpp"

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

std::vector<int32_t> node_rank_counts(const pb::generation_plan& plan, int64_t max_nodes) {
  const auto& runs = plan.node_rank_runs();
  std::vector<int32_t> out;
  if (runs.size() % 2 != 0) return out;
  for (int k = 0; k + 1 < runs.size(); k += 2) {
    if (runs[k] < 0 || runs[k + 1] < 0) return {};
    for (int32_t i = 0; i < runs[k] && static_cast<int64_t>(out.size()) < max_nodes; ++i) out.push_back(runs[k + 1]);
  }
  return out;
}

}  // namespace dtactor
