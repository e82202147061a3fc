#pragma once
// train.sync = diloco: what a rank keeps of the window between boundaries
// across generations (the slices it trained since the oldest fragment
// anchor, the steps it catches up on, the lost worker's slices it trains
// again), and the collectives that agree on them at a new generation. The
// arithmetic is rank/sync_diloco's. No LibTorch in this header.
#include <cstdint>
#include <utility>
#include <vector>

#include "dtactor/result.hpp"
#include "rank/outcome.hpp"
#include "rank/sync_diloco.hpp"

namespace dtactor {

class grad_sync;
class outer_optimizer;
class training_state;
struct generation_run;
struct rank_state;

// The oldest fragment anchor (plain DiLoCo: the anchor). A worker's steps
// before it are in every fragment of the global parameters.
int64_t oldest_fragment_anchor(const outer_optimizer& o);

class diloco_window {
 public:
  // A slice this rank trained; `start`: the oldest fragment anchor now
  // (what is older is in every fragment and forgotten).
  void note_slice(int64_t start, window_slice s);
  // A window's state read from a checkpoint: what global rank `rank` of the
  // `world` that wrote it trained since the oldest fragment anchor `start`
  // (its parameters and moments hold those slices).
  void from_checkpoint(int64_t start, int64_t step, int rank, int world);
  // The rank starts its window over from the anchor.
  void forget();
  void clear_catch_up() { catch_up_.clear(); }
  // The (rank, world) step `step` is trained as: those of the catch-up
  // segment it falls in, else `rank` of `world`.
  std::pair<int, int> slice_of(int64_t step, int rank, int world) const;
  bool replay_owed() const { return !replays_.empty(); }

  // This rank's words in the generation's one agreement round: its window
  // (anchor and step, rank/agreement.hpp's window_word) and the newest
  // generation it trained in. Error: a window too long to agree on.
  result<std::vector<int64_t>> agreement_words(const rank_state& rs) const;
  // After the agreement (`agreed`: the MAX of every rank's
  // agreement_words) and the state transfer: the furthest step any worker
  // reached in the window, the catch-up or skip of this rank, and the
  // replay of a lost worker's slices. `own_window`: this rank held the
  // agreed anchor.
  generation_end agree(generation_run& g, rank_state& rs, bool own_window, const std::vector<int64_t>& agreed);
  // Where this generation enters the window, said once on stderr.
  void announce(const generation_run& g, training_state& state) const;
  // A lost worker's slice of this window, trained again (no collective):
  // its samples reach the next outer step once. `host_sync`: the host's
  // reducer when a host's ranks replay together.
  generation_end replay_next(generation_run& g, rank_state& rs, grad_sync* host_sync);

 private:
  generation_end replay_owed_slices(generation_run& g, rank_state& rs, int64_t furthest);

  // A rank behind its peers that kept its window trains the steps it missed
  // on its slices of the world its peers took them in, instead of skipping
  // them. Ascending by `until`.
  std::vector<catch_up_segment> catch_up_;
  // Ranks as workers: the slices this rank trained (a replayed one: the
  // fragments it went to, empty = all) since the oldest fragment anchor
  // `slices_anchor_`, and the slices of the window that no survivor holds
  // (a lost worker's) that this rank trains again before the next boundary.
  int64_t slices_anchor_ = -1;
  std::vector<window_slice> window_slices_;
  std::vector<window_slice> replays_;
};

}  // namespace dtactor
