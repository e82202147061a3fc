// The node agent as its coordinator and its rank processes reach it
// (actors/node_agent.hpp): frames from the coordinator's link (register_ack
// with the job's config, heartbeat_ack, generation plans, shutdowns) and
// from the ranks' ipc link (rank_hello, heartbeats, reports it relays) are
// decoded as the bridge does and delivered; rank processes are a fake
// launcher whose exits are messages (fuzz/actors_fixture.hpp). The job's
// liveness settings come from the config in register_ack, as in app/node.cpp.
//
// Input: records. tag % 4 == 0: a frame from the coordinator; 1: a frame
// from rank peer "rank-peer-<tag / 4 % 3>"; 2: the clock moves by the
// payload's first two bytes in milliseconds; 3: with bit 5 of the tag an
// accepted register_ack whose config is the payload (TOML, unframed), with
// bit 4 the node leaves (a preemption notice), else the rank process with
// pid 1000 + payload[0] exits with code payload[1]. Properties: nothing
// crashes; everything the node sends encodes, and goes to the coordinator
// or to a rank peer it heard from.
#include <set>

#include "fuzz/actors_fixture.hpp"
#include "net/wire.hpp"

using namespace dtactor;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  test_support::caf_fixture fx;
  auto launcher = std::make_shared<fuzz::fake_launcher>(1000);
  std::set<std::string> rank_peers;
  outbound out = [&rank_peers](const std::string& link, const std::string& peer, pb::envelope env) {
    if (link != links::coordinator && link != links::ranks) fuzz::fail("a frame on no link");
    if (link == links::ranks && !rank_peers.count(peer)) fuzz::fail("a frame to a rank peer it never heard from");
    if (!wire::encode(env)) fuzz::fail("the node sent a frame that does not encode");
  };
  auto agent = fx.spawn(node_agent, fuzz::node_options("node-a"), out, launcher);
  launcher->agent = agent;
  caf::anon_send(agent, start_atom::value);
  fx.run();
  fuzz::for_each_record(data, size, [&](uint8_t tag, std::string payload) {
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
      case 2:
        fx.advance(fuzz::clock_step(payload));
        break;
      default:
        if (tag & 0x20) {
          // The coordinator's acceptance, with the payload as the job's
          // config: the TOML a node parses for its heartbeat settings,
          // without the envelope around it.
          envelope_header h;
          h.job_id = fuzz::job_id;
          h.sender = sender_id::coordinator().to_string();
          pb::envelope env = make_envelope(h, 0);
          auto* ack = env.mutable_register_ack();
          ack->set_accepted(true);
          ack->set_job_id(fuzz::job_id);
          ack->set_config_toml(payload);
          caf::anon_send(agent, inbound{links::coordinator, "", std::move(env)});
        } else if (tag & 0x10)
          caf::anon_send(agent, leave_atom::value, std::string("preempted"), std::string("aws"), std::string("2030-01-01T00:00:00Z"), 1.9e9, 1.89e9);
        else
          launcher->exit(1000 + (payload.empty() ? 0 : static_cast<uint8_t>(payload[0])), payload.size() > 1 ? static_cast<uint8_t>(payload[1]) : 1);
        fx.run();
        break;
    }
  });
  caf::anon_send_exit(agent, caf::exit_reason::user_shutdown);
  fx.run();
  return 0;
}
