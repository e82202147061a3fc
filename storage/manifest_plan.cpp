#include "storage/manifest_plan.hpp"

#include <algorithm>
#include <limits>

namespace dtactor {

result<pb::checkpoint_meta> plan_manifest(const std::string& meta_bytes, uint64_t generation, int32_t world,
                                          const std::map<int32_t, std::vector<pb::checkpoint_part>>& parts) {
  pb::checkpoint_meta meta;
  if (!meta.ParseFromString(meta_bytes)) return make_error("rank 0's manifest does not parse");
  meta.set_generation(generation);
  meta.set_world_size(world);
  meta.clear_parts();
  std::vector<const pb::checkpoint_part*> all;
  for (const auto& [rank, ps] : parts)
    for (const auto& part : ps) all.push_back(&part);
  std::stable_sort(all.begin(), all.end(), [](const pb::checkpoint_part* a, const pb::checkpoint_part* b) {
    return a->offset() != b->offset() ? a->offset() < b->offset() : a->size() < b->size();
  });
  auto gap = [](uint64_t a, uint64_t b) { return "no rank stored bytes [" + std::to_string(a) + ", " + std::to_string(b) + ") of the state"; };
  uint64_t bytes = 0;  // covered so far
  for (const auto* part : all) {
    const std::string who = "part '" + part->name() + "' of rank " + std::to_string(part->rank());
    if (part->size() > std::numeric_limits<uint64_t>::max() - part->offset()) return make_error(who + " has an impossible size");
    if (part->offset() > bytes) return make_error(gap(bytes, part->offset()));
    if (part->offset() < bytes)
      return make_error(who + " overlaps bytes [" + std::to_string(part->offset()) + ", " +
                        std::to_string(std::min(bytes, part->offset() + part->size())) + ") of another part");
    *meta.add_parts() = *part;
    bytes = part->offset() + part->size();
  }
  if (bytes < meta.state_bytes()) return make_error(gap(bytes, meta.state_bytes()));
  if (bytes > meta.state_bytes())
    return make_error("the parts cover " + std::to_string(bytes) + " bytes of a " + std::to_string(meta.state_bytes()) + "-byte state");
  return meta;
}

}  // namespace dtactor
