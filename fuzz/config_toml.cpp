// The job's TOML config (base/config.hpp): read from --config files, and
// by every node and rank from the coordinator's register_ack and generation
// plans (config_toml). Properties: parse_toml never crashes; a config it
// accepts prints (to_toml, what the coordinator sends) as TOML that parses
// back to the same values; the checks the coordinator runs before it starts
// (training keys, liveness, membership) and the timers a node derives from a
// received config never overflow.
#include <chrono>

#include "actors/liveness.hpp"
#include "actors/membership.hpp"
#include "fuzz/fuzz_util.hpp"
#include "dtactor/config.hpp"
#include "job/job_config.hpp"

using namespace dtactor;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto cfg = config::parse_toml(text, "fuzz.toml");
  if (!cfg) {
    if (cfg.message().empty()) fuzz::fail("a refused config without a reason");
    return 0;
  }
  const std::string printed = cfg->to_toml();
  auto again = config::parse_toml(printed, "printed");
  if (!again) fuzz::fail("to_toml wrote a config parse_toml refuses");
  if (again->digest({}) != cfg->digest({})) fuzz::fail("to_toml does not round-trip");
  (void)validate_training_config(cfg.value());
  const auto cluster = cluster_settings_of(cfg.value());
  if (!cluster) return 0;
  const auto live = liveness_options_from(cluster.value());
  if (validate(live).empty()) {
    // What the actors compute from these options on every tick.
    const auto now = std::chrono::steady_clock::time_point{} + std::chrono::hours(24 * 365);
    (void)lost_deadline(now, live);
    (void)find_lost(now, {{"n", now - live.heartbeat_interval}}, live, true);
  }
  (void)validate(membership_options_from(cluster.value()));
  return 0;
}
