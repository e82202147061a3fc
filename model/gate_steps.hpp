#pragma once
// gated() (dtactor/param_gate.hpp) in its two halves, for a caller that
// cannot wrap the unit's computation in a function: a TorchScript graph
// whose unit calls are bracketed by dtactor's operators (model/unit_calls).
#include <torch/torch.h>

#include <vector>

#include "dtactor/param_gate.hpp"

namespace dtactor {

// Before the unit runs: gathers its parameters (the next unit's gather may
// start) and, with a graph, returns `inputs` through one node whose
// backward releases them once every gradient reaching those inputs is
// complete. Without a gate the inputs as they are.
std::vector<torch::Tensor> gate_enter(const gate_slot& slot, std::vector<torch::Tensor> inputs);
// After it ran: releases its parameters and, with a graph, returns its
// outputs through one node whose backward gathers them again before any of
// the unit's own backward.
std::vector<torch::Tensor> gate_exit(const gate_slot& slot, std::vector<torch::Tensor> outs);

}  // namespace dtactor
