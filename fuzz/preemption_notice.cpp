// The clouds' preemption notices (base/preemption_notice.hpp): a node
// polls its instance metadata service and parses what comes back (AWS
// spot/instance-action JSON, GCP's "TRUE", Azure Scheduled Events JSON and
// RFC 1123 / RFC 3339 times). Properties: no parser crashes; a notice it
// returns names the right cloud and finite times.
#include <cmath>

#include "fuzz/fuzz_util.hpp"
#include "base/preemption_notice.hpp"

using namespace dtactor;

namespace {

void check(const std::optional<preemption_notice>& n, cloud_kind cloud) {
  if (!n) return;
  if (n->cloud != cloud) fuzz::fail("a notice of another cloud");
  if (!std::isfinite(n->announced_unix_s) || !std::isfinite(n->noticed_unix_s)) fuzz::fail("a notice at a time that is not finite");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t which = data[0];
  const std::string body(reinterpret_cast<const char*>(data + 1), size - 1);
  constexpr double now = 1.7e9;
  switch (which % 4) {
    case 0:
      check(parse_aws_instance_action(body, now), cloud_kind::aws);
      break;
    case 1:
      check(parse_gcp_preempted(body, now), cloud_kind::gcp);
      break;
    case 2:
      check(parse_azure_events(body, which & 0x80 ? "vm-fuzz" : "", now), cloud_kind::azure);
      break;
    default:
      if (auto t = parse_utc_time(body); t && !std::isfinite(*t)) fuzz::fail("a time that is not finite");
      break;
  }
  return 0;
}
