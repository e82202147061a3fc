// The wire envelope (proto/wire.proto, net/wire.hpp): every frame that
// reaches a coordinator, node or rank socket goes through wire::decode
// before anything else looks at it. Properties: decode never crashes, and
// an envelope it accepts encodes again and decodes to the same message (what
// a node relays for its ranks is re-encoded). rank 0's checkpoint_written
// carries a manifest body the coordinator parses and checks: done here too.
#include "fuzz/fuzz_util.hpp"
#include "storage/checkpoint_store.hpp"
#include "net/wire.hpp"

using namespace dtactor;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  for (std::string_view job : {std::string_view{}, std::string_view{"job-fuzz"}}) {
    auto d = wire::decode(data, size, job);
    if (!d) {
      if (wire::to_string(d.kind())[0] == '\0' || d.message().empty()) fuzz::fail("a refused frame without a kind or a reason");
      continue;
    }
    const pb::envelope& env = d.value();
    (void)wire::body_name(env);
    const auto from = sender_id::parse(env.sender());
    if (from.who != sender_id::role::unknown && !(sender_id::parse(from.to_string()) == from)) fuzz::fail("sender_id does not round-trip");
    (void)from.node_name();
    auto bytes = wire::encode(env);
    if (!bytes) fuzz::fail("an accepted envelope does not encode");
    auto again = wire::decode(bytes.value(), job);
    if (!again || !fuzz::same_message(env, again.value())) fuzz::fail("an accepted envelope does not round-trip");
    if (env.has_checkpoint_written()) {
      pb::checkpoint_meta meta;
      if (meta.ParseFromString(env.checkpoint_written().meta())) (void)check_manifest(meta);
    }
  }
  return 0;
}
