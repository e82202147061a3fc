#pragma once
// The journal's enums (job/journal_events.hpp) on the wire: one mapping
// each way, so neither side matches text. A value this build does not know
// (a newer peer's) reads as nullopt / plan_cause::none.
#include <optional>

#include "job/journal_events.hpp"
#include "wire.pb.h"

namespace dtactor {

pb::rank_status::state_origin to_wire(ev::state_source s);
std::optional<ev::state_source> from_wire(pb::rank_status::state_origin s);

pb::rank_status::shards_origin to_wire(ev::optimizer_source s);
std::optional<ev::optimizer_source> from_wire(pb::rank_status::shards_origin s);

pb::generation_plan::generation_cause to_wire(ev::plan_cause c);
ev::plan_cause from_wire(pb::generation_plan::generation_cause c);

}  // namespace dtactor
