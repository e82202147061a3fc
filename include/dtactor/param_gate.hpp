#pragma once
// train.zero = 3 (docs/zero.md): each rank keeps only its shards of the
// parameters between uses, and a module's parameters are gathered from
// their holders right before the module runs. A task declares which of its
// modules are gathered together (task::param_units), in the order its
// forward runs them; each such module runs its computation through gated().
// Parameters of no unit (embeddings, a final norm, a head) stay resident.
//
// Without a gate installed (any other level, a world of one) gated() just
// calls the computation.
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace dtactor {

// What the rank installs into every unit's slot for a generation. Calls
// come in the order the model runs its units; every rank makes the same
// calls (the collectives behind them are matched across ranks).
class param_gate {
 public:
  virtual ~param_gate() = default;
  // The unit's parameters are needed now (forward); the next unit's gather
  // may start.
  virtual void before_forward(int unit) = 0;
  virtual void after_forward(int unit) = 0;
  // The unit's backward is about to run: needed again; the previous unit's
  // gather may start.
  virtual void before_backward(int unit) = 0;
  // Every part of the unit's backward that reads its parameters has run.
  virtual void after_backward(int unit) = 0;
};

// A module's place among the units: the gate of the current generation
// (null: every parameter is resident) and the module's index.
struct gate_slot {
  std::shared_ptr<param_gate> gate;
  int unit = -1;
};

// One unit as a task declares it: a name for the journal, the module's
// slot, and its parameters (each in one unit at most).
//
// `initial`, where set: the unit was built without keeping its parameters'
// values (deferred initialisation: no rank holds the whole model while it
// starts), and this makes them again, the same bits the module's own
// initialisation gives, in `params`' order, without touching the global
// generator. At train.zero = 3 a rank calls it for the units of the shards
// it holds at the job's first step; every other value comes from their
// holders. It may throw (values it cannot make again): the rank then fails
// in one line naming the unit and the exception's message.
struct param_unit {
  std::string name;
  gate_slot* slot = nullptr;
  std::vector<torch::Tensor> params;
  std::function<std::vector<torch::Tensor>()> initial;
};

// Runs f(inputs) as the slot's unit: gathered before it, released after
// it; with a graph, gathered again right before its backward and released
// once the backward reached every input that requires a gradient.
// Undefined inputs are passed through as they are.
torch::Tensor gated(const gate_slot& slot, const std::vector<torch::Tensor>& inputs,
                    const std::function<torch::Tensor(const std::vector<torch::Tensor>&)>& f);

}  // namespace dtactor
