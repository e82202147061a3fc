#include "rank/sync_strategy.hpp"

#include <map>

#include "rank/exchange_choice.hpp"
#include "rank/generation.hpp"
#include "rank/step_policy.hpp"

namespace dtactor {

namespace {

// train.sync = every_step: the gradients are summed every step (the step's
// control rides in its last bucket), and every step is a boundary.
class sync_every_step final : public sync_strategy {
 public:
  int64_t held_step(training_state& state) const override { return state.step(); }
  std::function<void()> keep_through_transfer(rank_state&, bool) override {
    return [] {};
  }
  result<std::vector<int64_t>> agreement_words(const rank_state&) const override { return std::vector<int64_t>{}; }
  generation_end after_agreement(generation_run&, rank_state&, bool, const std::vector<int64_t>&) override { return std::nullopt; }
  void begin(training_state&) override {}
  void announce(const generation_run&, rank_state&) const override {}
  void ready_fields(const generation_run&, pb::rank_status&) const override {}
  bool outer_pending(training_state&) const override { return false; }
  bool in_flight(training_state&) const override { return false; }
  int64_t window_start(training_state&, int64_t attempted) const override { return attempted; }
  bool due(const step_cadence& c, int64_t every, int64_t step, int64_t, bool) const override { return c.due(every, step); }
  void add_reducers(const generation_run& g, rank_state& rs, exchanges& x) override {
    x.syncs.push_back(std::make_unique<grad_sync>(rs.state->the_task().module()->parameters(), g.pg, x.options));
  }
  result<training_state::dp_step> step(const generation_run& g, rank_state& rs, exchanges& x, int, int) override {
    return rs.state->train_step(step_context::every_step(g.rank, g.world, x.sync()));
  }
  void note_step(const generation_run&, rank_state&, int64_t, int, int) override {}
  generation_end after_step(generation_run&, rank_state&, exchanges& x, step_in_hand& h, const step_cadence&, bool, bool& boundary) override {
    h.agreed = x.sync().control();
    boundary = true;
    return std::nullopt;
  }
  bool reports_each_boundary() const override { return false; }
  bool writes_worker_sections(const job_modes&, int) const override { return false; }
  generation_end take_own_section(start_context&) override { return std::nullopt; }
};

}  // namespace

std::unique_ptr<sync_strategy> make_sync_every_step() { return std::make_unique<sync_every_step>(); }

std::unique_ptr<sync_strategy> make_sync_strategy(sync_mode mode) {
  static const std::map<sync_mode, std::unique_ptr<sync_strategy> (*)()> registry{
      {sync_mode::every_step, &make_sync_every_step},
      {sync_mode::diloco, &make_sync_diloco},
  };
  return registry.at(mode)();
}

}  // namespace dtactor
