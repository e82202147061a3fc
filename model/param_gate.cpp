#include "dtactor/param_gate.hpp"

#include "model/gate_steps.hpp"

namespace dtactor {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

param_gate* gate_of(AutogradContext* ctx) { return reinterpret_cast<param_gate*>(ctx->saved_data["gate"].toInt()); }

// Identity on the unit's outputs that require a gradient: one node, whose
// backward runs before any of the unit's own (they all wait for the
// outputs' gradients), so the parameters are gathered again there.
struct gather_before_backward : torch::autograd::Function<gather_before_backward> {
  static variable_list forward(AutogradContext* ctx, torch::TensorList outs, int64_t gate, int64_t unit) {
    ctx->saved_data["gate"] = gate;
    ctx->saved_data["unit"] = unit;
    return outs.vec();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    gate_of(ctx)->before_backward(static_cast<int>(ctx->saved_data["unit"].toInt()));
    grads.push_back(torch::Tensor());
    grads.push_back(torch::Tensor());
    return grads;
  }
};

// Identity on the unit's inputs that require a gradient: one node, so its
// backward runs once every gradient reaching them is complete, that is
// after every part of the unit's backward that reads a parameter (they all
// lie between the output and the inputs).
struct release_after_backward : torch::autograd::Function<release_after_backward> {
  // A TensorList, not a variable_list: autograd tracks the tensors of a
  // TensorList argument and takes a std::vector for a constant.
  static variable_list forward(AutogradContext* ctx, torch::TensorList inputs, int64_t gate, int64_t unit) {
    ctx->saved_data["gate"] = gate;
    ctx->saved_data["unit"] = unit;
    return inputs.vec();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    gate_of(ctx)->after_backward(static_cast<int>(ctx->saved_data["unit"].toInt()));
    grads.push_back(torch::Tensor());
    grads.push_back(torch::Tensor());
    return grads;
  }
};

// `ts` with those that need a gradient passed through one node of `Node`
// (with a graph; as they are without one).
template <class Node>
std::vector<torch::Tensor> through_one_node(std::vector<torch::Tensor> ts, param_gate* g, int unit) {
  if (!torch::GradMode::is_enabled()) return ts;
  std::vector<size_t> at;
  variable_list tracked;
  for (size_t i = 0; i < ts.size(); ++i)
    if (ts[i].defined() && ts[i].requires_grad()) {
      at.push_back(i);
      tracked.push_back(ts[i]);
    }
  if (tracked.empty()) return ts;
  auto out = Node::apply(torch::TensorList(tracked), reinterpret_cast<int64_t>(g), static_cast<int64_t>(unit));
  for (size_t k = 0; k < at.size(); ++k) ts[at[k]] = out[k];
  return ts;
}

}  // namespace

std::vector<torch::Tensor> gate_enter(const gate_slot& slot, std::vector<torch::Tensor> in) {
  if (!slot.gate) return in;
  slot.gate->before_forward(slot.unit);
  return through_one_node<release_after_backward>(std::move(in), slot.gate.get(), slot.unit);
}

std::vector<torch::Tensor> gate_exit(const gate_slot& slot, std::vector<torch::Tensor> outs) {
  if (!slot.gate) return outs;
  slot.gate->after_forward(slot.unit);
  return through_one_node<gather_before_backward>(std::move(outs), slot.gate.get(), slot.unit);
}

torch::Tensor gated(const gate_slot& slot, const std::vector<torch::Tensor>& inputs,
                    const std::function<torch::Tensor(const std::vector<torch::Tensor>&)>& f) {
  if (!slot.gate) return f(inputs);
  const std::vector<torch::Tensor> in = gate_enter(slot, inputs);
  torch::Tensor out;
  try {
    out = f(in);
  } catch (...) {
    slot.gate->after_forward(slot.unit);
    throw;
  }
  return gate_exit(slot, {std::move(out)})[0];
}

}  // namespace dtactor
