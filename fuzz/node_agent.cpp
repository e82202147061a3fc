// The node agent as its coordinator and its rank processes reach it
// (actors/node_agent.hpp): frames from the coordinator's link (register_ack
// with the job's config, heartbeat_ack, generation plans, shutdowns) and
// from the ranks' ipc link (rank_hello, heartbeats, reports it relays) are
// decoded as the bridge does and delivered; rank processes are a fake
// launcher whose exits are messages. The job's liveness settings come from
// the config in register_ack, as app/node.cpp reads them.
//
// Input: records. tag % 4 == 0: a frame from the coordinator; 1: a frame
// from rank peer tag / 4 % 3; 2: the clock moves by the payload's first two
// bytes in milliseconds; 3: the rank process with pid 1000 + payload[0]
// exits (code payload[1]), or with bit 4 of the tag the node leaves
// (a preemption notice). Properties: nothing crashes; everything the node
// sends encodes, and goes to the coordinator or to a rank it started.
#include <chrono>
#include <set>

#include "actors/liveness.hpp"
#include "actors/node_agent.hpp"
#include "dtactor/config.hpp"
#include "fuzz/fuzz_util.hpp"
#include "runtime/wire.hpp"
#include "tests/actor_test_util.hpp"

using namespace dtactor;

namespace {

class fake_launcher : public process_launcher {
 public:
  caf::actor agent;
  int32_t next_pid = 1000;
  std::set<int32_t> running;
  result<int32_t> spawn(int32_t) override {
    const int32_t pid = next_pid++;
    running.insert(pid);
    return pid;
  }
  void terminate(int32_t pid) override { exit(pid, 143); }
  void kill(int32_t pid) override { exit(pid, 137); }
  void exit(int32_t pid, int32_t code) {
    if (running.erase(pid)) caf::anon_send(agent, rank_exit_atom::value, pid, code);
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  test_support::caf_fixture fx;
  auto launcher = std::make_shared<fake_launcher>();
  node_agent_options o;
  o.node_id = "node-a";
  o.advertise_addr = "10.0.0.2";
  o.hostname = "node-a";
  o.nproc = 2;
  o.header.sender = sender_id::of_node(o.node_id).to_string();
  o.header.incarnation = 42;
  // As app/node.cpp: the job's heartbeat settings from register_ack's config.
  o.liveness_from_config = [](const std::string& toml) -> std::optional<liveness_options> {
    auto c = config::parse_toml(toml, "register_ack");
    if (!c) return std::nullopt;
    return liveness_options_from(c.value());
  };
  o.annotate_report = [](const std::string&, pb::step_report& r) { r.set_node_id("node-a"); };
  std::set<std::string> rank_peers;
  outbound out = [&](const std::string& link, const std::string& peer, pb::envelope env) {
    if (link != links::coordinator && link != links::ranks) fuzz::fail("a frame on no link");
    if (link == links::ranks && !rank_peers.count(peer)) fuzz::fail("a frame to a rank that never said hello");
    if (!wire::encode(env)) fuzz::fail("the node sent a frame that does not encode");
  };
  auto agent = fx.spawn(node_agent, o, out, launcher);
  launcher->agent = agent;
  caf::anon_send(agent, start_atom::value);
  fx.run();
  fuzz::reader in(data, size);
  while (!in.empty()) {
    const uint8_t tag = in.u8();
    const std::string payload = in.payload();
    switch (tag % 4) {
      case 0:
      case 1: {
        auto d = wire::decode(payload, "");
        if (!d) break;
        if (tag % 4 == 0) {
          caf::anon_send(agent, inbound{links::coordinator, "", std::move(d.value())});
        } else {
          const std::string peer = "rank-peer-" + std::to_string(tag / 4 % 3);
          rank_peers.insert(peer);
          caf::anon_send(agent, inbound{links::ranks, peer, std::move(d.value())});
        }
        fx.run();
        break;
      }
      case 2: {
        const unsigned ms = payload.size() >= 2 ? static_cast<uint8_t>(payload[0]) | static_cast<uint8_t>(payload[1]) << 8 : 100;
        fx.advance(std::chrono::milliseconds(ms % 5000));
        break;
      }
      default:
        if (tag & 0x10)
          caf::anon_send(agent, leave_atom::value, std::string("preempted"), std::string("aws"), std::string("2030-01-01T00:00:00Z"), 1.9e9, 1.89e9);
        else
          launcher->exit(1000 + (payload.empty() ? 0 : static_cast<uint8_t>(payload[0])), payload.size() > 1 ? static_cast<uint8_t>(payload[1]) : 1);
        fx.run();
        break;
    }
  }
  caf::anon_send_exit(agent, caf::exit_reason::user_shutdown);
  fx.run();
  return 0;
}
