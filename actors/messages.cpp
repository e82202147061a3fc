#include "actors/messages.hpp"

namespace dtactor {

pb::envelope make_envelope(const envelope_header& h, uint64_t generation) {
  pb::envelope env;
  env.set_protocol_version(h.protocol_version);
  env.set_job_id(h.job_id);
  env.set_sender(h.sender);
  env.set_incarnation(h.incarnation);
  env.set_generation(generation);
  return env;
}

std::string body_name(const pb::envelope& env) {
  if (env.body_case() == pb::envelope::BODY_NOT_SET) return "(empty)";
  const auto* field = pb::envelope::descriptor()->FindFieldByNumber(static_cast<int>(env.body_case()));
  return field ? field->name() : "(unknown body " + std::to_string(static_cast<int>(env.body_case())) + ")";
}

void add_message_types(caf::actor_system_config& cfg) {
  cfg.add_message_type<inbound>("dtactor::inbound");
  cfg.add_message_type<plan>("dtactor::plan");
  cfg.add_message_type<plan_node>("dtactor::plan_node");
  cfg.add_message_type<rank_slot>("dtactor::rank_slot");
  cfg.add_message_type<std::vector<plan_node>>("std::vector<dtactor::plan_node>");
  cfg.add_message_type<std::vector<rank_slot>>("std::vector<dtactor::rank_slot>");
}

}  // namespace dtactor
