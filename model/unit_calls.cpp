#include "model/unit_calls.hpp"

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/library.h>

#include <set>

#include "base/printable.hpp"
#include "model/gate_steps.hpp"

namespace dtactor {

namespace {

using torch::jit::Block;
using torch::jit::Graph;
using torch::jit::Node;
using torch::jit::Value;

// The operators' `slot` is the address of the unit's gate_slot, which the
// task owns for as long as it runs the graph.
const gate_slot& slot_at(int64_t slot) { return *reinterpret_cast<const gate_slot*>(slot); }

// The unit the running graph entered and has not left yet (units are not
// nested), so that a unit whose call throws is released as gated()
// releases it.
thread_local const gate_slot* entered = nullptr;

std::vector<at::Tensor> unit_enter(int64_t slot, at::TensorList inputs) {
  auto out = gate_enter(slot_at(slot), inputs.vec());
  entered = &slot_at(slot);
  return out;
}
std::vector<at::Tensor> unit_exit(int64_t slot, at::TensorList outs) {
  entered = nullptr;
  return gate_exit(slot_at(slot), outs.vec());
}

// Registered on first use, and never unregistered. CONSERVATIVE: they act
// on the world (gathers and releases), so no pass removes, merges, folds or
// moves them.
void register_operators() {
  static torch::Library* lib = [] {
    auto* l = new torch::Library(torch::Library::DEF, "dtactor", c10::nullopt, __FILE__, __LINE__);
    l->def(torch::schema("unit_enter(int slot, Tensor[] inputs) -> Tensor[]", c10::AliasAnalysisKind::CONSERVATIVE), TORCH_FN(unit_enter));
    l->def(torch::schema("unit_exit(int slot, Tensor[] outs) -> Tensor[]", c10::AliasAnalysisKind::CONSERVATIVE), TORCH_FN(unit_exit));
    return l;
  }();
  (void)lib;
}

bool is_module(const Value* v) {
  auto ct = v->type()->cast<c10::ClassType>();
  return ct && ct->is_module();
}

std::string joined(const std::string& path, const std::string& name) { return path.empty() ? name : path + "." + name; }
bool inside(const std::string& name, const std::string& outer) {
  return outer.empty() ? !name.empty() : name.size() > outer.size() && name.compare(0, outer.size() + 1, outer + ".") == 0;
}

// One pass over a method's graph: the submodules each value is (dotted
// paths from self), the units' calls in the order they come, and the first
// call of a submodule holding a unit, to inline before the next pass.
class scan {
 public:
  scan(Value* self, const std::map<std::string, gate_slot*>& units) : units_(units) { path_[self] = ""; }

  status block(Block* b) {
    for (Node* n : b->nodes()) {
      if (auto st = node(n); !st || to_inline_) return st;
      for (Block* sub : n->blocks())
        if (auto st = block(sub); !st || to_inline_) return st;
    }
    return {};
  }
  Node* to_inline() const { return to_inline_; }
  const std::vector<std::pair<Node*, std::string>>& calls() const { return calls_; }

 private:
  // The unit `path` is or lies in ("" when none).
  std::string unit_of(const std::string& path) const {
    for (const auto& [name, slot] : units_)
      if (name == path || inside(path, name)) return name;
    return {};
  }
  bool holds_unit(const std::string& path) const {
    for (const auto& [name, slot] : units_)
      if (inside(name, path)) return true;
    return false;
  }
  status node(Node* n) {
    const bool attr = n->kind() == c10::prim::GetAttr, call = n->kind() == c10::prim::CallMethod;
    for (size_t i = 0; i < n->inputs().size(); ++i) {
      const auto it = path_.find(n->input(i));
      if (it == path_.end() || ((attr || call) && i == 0)) continue;
      if (!unit_of(it->second).empty() || holds_unit(it->second))
        return make_error("it uses the submodule '" + printable(it->second) + "' other than by calling it (" + n->kind().toQualString() +
                          "), so its units cannot be gathered around their calls");
    }
    if ((!attr && !call) || !path_.count(n->input(0))) return {};
    const std::string path = path_.at(n->input(0));
    if (attr) {
      const std::string name = joined(path, n->s(c10::attr::name));
      if (is_module(n->output())) path_[n->output()] = name;
      else if (const std::string u = unit_of(path); !u.empty())
        return make_error("it reads '" + printable(name) + "' of the unit '" + printable(u) + "' outside the unit's own calls");
      return {};
    }
    if (units_.count(path)) calls_.emplace_back(n, path);
    else if (const std::string u = unit_of(path); !u.empty())
      return make_error("it calls '" + printable(path) + "', inside the unit '" + printable(u) + "', outside the unit's own calls");
    else if (holds_unit(path)) to_inline_ = n;
    return {};
  }

  const std::map<std::string, gate_slot*>& units_;
  std::map<const Value*, std::string> path_;
  std::vector<std::pair<Node*, std::string>> calls_;  // each with its unit
  Node* to_inline_ = nullptr;
};

// Whether `t` is a tensor, or a tuple of tensors.
bool tensors(const c10::TypePtr& t) {
  if (t->isSubtypeOf(*c10::TensorType::get())) return true;
  auto tuple = t->cast<c10::TupleType>();
  if (!tuple) return false;
  for (const auto& e : tuple->elements())
    if (!e->isSubtypeOf(*c10::TensorType::get())) return false;
  return true;
}

// `values` through one of dtactor's operators (a list in, a list out);
// `*packed`: the node that reads them.
std::vector<Value*> through(Graph& g, const char* op, int64_t id, const std::vector<Value*>& values, Node** packed = nullptr) {
  Node* pack = g.insertNode(g.createList(c10::TensorType::get(), values));
  if (packed) *packed = pack;
  Value* list = pack->output();
  Value* done = g.insert(c10::Symbol::fromQualString(op), {g.insertConstant(id), list});
  Node* unpack = g.insertNode(g.createListUnpack(done, values.size()));
  return {unpack->outputs().begin(), unpack->outputs().end()};
}

// A unit's call between unit_enter (its tensor arguments) and unit_exit
// (its result: a tensor, or a tuple of tensors).
status bracket(Graph& g, Node* call, const std::string& name, const gate_slot* slot) {
  if (call->outputs().size() != 1 || !tensors(call->output()->type()))
    return make_error("the unit '" + printable(name) + "' returns " + call->output()->type()->repr_str() +
                      ": a unit returns a tensor or a tuple of tensors");
  const auto id = static_cast<int64_t>(reinterpret_cast<intptr_t>(slot));
  {
    torch::jit::WithInsertPoint before(call);
    std::vector<size_t> at;
    std::vector<Value*> ins;
    for (size_t i = 1; i < call->inputs().size(); ++i)
      if (call->input(i)->type()->isSubtypeOf(*c10::TensorType::get())) {
        at.push_back(i);
        ins.push_back(call->input(i));
      }
    const auto entered = through(g, "dtactor::unit_enter", id, ins);
    for (size_t k = 0; k < at.size(); ++k) call->replaceInput(at[k], entered[k]);
  }
  torch::jit::WithInsertPoint after(call->next());
  Value* out = call->output();
  const bool tuple = !out->type()->isSubtypeOf(*c10::TensorType::get());
  std::vector<Value*> outs{out};
  Node* first = nullptr;  // the first node reading `out`
  if (tuple) {
    first = g.insertNode(g.createTupleUnpack(out));
    outs.assign(first->outputs().begin(), first->outputs().end());
  }
  Node* packed = nullptr;
  auto exited = through(g, "dtactor::unit_exit", id, outs, &packed);
  Value* result = exited[0];
  if (tuple) result = g.insertNode(g.createTuple(exited))->output();
  out->replaceAllUsesAfterNodeWith(first ? first : packed, result);
  return {};
}

}  // namespace

result<unit_calls> unit_calls::make(const torch::jit::Module& module, const std::string& method, const std::map<std::string, gate_slot*>& units) {
  register_operators();
  auto found = module.find_method(method);
  if (!found) return make_error("the module has no " + method + " method");
  std::shared_ptr<Graph> g = torch::jit::toGraphFunction(found->function()).graph()->copy();
  std::vector<std::pair<Node*, std::string>> calls;
  for (;;) {
    scan s(g->inputs().at(0), units);
    if (auto st = s.block(g->block()); !st) return make_error("its " + method + ": " + st.message());
    if (Node* n = s.to_inline()) {
      auto ct = n->input(0)->type()->expect<c10::ClassType>();
      // Its graph as written (false: not the optimized one, whose calls are
      // all inlined already).
      torch::jit::inlineCallTo(n, &torch::jit::toGraphFunction(ct->getMethod(n->s(c10::attr::name))), false);
      continue;
    }
    calls = s.calls();
    break;
  }
  unit_calls out;
  std::set<std::string> seen;
  for (const auto& [n, name] : calls)
    if (seen.insert(name).second) out.order_.push_back(name);
  for (const auto& [name, slot] : units)
    if (!seen.count(name)) return make_error("its " + method + " never calls the unit '" + printable(name) + "'");
  for (const auto& [n, name] : calls)
    if (auto st = bracket(*g, n, name, units.at(name)); !st) return make_error("its " + method + ": " + st.message());
  out.module_ = module;
  // The simple executor: the graph as written (no profiling, fusion or
  // autodiff subgraphs moving code across the brackets), at every level.
  out.fn_ = std::make_shared<torch::jit::GraphFunction>(c10::QualifiedName("dtactor.gated_" + method), g, nullptr,
                                                        torch::jit::ExecutorExecutionMode::SIMPLE);
  return out;
}

c10::IValue unit_calls::operator()(std::vector<c10::IValue> args) const {
  args.insert(args.begin(), module_._ivalue());
  entered = nullptr;
  try {
    return (*fn_)(std::move(args));
  } catch (...) {
    if (entered && entered->gate) entered->gate->after_forward(entered->unit);
    entered = nullptr;
    throw;
  }
}

}  // namespace dtactor
