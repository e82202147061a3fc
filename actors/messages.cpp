#include "actors/messages.hpp"

#include "actors/membership_handle.hpp"

namespace dtactor {

void add_message_types(caf::actor_system_config& cfg) {
  cfg.add_message_type<inbound>("dtactor::inbound");
  cfg.add_message_type<plan>("dtactor::plan");
  cfg.add_message_type<plan_node>("dtactor::plan_node");
  cfg.add_message_type<rank_slot>("dtactor::rank_slot");
  cfg.add_message_type<std::vector<plan_node>>("std::vector<dtactor::plan_node>");
  cfg.add_message_type<std::vector<rank_slot>>("std::vector<dtactor::rank_slot>");
  cfg.add_message_type<std::vector<int64_t>>("std::vector<int64_t>");
  cfg.add_message_type<membership_handle>("dtactor::membership_handle");  // in (members_atom, membership)
}

}  // namespace dtactor
