#pragma once
// train.zero = 3 for a TorchScript module (docs/zero.md): the module's own
// forward (or loss) with every call of a unit's submodule gated, so that
// its parameters are gathered right before the call and released after it
// (dtactor/param_gate.hpp). Whatever the forward does around its units
// (residuals, several inputs, branches on its attributes) it still does:
// only the units' calls are bracketed, by two operators of dtactor's
// (dtactor::unit_enter, dtactor::unit_exit) in a copy of the method's
// graph. The module itself is not changed (a saved module has none of them).
//
// Calls of a submodule that holds a unit (a container's forward, the loss
// method calling forward) are inlined first, so that a unit called at any
// depth is reached. A unit is called by its module's methods only: a graph
// reading a unit's parameter or attribute outside such a call, or handing
// the unit's module to something else (an index into a ModuleList by a
// value), is refused in one line, as is a declared unit it never calls or
// one returning anything but a tensor or a tuple of tensors.
//
// Every rank must make the same unit calls in the same order (the gathers
// are collectives): branches around a unit's call may depend on the
// module's attributes, not on the data.
#include <torch/script.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dtactor/param_gate.hpp"
#include "dtactor/result.hpp"

namespace torch::jit {
struct GraphFunction;
}

namespace dtactor {

class unit_calls {
 public:
  // `units`: the units' dotted submodule names and their slots (none
  // inside another). `method`: "forward" or another method of the module.
  static result<unit_calls> make(const torch::jit::Module& module, const std::string& method, const std::map<std::string, gate_slot*>& units);
  // Runs the method on the module with these arguments (not self).
  c10::IValue operator()(std::vector<c10::IValue> args) const;
  // The units in the order the method first calls them.
  const std::vector<std::string>& order() const { return order_; }

 private:
  torch::jit::Module module_;
  std::shared_ptr<torch::jit::GraphFunction> fn_;
  std::vector<std::string> order_;
};

}  // namespace dtactor
