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
#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "comm/step_control.hpp"
#include "dtactor/result.hpp"
#include "model/flat_adamw.hpp"
#include "model/state_tensor.hpp"

namespace dtactor {

class grad_sync;

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

// One outer exchange: launched, or launched and landed.
struct outer_step_result {
  double pseudo_grad_norm = 0;  // of the workers' average
  double exchange_s = 0, exposed_s = 0, update_s = 0;
  int64_t payload_bytes = 0;  // this worker's pseudo-gradient as handed to the exchange (fp32)
  int64_t inner_steps = 0;    // steps of the window it closes (streaming: of its fragment)
  size_t fragment = 0;
  bool landed = false;  // false: launched, in flight (land_exchange later)
};

// The reducer that carries fragment f's pseudo-gradient (its parameters
// only when streaming). A world of one may answer one reducer without a
// group for every fragment: its exchanges do nothing.
using fragment_sync = std::function<grad_sync&(size_t f)>;

// DiLoCo's outer optimizer, a wrapper around the inner one (flat_adamw):
// it owns the global parameters and the Nesterov momentum, and at a
// boundary takes the workers' summed pseudo-gradients from a reducer
// (comm/grad_sync) and applies their average. The inner steps are the
// training_state's (training_state::train_step); this class runs after them.
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
  // The exchanges through reducers. When an exchange fails, it changed
  // nothing and nothing is in flight (the next generation redoes it).
  //
  // After the inner step that reached `at`: the flight that lands now,
  // then every fragment due, each through sync_of(f) with `control` as
  // its control words. A fragment is left in flight (overlapped) only
  // when it is the one exchange of this step and at < max_steps: a
  // boundary never leaves an exchange in flight. `each` sees every
  // exchange, landed or launched, in order.
  status after_inner_step(int64_t at, int64_t max_steps, const fragment_sync& sync_of, const std::optional<step_control>& control,
                          const std::function<void(const outer_step_result&)>& each);
  // The outer step at a boundary (due(at)), not streaming: the one
  // fragment through `sync`, without overlap; every worker then holds the
  // same parameters.
  result<outer_step_result> step(int64_t at, grad_sync& sync);
  // Fragment f's pseudo-gradient goes out on `sync`. `overlap`: left in
  // flight, it lands with land_exchange() after later inner steps;
  // otherwise it is waited for and lands now.
  result<outer_step_result> launch_exchange(size_t f, int64_t at, grad_sync& sync, bool overlap);
  // The exchange in flight lands at `at`: waited for on `sync` (its
  // fragment's reducer), then its fragment's outer step.
  result<outer_step_result> land_exchange(int64_t at, grad_sync& sync);
  // checkpoint.direct: called before an exchange changes the parameters or
  // the outer state (training_state::set_before_update). Empty: nothing.
  void set_before_update(std::function<void()> f) { before_update_ = std::move(f); }

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
  int64_t flight_window_ = 0;        // the flight's fragment's inner steps since it last synchronised
  std::function<void()> before_update_;
};

}  // namespace dtactor
