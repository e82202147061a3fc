#pragma once
// DiLoCo's window bookkeeping and the arithmetic of replaying a lost
// worker's slices (train.sync = diloco, ranks or hosts as workers), as pure
// functions over the words the ranks MAX-allreduce together. The rank
// worker does the collectives (rank_worker::replay_owed_slices); every rank
// computes the same list from the same words. No LibTorch here.
#include <cstdint>
#include <vector>

namespace dtactor {

// One slice of a step: global rank `rank` of the `world` the step was taken
// in; a replayed one: the fragments it went to (empty = all), and with a
// host's ranks replaying together, this rank's `part` of `parts`.
struct window_slice {
  int64_t step = 0;
  int rank = 0, world = 1;
  std::vector<bool> fragments;
  int part = 0, parts = 1;
};

// A rank behind its peers that kept its window trains the steps before
// `until` as global rank `rank` of `world`. Ascending by `until`.
struct catch_up_segment {
  int64_t until = 0;
  int rank = 0, world = 1;
};

// The window's steps [start, end): from the oldest fragment anchor to the
// furthest step any worker reached.
struct window_span {
  int64_t start = 0, end = 0;
  int64_t len() const { return end - start; }
  bool holds(const window_slice& x) const { return x.step >= start && x.step < end && x.world >= 1 && x.rank >= 0 && x.rank < x.world; }
};

// What this rank holds of the window: its own slices since `w.start`, and
// those it will train catching up from `step` on.
std::vector<window_slice> held_slices(const std::vector<window_slice>& own, const std::vector<catch_up_segment>& catch_up, int64_t step,
                                      window_span w);

// Words of the first MAX allreduce (len + 1): each step's world size, and
// last, the largest.
std::vector<int64_t> slice_world_words(const std::vector<window_slice>& held, window_span w);
// The largest world of the agreed words (at least 1).
int64_t widest_world(const std::vector<int64_t>& worlds);

// Words of the second (len x widest x frags): 1 where this rank holds
// fragment f of slice (step, rank) of that step's agreed world.
std::vector<int64_t> slice_fragment_words(const std::vector<window_slice>& held, window_span w, const std::vector<int64_t>& worlds,
                                          int64_t frags);

// Who replays which owed slice: unit `unit` of `units` (a rank, or a host's
// ranks together), this rank being `part` of `parts` of its unit.
struct replay_unit {
  int units = 1, unit = 0, part = 0, parts = 1;
};
// With hosts as workers: the leaders' words (1 at each worker's lowest
// rank, MAX-allreduced) give the units, in the order of their leaders.
void count_units(const std::vector<int64_t>& leaders, int leader, replay_unit& u);

struct owed_slices {
  std::vector<window_slice> mine;  // to train again before the next boundary
  int64_t owed = 0;                // of every unit
};
// The slices no survivor holds for some fragment whose anchor is at or
// before their step, dealt round-robin over the units. A step nobody alive
// trained (world word 0): its whole batch, as world 1.
owed_slices deal_owed_slices(window_span w, const std::vector<int64_t>& worlds, const std::vector<int64_t>& fragment_bits,
                             const std::vector<int64_t>& fragment_anchors, const replay_unit& u);

}  // namespace dtactor
