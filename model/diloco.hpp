#pragma once
// DiLoCo's outer optimizer (Douillard et al., 2023; train.sync = diloco),
// and Streaming DiLoCo (Douillard et al., 2025; train.sync_fragments,
// train.sync_overlap).
// Every worker runs train.sync_every inner steps of its own AdamW on its own
// share of each global batch, without exchanging anything; at each boundary
// the workers sum their pseudo-gradients (global parameters minus their
// local ones) through the data-parallel reducer, and every worker applies
// the same Nesterov SGD step to the global parameters:
//
//   delta = (sum over workers of (global - local)) / workers
//   momentum = mu * momentum + delta
//   global -= lr * (delta + mu * momentum)          (torch.optim.SGD, nesterov)
//   local  = global
//
// so after a boundary every worker holds the same parameters again.
//
// Streaming: the parameters (in module order) are cut into F fragments of
// about equal size; fragment f synchronises at steps f' = (f+1)*H/F + k*H
// (the last one at multiples of H), so a 1/F of the model crosses the link
// every H/F steps instead of all of it every H. With an overlap of tau
// steps the exchange is launched at its step and lands tau inner steps
// later (the workers train on meanwhile); the fragment then takes
//   local = mix * local + (1 - mix) * global
// (Streaming DiLoCo's merge; a fragment exchanged without overlap takes
// local = global). At train.max_steps every fragment synchronises without
// overlap, so the job ends on the global parameters.
//
// State ("outer/..." in the state stream: checkpoints, peer state, resume):
// the global parameters, the momentum, the anchor (the step the last
// exchange landed at) and, streaming, each fragment's anchor (the step its
// last pseudo-gradient was taken at). The inner AdamW moments stay per
// worker. An exchange in flight is not state: a stop or a checkpoint waits
// for it to land (at most tau steps), a new generation drops it and the
// fragment synchronises again at once.
//
// Works on the flat buffers of flat_adamw (a handful of tensor ops per
// range, not per parameter).
#include <torch/torch.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "model/flat_adamw.hpp"
#include "model/state_tensor.hpp"

namespace dtactor {

struct outer_options {
  double lr = 0.7;        // train.outer_lr
  double momentum = 0.9;  // train.outer_momentum
  int64_t every = 50;     // train.sync_every: boundaries at multiples of it (and at train.max_steps)
  int64_t max_steps = 0;  // train.max_steps
  int fragments = 1;      // train.sync_fragments
  int64_t overlap = 0;    // train.sync_overlap (resolved: 0 or more), below every / fragments
  double mix = 0.5;       // train.sync_mix: the local share after an overlapped exchange
};

// train.sync_overlap as given (-1: 1 step when streaming, else 0).
int64_t resolved_overlap(int64_t configured, int fragments);

// A fragment: parameters consecutive in module order.
struct outer_fragment {
  size_t first_param = 0, params = 0;  // in the requires-grad parameter list
  // (group, offset, length) in the inner optimizer's flat buffers, adjacent merged.
  std::vector<std::tuple<size_t, int64_t, int64_t>> ranges;
  int64_t elements = 0;
  int64_t offset = 0;  // synchronises at offset + k * every (offset = every for the last)
};

// Cuts parameters of these sizes into `fragments` runs of consecutive ones,
// each closing once it holds its 1/fragments share of the elements (every
// run gets at least one parameter). An empty result when there are fewer
// parameters than fragments.
std::vector<std::pair<size_t, size_t>> cut_fragments(const std::vector<int64_t>& numels, int fragments);

class outer_optimizer {
 public:
  // The global parameters start as the inner optimizer's current ones.
  // param_numels: each parameter's elements, in the inner optimizer's order
  // (at least o.fragments of them).
  outer_optimizer(flat_adamw& inner, const std::vector<int64_t>& param_numels, outer_options o);

  // The step the last exchange landed at.
  int64_t anchor() const { return anchor_.item<int64_t>(); }
  // Several fragments, or an overlap: fragments' own anchors in the state,
  // evaluation and digests on the global parameters.
  bool streaming() const { return fragments_.size() > 1 || o_.overlap > 0; }
  const outer_options& options() const { return o_; }
  const std::vector<outer_fragment>& fragments() const { return fragments_; }
  // The step fragment f's last pseudo-gradient was taken at.
  int64_t fragment_anchor(size_t f) const;

  // Fragments due at `step` (a scheduled synchronisation after their
  // anchor, or the job's end), not counting one in flight, in order.
  std::vector<size_t> due_fragments(int64_t step) const;
  // Some fragment is due at `step`.
  bool due(int64_t step) const { return !due_fragments(step).empty(); }
  // The step of the next scheduled synchronisation after `step`.
  int64_t boundary_after(int64_t step) const;

  // The fragment whose exchange is in flight, and the step it left at.
  std::optional<size_t> in_flight() const { return flying_; }
  int64_t launched_at() const { return launched_at_; }
  // The flight lands at `step`: tau steps after its launch, at the job's
  // end, or when another fragment is due first.
  bool lands(int64_t step) const;

  // Fragment f's pseudo-gradient (global - local) into its ranges of the
  // inner optimizer's gradient buffers (the reducer sums them from there);
  // `keep`: also kept aside (a world of one with an overlap: inner steps
  // reuse the buffers before it lands). f is in flight from `step`.
  // Returns its 2-norm.
  double launch(size_t f, int64_t step, bool keep);
  // The flight's ranges of the gradient buffers hold the SUM of `workers`
  // pseudo-gradients (a kept one is put back first): the Nesterov step on
  // its global part, then its local part = global (landing where it left)
  // or the mix (landing later), gradients there zeroed, its anchor = the
  // launch step, anchor() = step. Returns the averaged pseudo-gradient's norm.
  double land(int workers, int64_t step);
  // The flight's exchange is gone (a new generation): nothing changed, the
  // fragment is due again.
  void drop_flight();
  // Local parameters back to the global ones (a worker that took the state
  // of a peer mid-window starts its window over from the anchor).
  void reset_to_global();
  // Swaps the global parameters into the live ones (and back): evaluation
  // and digests of a streaming job see the model the workers agree on.
  void swap_global();

  // Bytes of a pseudo-gradient (what each worker hands to the exchange):
  // of fragment f, and of the whole model.
  int64_t payload_bytes(size_t f) const { return fragments_[f].elements * 4; }
  int64_t payload_bytes() const;
  // Bytes this adds to the state (global parameters and momentum).
  int64_t state_bytes() const { return 2 * payload_bytes(); }

  // "outer/global.<g>", "outer/momentum.<g>" per parameter group,
  // "outer/anchor" (int64[1]) and, streaming, "outer/fragment_anchors"
  // (int64[F]): live tensors, as flat_adamw::state_tensors.
  std::vector<state_tensor> state_tensors() const;

 private:
  template <class F>
  void each_range(size_t f, F&& fn) const;

  flat_adamw& inner_;
  outer_options o_;
  std::vector<outer_fragment> fragments_;
  std::vector<torch::Tensor> global_, momentum_;
  torch::Tensor anchor_;            // int64[1]
  torch::Tensor fragment_anchors_;  // int64[F]; in the state when streaming
  std::optional<size_t> flying_;
  int64_t launched_at_ = 0;
  std::vector<torch::Tensor> kept_;  // the flight's pseudo-gradient, per range (keep)
};

}  // namespace dtactor
