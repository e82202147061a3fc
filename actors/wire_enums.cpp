#include "actors/wire_enums.hpp"

namespace dtactor {

namespace {
using rs = pb::rank_status;
using gp = pb::generation_plan;
using ev::plan_cause;

// plan_cause's values are the wire's (one cast each way), pinned here.
static_assert(static_cast<int>(plan_cause::none) == gp::CAUSE_UNSPECIFIED);
static_assert(static_cast<int>(plan_cause::node_lost) == gp::CAUSE_NODE_LOST);
static_assert(static_cast<int>(plan_cause::rank_exited) == gp::CAUSE_RANK_EXITED);
static_assert(static_cast<int>(plan_cause::collective_failure) == gp::CAUSE_COLLECTIVE_FAILURE);
static_assert(static_cast<int>(plan_cause::node_left) == gp::CAUSE_NODE_LEFT);
static_assert(static_cast<int>(plan_cause::node_joined) == gp::CAUSE_NODE_JOINED);
static_assert(static_cast<int>(plan_cause::rank_ready) == gp::CAUSE_RANK_READY);
static_assert(static_cast<int>(plan_cause::start) == gp::CAUSE_START);
static_assert(static_cast<int>(plan_cause::restart) == gp::CAUSE_RESTART);
static_assert(static_cast<int>(plan_cause::adopted) == gp::CAUSE_ADOPTED);
static_assert(gp::generation_cause_MAX == gp::CAUSE_ADOPTED, "a cause was added to the wire: add it to plan_cause");
}  // namespace

rs::state_origin to_wire(ev::state_source s) {
  switch (s) {
    case ev::state_source::local: return rs::ORIGIN_LOCAL;
    case ev::state_source::peer: return rs::ORIGIN_PEER;
    case ev::state_source::disk: return rs::ORIGIN_DISK;
    case ev::state_source::fresh: return rs::ORIGIN_FRESH;
  }
  return rs::ORIGIN_UNSPECIFIED;
}

std::optional<ev::state_source> from_wire(rs::state_origin s) {
  switch (s) {
    case rs::ORIGIN_LOCAL: return ev::state_source::local;
    case rs::ORIGIN_PEER: return ev::state_source::peer;
    case rs::ORIGIN_DISK: return ev::state_source::disk;
    case rs::ORIGIN_FRESH: return ev::state_source::fresh;
    default: return std::nullopt;
  }
}

rs::shards_origin to_wire(ev::optimizer_source s) {
  switch (s) {
    case ev::optimizer_source::own: return rs::SHARDS_OWN;
    case ev::optimizer_source::replica: return rs::SHARDS_REPLICA;
    case ev::optimizer_source::checkpoint: return rs::SHARDS_CHECKPOINT;
    case ev::optimizer_source::restart: return rs::SHARDS_RESTART;
  }
  return rs::SHARDS_UNSPECIFIED;
}

std::optional<ev::optimizer_source> from_wire(rs::shards_origin s) {
  switch (s) {
    case rs::SHARDS_OWN: return ev::optimizer_source::own;
    case rs::SHARDS_REPLICA: return ev::optimizer_source::replica;
    case rs::SHARDS_CHECKPOINT: return ev::optimizer_source::checkpoint;
    case rs::SHARDS_RESTART: return ev::optimizer_source::restart;
    default: return std::nullopt;
  }
}

gp::generation_cause to_wire(ev::plan_cause c) { return static_cast<gp::generation_cause>(c); }

ev::plan_cause from_wire(gp::generation_cause c) {
  const int v = static_cast<int>(c);
  return v >= 0 && v <= static_cast<int>(ev::plan_cause::adopted) ? static_cast<ev::plan_cause>(v) : ev::plan_cause::none;
}

}  // namespace dtactor
