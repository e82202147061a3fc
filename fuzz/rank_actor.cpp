// The rank actor as its node reaches it (actors/rank_actor.hpp): frames on
// the rank's ipc link (generation plans, shutdowns) decoded as the bridge
// does; the training thread is a fake that takes plans as rank_worker does
// (only newer ones) and reports what the input says. Input: records.
// tag % 4 == 0: a frame from the node; 1: the training thread reports the
// payload (an envelope holding the report) for generation tag / 4; 2: the
// clock moves; 3: nothing. Properties: nothing crashes; everything the rank
// sends encodes.
#include "fuzz/actors_fixture.hpp"
#include "net/wire.hpp"

using namespace dtactor;

namespace {

class fake_work : public rank_work {
 public:
  rank_work_callbacks cb;
  uint64_t newest = 0;
  bool any = false;
  fake_work** self_ref;  // cleared when the actor's state (and this) goes
  fake_work(rank_work_callbacks c, fake_work** ref) : cb(std::move(c)), self_ref(ref) { *ref = this; }
  ~fake_work() override { *self_ref = nullptr; }
  bool offer(const pb::generation_plan& plan) override {
    if (any && plan.generation() <= newest) return false;
    any = true;
    newest = plan.generation();
    return true;
  }
  void request_stop(bool) override {}
  void quit() override {}
  void take_slot(int32_t) override {}
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fake_work* work = nullptr;  // outlives the actors (declared before them)
  test_support::caf_fixture fx;
  auto send = [](pb::envelope env) {
    if (!wire::encode(env)) fuzz::fail("the rank sent a frame that does not encode");
  };
  auto rank = fx.spawn(rank_actor, fuzz::rank_options("node-a", 0, 1000, send, [&work](rank_work_callbacks cb) -> std::unique_ptr<rank_work> {
                         return std::make_unique<fake_work>(std::move(cb), &work);
                       }));
  caf::anon_send(rank, start_atom::value);
  fx.run();
  fuzz::for_each_record(data, size, [&](uint8_t tag, std::string payload) {
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
      case 2:
        fx.advance(fuzz::clock_step(payload));
        break;
      default:
        break;
    }
  });
  caf::anon_send_exit(rank, caf::exit_reason::user_shutdown);
  fx.run();
  return 0;
}
