#pragma once
// DiLoCo's outer optimizer (Douillard et al., 2023; train.sync = diloco).
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
// so after a boundary every worker holds the same parameters again. The
// global parameters, the momentum and the anchor (the step of the last
// boundary) are part of the training state ("outer/..." in the state
// stream): checkpoints, peer state, resume. The inner AdamW moments stay
// per worker.
//
// Works on the flat buffers of flat_adamw (a handful of tensor ops per
// group, not per parameter).
#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "model/flat_adamw.hpp"
#include "model/state_tensor.hpp"

namespace dtactor {

struct outer_options {
  double lr = 0.7;        // train.outer_lr
  double momentum = 0.9;  // train.outer_momentum
  int64_t every = 50;     // train.sync_every: boundaries at multiples of it (and at train.max_steps)
  int64_t max_steps = 0;  // train.max_steps
};

class outer_optimizer {
 public:
  // The global parameters start as the inner optimizer's current ones.
  outer_optimizer(flat_adamw& inner, outer_options o);

  // The step of the last boundary every worker synchronised at.
  int64_t anchor() const { return anchor_.item<int64_t>(); }
  // A boundary is due at `step`: a multiple of train.sync_every (or the
  // last step) past the anchor.
  bool due(int64_t step) const;
  // The boundary the window that holds `step` ends at.
  int64_t boundary_after(int64_t step) const;

  // Writes this worker's pseudo-gradient (global - local) into the inner
  // optimizer's gradient buffers (the reducer sums them from there) and
  // returns its 2-norm.
  double pseudo_gradients();
  // The gradient buffers hold the SUM of `workers` pseudo-gradients: the
  // Nesterov step on the global parameters, then local = global, gradients
  // zeroed, anchor = step. Returns the norm of the averaged pseudo-gradient.
  double apply(int workers, int64_t step);
  // Local parameters back to the global ones (a worker that took the state
  // of a peer mid-window starts its window over from the anchor).
  void reset_to_global();
  // Bytes of a pseudo-gradient (what each worker hands to the exchange).
  int64_t payload_bytes() const;
  // Bytes this adds to the state (global parameters and momentum).
  int64_t state_bytes() const;

  // "outer/global.<g>", "outer/momentum.<g>" per parameter group and
  // "outer/anchor" (int64[1]): live tensors, as flat_adamw::state_tensors.
  std::vector<state_tensor> state_tensors() const;

 private:
  flat_adamw& inner_;
  outer_options o_;
  std::vector<torch::Tensor> global_, momentum_;
  torch::Tensor anchor_;  // int64[1]
};

}  // namespace dtactor
