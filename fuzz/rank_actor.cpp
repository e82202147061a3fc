// The rank actor as its node reaches it (actors/rank_actor.hpp): frames on
// the rank's ipc link (generation plans, shutdowns) decoded as the bridge
// does; the training thread is a fake that records what it was offered and
// reports back. Input: records. tag % 4 == 0: a frame from the node; 1: the
// training thread reports the payload (an envelope's body) for generation
// tag / 4; 2: the clock moves; 3: nothing (a separator). Properties:
// nothing crashes; everything the rank sends encodes; the worker is only
// offered plans newer than the last it took.
#include <chrono>

#include "actors/rank_actor.hpp"
#include "fuzz/fuzz_util.hpp"
#include "runtime/wire.hpp"
#include "tests/actor_test_util.hpp"

using namespace dtactor;

namespace {

class fake_work : public rank_work {
 public:
  rank_work_callbacks cb;
  uint64_t newest = 0;
  bool any = false;
  explicit fake_work(rank_work_callbacks c) : cb(std::move(c)) {}
  bool offer(const pb::generation_plan& plan) override {
    if (any && plan.generation() <= newest) return false;
    any = true;
    newest = plan.generation();
    return true;
  }
  void request_stop(bool) override {}
  void quit() override {}
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  test_support::caf_fixture fx;
  fake_work* work = nullptr;
  rank_actor_options o;
  o.header.sender = sender_id::of_rank("node-a", 0).to_string();
  o.header.incarnation = 9;
  o.pid = 1000;
  o.send = [](pb::envelope env) {
    if (!wire::encode(env)) fuzz::fail("the rank sent a frame that does not encode");
  };
  o.make_work = [&work](rank_work_callbacks cb) -> std::unique_ptr<rank_work> {
    auto w = std::make_unique<fake_work>(std::move(cb));
    work = w.get();
    return w;
  };
  auto rank = fx.spawn(rank_actor, o);
  caf::anon_send(rank, start_atom::value);
  fx.run();
  fuzz::reader in(data, size);
  while (!in.empty()) {
    const uint8_t tag = in.u8();
    const std::string payload = in.payload();
    switch (tag % 4) {
      case 0: {
        auto d = wire::decode(payload, "");
        if (!d) break;
        caf::anon_send(rank, inbound{"node", "", std::move(d.value())});
        fx.run();
        break;
      }
      case 1: {
        pb::envelope body;
        if (!work || !body.ParseFromString(payload)) break;
        const uint64_t gen = tag / 4;
        if (body.has_step_report()) work->cb.on_step(gen, body.step_report());
        if (body.has_eval_report()) work->cb.on_eval(gen, body.eval_report());
        if (body.has_checkpoint_written()) work->cb.on_checkpoint(gen, body.checkpoint_written());
        if (body.has_rank_status()) work->cb.on_status(gen, body.rank_status());
        fx.run();
        break;
      }
      case 2: {
        const unsigned ms = payload.size() >= 2 ? static_cast<uint8_t>(payload[0]) | static_cast<uint8_t>(payload[1]) << 8 : 100;
        fx.advance(std::chrono::milliseconds(ms % 5000));
        break;
      }
      default:
        break;
    }
  }
  caf::anon_send_exit(rank, caf::exit_reason::user_shutdown);
  fx.run();
  return 0;
}
