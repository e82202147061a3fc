// The coordinator's actors as a stranger or a misbehaving node reaches them
// (actors/membership_actor.hpp, job_actor.hpp, checkpoint_writer.hpp): every
// frame on the coordinator's port is decoded (wire::decode, as the bridge
// does) and delivered to the membership actor, which answers and forwards
// reports to the job actor and checkpoint_written to the committer. The
// events go to the real coordinator sink (journal, metrics, progress lines,
// Prometheus service discovery), checkpoints to a real checkpoint store in
// memory (fuzz/actors_fixture.hpp). CAF's test coordinator runs the actors;
// the clock moves only when the input says so.
//
// Input: records. tag % 4 == 0: a frame from peer tag / 4 % 4; 1: the clock
// moves by the payload's first two bytes in milliseconds (10 ms steps, as
// real time fires timers); 2: a stop (a signal) for the job actor;
// 3: Prometheus scrapes /metrics and /sd. Properties: nothing crashes or
// leaks; everything the coordinator sends encodes as a frame, to a peer
// that sent one; /metrics and /sd always render.
#include <set>

#include "fuzz/actors_fixture.hpp"
#include "net/wire.hpp"

using namespace dtactor;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  test_support::caf_fixture fx;
  std::set<std::string> peers;
  outbound out = [&peers](const std::string& link, const std::string& peer, pb::envelope env) {
    if (link != links::nodes || !peers.count(peer)) fuzz::fail("a frame to a peer that never sent one");
    if (!wire::encode(env)) fuzz::fail("the coordinator sent a frame that does not encode");
  };
  fuzz::coordinator_actors c(fx, out);
  fx.run();
  fuzz::for_each_record(data, size, [&](uint8_t tag, std::string payload) {
    switch (tag % 4) {
      case 0: {
        auto d = wire::decode(payload, fuzz::job_id);
        if (!d) break;
        const std::string peer = "peer-" + std::to_string(tag / 4 % 4);
        peers.insert(peer);
        caf::anon_send(c.members, inbound{links::nodes, peer, std::move(d.value())});
        fx.run();
        break;
      }
      case 1:
        fx.advance(fuzz::clock_step(payload));
        break;
      case 2:
        caf::anon_send(c.job, stop_atom::value, std::string("stopped by signal 15"));
        fx.run();
        break;
      default:
        c.scrape();
        break;
    }
  });
  c.scrape();
  return 0;
}
