// The coordinator's actors as a stranger or a misbehaving node reaches them
// (actors/membership_actor.hpp, job_actor.hpp, checkpoint_writer.hpp): every
// frame on the coordinator's port is decoded (wire::decode, as the bridge
// does) and delivered to the membership actor, which answers and forwards
// reports to the job actor and checkpoint_written to the committer. The
// events go to the real coordinator sink (journal, metrics, progress lines,
// Prometheus service discovery), checkpoints to a real checkpoint store in
// memory. CAF's test coordinator runs the actors; the clock moves only when
// the input says so.
//
// Input: records. tag % 4 == 0: a frame from peer tag / 4 % 4; 1: the clock
// moves by the payload's first two bytes in milliseconds (10 ms steps, as
// real time would fire timers); 2: a stop (signal) for the job actor;
// 3: Prometheus scrapes /metrics and /sd. Properties: nothing crashes or
// leaks; everything the coordinator sends encodes as a frame; /metrics and
// /sd always render.
#include <chrono>

#include "actors/job_actor.hpp"
#include "actors/membership_actor.hpp"
#include "app/coordinator_sink.hpp"
#include "dtactor/config.hpp"
#include "fuzz/fuzz_util.hpp"
#include "fuzz/memory_store.hpp"
#include "runtime/checkpoint_store.hpp"
#include "runtime/wire.hpp"
#include "tests/actor_test_util.hpp"

using namespace dtactor;

namespace {

constexpr const char* job_id = "job-fuzz";

const config& job_config() {
  static const config cfg = [] {
    auto c = config::parse_toml("[train]\nmax_steps = 40\n[cluster]\nmin_nodes = 2\nmax_nodes = 4\n", "fuzz");
    if (!c) fuzz::fail(c.message().c_str());
    return c.value();
  }();
  return cfg;
}

struct coordinator_under_test {
  test_support::caf_fixture fx;
  std::shared_ptr<fuzz::memory_store> objects = std::make_shared<fuzz::memory_store>();
  checkpoint_store store = checkpoint_store::over(objects, checkpoint_policy{});
  journal jn;
  metrics m{job_id};
  run_observer obs{run_observer::options{"", 40, false, ""}};
  sd_targets sd{job_id};
  coordinator_sink sink{jn, m, obs, sd};
  caf::actor members, job, writer;
  uint64_t sent = 0;

  coordinator_under_test() {
    if (!jn.open("/dev/null")) fuzz::fail("cannot open /dev/null as the journal");
    sd.set_coordinator("127.0.0.1", 9400);
    m.add_route("/sd", "application/json", [this] { return sd.json(); });
    envelope_header header;
    header.job_id = job_id;
    header.sender = sender_id::coordinator().to_string();
    header.incarnation = 77;

    checkpoint_writer_options wopts;
    wopts.events = sink.as_sink();
    wopts.commit = [this](pb::checkpoint_meta meta) -> result<saved_checkpoint> {
      auto done = store.commit(std::move(meta));
      if (!done) return done.err();
      return saved_checkpoint{done->location, static_cast<int64_t>(done->bytes), 0.0};
    };
    coordinator_options copts = coordinator_options_from(job_config());
    copts.header = header;
    copts.store_host = "127.0.0.1";
    copts.store_port = 29500;
    copts.config_toml = job_config().to_toml();
    copts.checkpoint_store = objects->location();
    copts.events = sink.as_sink();
    job_options jopts = job_options_from(job_config());
    jopts.header = header;
    jopts.events = sink.as_sink();
    outbound out = [this](const std::string& link, const std::string& peer, pb::envelope env) {
      if (link != links::nodes || peer.empty()) fuzz::fail("a frame to no node");
      if (!wire::encode(env)) fuzz::fail("the coordinator sent a frame that does not encode");
      ++sent;
    };
    writer = fx.spawn(checkpoint_writer, wopts);
    job = fx.spawn(job_actor, jopts, writer);
    members = fx.spawn(membership_actor, copts, out, job);
    caf::anon_send(job, members_atom::value, members);
    caf::anon_send(writer, members_atom::value, members);
    fx.run();
  }

  ~coordinator_under_test() {
    // Before the sink and the store they write to go.
    for (const auto& a : {members, job, writer}) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
    fx.run();
  }

  void scrape() {
    (void)m.render();
    (void)sd.json();
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  coordinator_under_test c;
  fuzz::reader in(data, size);
  while (!in.empty()) {
    const uint8_t tag = in.u8();
    const std::string payload = in.payload();
    switch (tag % 4) {
      case 0: {
        auto d = wire::decode(payload, job_id);
        if (!d) break;
        caf::anon_send(c.members, inbound{links::nodes, "peer-" + std::to_string(tag / 4 % 4), std::move(d.value())});
        c.fx.run();
        break;
      }
      case 1: {
        const unsigned ms = payload.size() >= 2 ? static_cast<uint8_t>(payload[0]) | static_cast<uint8_t>(payload[1]) << 8 : 100;
        c.fx.advance(std::chrono::milliseconds(ms % 5000));
        break;
      }
      case 2:
        caf::anon_send(c.job, stop_atom::value, std::string("stopped by signal 15"));
        c.fx.run();
        break;
      default:
        c.scrape();
        break;
    }
  }
  c.scrape();
  return 0;
}
