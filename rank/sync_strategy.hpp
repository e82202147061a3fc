#pragma once
// What differs between the train.sync modes in a generation's steps and
// its start, behind one interface: sync_every_step (the reducer every
// step) and sync_diloco (inner steps without a collective, outer exchanges
// at the window's boundaries, streaming as its option; rank/diloco_window).
// Found by the typed mode (job/modes.hpp) in a registry of one line each
// (make_sync_strategy).
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "comm/step_control.hpp"
#include "job/modes.hpp"
#include "model/trainer.hpp"
#include "rank/outcome.hpp"
#include "wire.pb.h"

namespace dtactor {

struct exchanges;
struct generation_run;
struct rank_state;
struct step_cadence;
struct start_context;

// The step in hand and what the steps add up between two step reports
// (rank/step_loop), which a strategy's exchanges add to.
struct step_in_hand {
  training_state::dp_step r;  // the step (DiLoCo: its outer exchanges' times added)
  step_control mine;          // this rank's control for the step
  step_control agreed;        // the last exchange's sums of the ranks' controls
  pb::step_report acc;        // sums since the last report
  std::chrono::steady_clock::time_point window_began = std::chrono::steady_clock::now();
};

class sync_strategy {
 public:
  virtual ~sync_strategy() = default;

  // What this rank holds for the state agreement: its step, or DiLoCo's
  // anchor (the last boundary it synchronised at).
  virtual int64_t held_step(training_state& state) const = 0;
  // Around a state transfer from the agreement's root: what this rank
  // keeps of its own through it (`holds_agreed`: it held the agreed step).
  // The function returned runs after the transfer (every step: nothing;
  // DiLoCo: a rank holding the agreed anchor keeps its window's progress,
  // parameters, buffers, inner moments and step; the others start their
  // window over from the anchor).
  virtual std::function<void()> keep_through_transfer(rank_state& rs, bool holds_agreed) = 0;
  // The strategy's words in the generation's one agreement round
  // (rank/agreement.hpp), taken before any state moves (every step: none;
  // DiLoCo: its window's). Error: what cannot be agreed, one line.
  virtual result<std::vector<int64_t>> agreement_words(const rank_state& rs) const = 0;
  // After the agreement and the state transfer, with the MAX of every
  // rank's agreement_words: the strategy's own (DiLoCo: the window's
  // furthest step, this rank's catch-up or skip, and the replay of a lost
  // worker's slices). Only with a group.
  virtual generation_end after_agreement(generation_run& g, rank_state& rs, bool own_window, const std::vector<int64_t>& agreed) = 0;

  // Before the first step: what the last generation left in flight is gone.
  virtual void begin(training_state& state) = 0;
  // Said once on stderr where the generation enters the strategy's cycle.
  virtual void announce(const generation_run& g, rank_state& rs) const = 0;
  // The strategy's fields of the READY status.
  virtual void ready_fields(const generation_run& g, pb::rank_status& ready) const = 0;

  // Work left at this step without an inner step (DiLoCo: a fragment due,
  // or an exchange in flight that lands now).
  virtual bool outer_pending(training_state& state) const = 0;
  // An exchange is in flight (a rank alone stops only without one).
  virtual bool in_flight(training_state& state) const = 0;
  // The first step of the window the step at `attempted` is in.
  virtual int64_t window_start(training_state& state, int64_t attempted) const = 0;
  // Whether `every` falls due at `step` (DiLoCo: anywhere in the window
  // [window_start, step], at its boundary).
  virtual bool due(const step_cadence& c, int64_t every, int64_t step, int64_t window_start, bool alone) const = 0;

  // The generation's reducers, into `x` whose options are set (every step:
  // one over every parameter; DiLoCo: one, or one a streaming fragment,
  // and with hosts as workers the host's per-step reducer).
  virtual void add_reducers(const generation_run& g, rank_state& rs, exchanges& x) = 0;
  // The step's forward, backward and update, as global rank `slice_rank`
  // of `slice_world` (DiLoCo catching up: of the world it was taken in).
  virtual result<training_state::dp_step> step(const generation_run& g, rank_state& rs, exchanges& x, int slice_rank, int slice_world) = 0;
  // The step at `attempted` was trained as (slice_rank, slice_world).
  virtual void note_step(const generation_run& g, rank_state& rs, int64_t attempted, int slice_rank, int slice_world) = 0;
  // After the step: the exchanges that land, `h.agreed`, and `boundary`
  // when every rank now holds the same parameters.
  virtual generation_end after_step(generation_run& g, rank_state& rs, exchanges& x, step_in_hand& h, const step_cadence& c, bool alone,
                                    bool& boundary) = 0;
  // Every boundary is reported (DiLoCo with a group), besides the cadence.
  virtual bool reports_each_boundary() const = 0;

  // The strategy's sections of a checkpoint, beside the state's stream
  // proper: whether this rank's part carries a section of this worker's own
  // inner state (DiLoCo with checkpoint.diloco_workers = all at a world
  // over 1; every step: never).
  virtual bool writes_worker_sections(const job_modes& modes, int world) const = 0;
  // After the state source, what this rank takes of its own from the
  // checkpoint the agreed state came from (DiLoCo: a worker that did not
  // hold the agreed anchor reads its section when there is one; every
  // step: nothing).
  virtual generation_end take_own_section(start_context& c) = 0;
};

// The strategy of `mode`; every sync_mode has one.
std::unique_ptr<sync_strategy> make_sync_strategy(sync_mode mode);

// The registered classes' makers (rank/sync_strategy.cpp, rank/diloco_window.cpp).
std::unique_ptr<sync_strategy> make_sync_every_step();
std::unique_ptr<sync_strategy> make_sync_diloco();

}  // namespace dtactor
