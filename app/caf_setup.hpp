#pragma once
// CAF settings of every dtactor process. The default work-stealing scheduler
// polls for work with short sleeps; with several dtactor processes on a
// machine that polling took ~20% of a core per process away from training.
// The work-sharing scheduler blocks on a condition variable instead, and
// control traffic is light enough that one queue never limits it.
#include <caf/actor_system_config.hpp>
#include <caf/atom.hpp>

#include "actors/messages.hpp"

namespace dtactor {

inline void configure_caf(caf::actor_system_config& cfg, size_t threads) {
  add_message_types(cfg);
  cfg.set("scheduler.policy", caf::atom("sharing"));
  cfg.set("scheduler.max-threads", threads);
}

}  // namespace dtactor
