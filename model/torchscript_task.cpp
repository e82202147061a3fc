// model.name = "torchscript": a PyTorch module saved with
// torch.jit.script(module).save(PATH) (or torch.jit.trace), trained on NumPy
// .npy arrays. Two contracts, checked on a first batch when the task is
// built: forward(inputs) -> outputs with train.loss = cross_entropy | mse,
// or a `loss(inputs, targets)` method returning one loss per sample.
#include <torch/script.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <numeric>
#include <set>
#include <optional>
#include <tuple>

#include "model/sample_sources.hpp"
#include "model/unit_calls.hpp"
#include "model/scripted_load.hpp"
#include "model/layers.hpp"
#include "data/npy.hpp"
#include "data/data_shards.hpp"
#include "job/job_config.hpp"
#include "job/modes.hpp"
#include "dtactor/task.hpp"
#include "model/builtin_tasks.hpp"
#include "data/data_wait.hpp"
#include "base/printable.hpp"

namespace dtactor {

namespace {

// The scripted module's parameters and buffers, registered under their own
// dotted names (a child module per prefix), so that the engine (flat AdamW,
// checkpoints, digests, state transfer) sees them as any module's. The
// tensors are shared: the engine re-pointing a parameter's data re-points
// the scripted module's.
class scripted : public torch::nn::Module {
 public:
  explicit scripted(torch::jit::Module m) : m_(std::move(m)) {
    for (const auto& p : m_.named_parameters(true)) owner(p.name).register_parameter(leaf(p.name), p.value, p.value.requires_grad());
    for (const auto& b : m_.named_buffers(true)) owner(b.name).register_buffer(leaf(b.name), b.value);
  }
  void train(bool on = true) override {
    torch::nn::Module::train(on);
    m_.train(on);
  }
  torch::jit::Module& jit() { return m_; }

 private:
  static std::string leaf(const std::string& name) {
    const auto dot = name.rfind('.');
    return dot == std::string::npos ? name : name.substr(dot + 1);
  }
  torch::nn::Module& owner(const std::string& name) {
    torch::nn::Module* at = this;
    size_t from = 0;
    for (size_t dot = name.find('.'); dot != std::string::npos; from = dot + 1, dot = name.find('.', from)) {
      const std::string part = name.substr(from, dot - from);
      auto children = at->named_children();
      if (auto* found = children.find(part)) at = found->get();
      else at = at->register_module(part, std::make_shared<torch::nn::Module>()).get();
    }
    return *at;
  }
  torch::jit::Module m_;
};

// A unit's values read again from its file (param_unit::initial, which
// has no error channel: a file changed since the load throws, and the
// rank fails its step in that one line).
std::vector<torch::Tensor> read_all(const std::vector<file_values>& values) {
  std::vector<torch::Tensor> out;
  for (const auto& v : values) {
    auto t = v.read();
    if (!t) throw std::runtime_error(t.message());
    out.push_back(std::move(t.value()));
  }
  return out;
}

class torchscript_task : public task {
 public:
  torchscript_task(std::shared_ptr<scripted> m, std::shared_ptr<sample_source> train, std::shared_ptr<sample_source> eval, loss_kind loss,
                   bool nll)
      : m_(std::move(m)), train_(std::move(train)), eval_(std::move(eval)), loss_(loss), nll_(nll) {
    has_loss_method_ = m_->jit().find_method("loss").has_value();
    sharded_train_ = std::dynamic_pointer_cast<sharded_source>(train_);
    sharded_eval_ = std::dynamic_pointer_cast<sharded_source>(eval_);
  }

  std::vector<int64_t> train_shard_samples() const override { return sharded_train_ ? sharded_train_->per_shard() : std::vector<int64_t>{}; }
  void upcoming_shards(const std::vector<int64_t>& shards) override {
    if (sharded_train_) sharded_train_->upcoming(shards);
  }
  void upcoming_samples(const std::vector<int64_t>& indices) override {
    if (sharded_train_) sharded_train_->upcoming_samples(indices);
  }

  std::string name() const override { return "torchscript"; }
  std::shared_ptr<torch::nn::Module> module() override { return m_; }
  int64_t train_size() const override { return train_->size(); }
  int64_t eval_size() const override { return eval_->size(); }
  bool buffers_change_in_training() const override { return !m_->buffers().empty(); }
  // train.zero = 3: a scripted torch.nn.Sequential's children with
  // parameters, or the submodules a module names in its `dtactor_units`,
  // are its units, in the order its forward first calls them; the task
  // runs the module's own forward (or loss) with each unit's calls gated
  // (model/unit_calls). Any other module keeps every parameter resident.
  std::vector<param_unit> param_units() override {
    std::vector<param_unit> out;
    if (!forward_) return out;
    for (const auto& name : forward_->order()) {
      unit& u = units_.at(name);
      std::vector<torch::Tensor> params;
      for (const auto& p : u.module.parameters(true)) params.push_back(p);
      std::function<std::vector<torch::Tensor>()> initial;
      if (!u.values.empty()) initial = [values = u.values] { return read_all(values); };
      out.push_back({name, u.slot.get(), std::move(params), std::move(initial)});
    }
    return out;
  }
  bool save_scripted(const std::string& path) override {
    m_->jit().save(path);
    return true;
  }

  // Per-sample losses of a batch (shape [n]); `outputs` is set when the
  // module's forward produced them (cross-entropy metrics).
  torch::Tensor losses(const torch::Tensor& input, const torch::Tensor& y, torch::Tensor* outputs = nullptr) {
    const torch::Tensor x = in_parameter_dtype(input);
    const int64_t n = x.size(0);
    if (has_loss_method_) {
      auto l = (loss_method_ ? (*loss_method_)({x, y}) : m_->jit().get_method("loss")({x, y})).toTensor();
      TORCH_CHECK(l.dim() == 1 && l.size(0) == n, "the module's loss(inputs, targets) must return one value per sample: a tensor of shape [",
                  n, "], got ", l.sizes());
      return l.to(torch::kFloat);
    }
    auto out = forward(x).to(torch::kFloat);
    if (outputs) *outputs = out;
    if (loss_ == loss_kind::cross_entropy) {
      TORCH_CHECK(y.scalar_type() == torch::kLong, "with train.loss = cross_entropy, the targets must be integer class ids");
      if (out.dim() == 3 && y.dim() == 2) {  // sequences: [batch, positions, classes]; a sample's loss is its positions' mean
        TORCH_CHECK(out.size(0) == n && out.size(1) == y.size(1), "forward returned ", out.sizes(), " for targets of shape ", y.sizes());
        const int64_t t = out.size(1);
        return torch::nn::functional::cross_entropy(out.reshape({n * t, out.size(2)}), y.reshape({n * t}),
                                                    torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone))
            .reshape({n, t})
            .mean(1);
      }
      TORCH_CHECK(out.dim() == 2 && out.size(0) == n && y.dim() == 1,
                  "with train.loss = cross_entropy, forward must return [batch, classes] scores (or [batch, positions, classes] for sequences), got ",
                  out.sizes());
      return torch::nn::functional::cross_entropy(out, y, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
    }
    auto t = y.to(torch::kFloat);
    TORCH_CHECK(out.sizes() == t.sizes(), "with train.loss = mse, forward's output ", out.sizes(), " must have the targets' shape ", t.sizes());
    return (out - t).pow(2).reshape({n, -1}).mean(1);
  }

  torch::Tensor loss_sum(const std::vector<int64_t>& indices) override {
    torch::Tensor x, y;
    {
      data_wait_timer data;
      std::tie(x, y) = train_->batch(indices);
    }
    return losses(x, y).sum();
  }

  eval_result evaluate(int64_t max_samples, int64_t batch_size) override {
    const int64_t n = max_samples > 0 ? std::min(max_samples, eval_size()) : eval_size();
    double loss = 0;
    double correct_f = 0, top5_f = 0;
    int64_t classes = 0;
    for (int64_t i = 0; i < n; i += batch_size) {
      const int64_t e = std::min(n, i + batch_size);
      std::vector<int64_t> rows;
      for (int64_t k = i; k < e; ++k) rows.push_back(k);
      if (sharded_eval_) sharded_eval_->read_ahead_from(i, 2);  // this batch's shard and the next
      auto [x, y] = eval_->batch(rows);
      torch::Tensor out;
      loss += losses(x, y, &out).sum().item<double>();
      if (out.defined() && loss_ == loss_kind::cross_entropy) {
        // Sequences count every position (token accuracy), averaged per sample.
        auto scores = out.dim() == 3 ? out : out.unsqueeze(1);
        auto targets = y.dim() == 2 ? y : y.unsqueeze(1);
        classes = scores.size(2);
        const double positions = static_cast<double>(targets.size(1));
        correct_f += scores.argmax(2).eq(targets).to(torch::kDouble).sum().item<double>() / positions;
        if (classes > 5) top5_f += std::get<1>(scores.topk(5, 2)).eq(targets.unsqueeze(2)).any(2).to(torch::kDouble).sum().item<double>() / positions;
      }
    }
    if (sharded_eval_) sharded_eval_->hold_only({});
    eval_result r;
    if (n == 0) return r;
    r.metrics["val_loss"] = loss / static_cast<double>(n);
    if (!has_loss_method_ && loss_ == loss_kind::cross_entropy) {
      r.metrics["accuracy"] = correct_f / static_cast<double>(n);
      if (classes > 5) r.metrics["top5_accuracy"] = top5_f / static_cast<double>(n);
    }
    if (nll_) r.metrics["perplexity"] = std::exp(r.metrics["val_loss"]);
    return r;
  }

  // The units, from a Sequential's children or the module's declared
  // `dtactor_units`, and the module's forward (and loss) gating their
  // calls: one clear line when a declared name is no submodule, is named
  // twice or lies inside another, or when the forward does not call the
  // units as units (model/unit_calls).
  status find_units(const std::string& file) {
    const std::string in_file = "model.file '" + printable(file, 0) + "': ";
    auto names = unit_names();
    if (!names) return make_error(in_file + names.message());
    std::map<std::string, gate_slot*> slots;
    std::map<std::string, torch::jit::Module> modules;
    for (const auto& m : m_->jit().named_modules()) modules.emplace(m.name, m.value);
    for (const auto& name : names.value()) {
      const torch::jit::Module& m = modules.at(name);
      if (m.parameters(true).size() == 0) continue;  // nothing to gather
      unit& u = units_[name];
      u.module = m;
      u.slot = std::make_unique<gate_slot>();
      slots[name] = u.slot.get();
    }
    if (slots.empty()) return {};
    auto fwd = unit_calls::make(m_->jit(), "forward", slots);
    if (!fwd) return make_error(in_file + fwd.message());
    forward_ = std::move(fwd.value());
    if (has_loss_method_) {
      auto loss = unit_calls::make(m_->jit(), "loss", slots);
      if (!loss) return make_error(in_file + loss.message());
      loss_method_ = std::move(loss.value());
    }
    return {};
  }
  // Loaded mapped (model/scripted_load): each unit's parameters keep no
  // values (zero-strided, as model/layers' deferred blocks: model/flat_adamw
  // maps them to pages nobody touches), and the unit's `initial` reads
  // their values from the file again (a rank calls it only for the units
  // its shards reach). Nothing keeps a view of the mapping for them, so
  // the file is unmapped once the optimizer took the other parameters in.
  status defer_unit_values(const std::string& file) {
    torch::NoGradGuard no_grad;
    for (auto& [name, u] : units_)
      for (const auto& p : u.module.parameters(true)) {
        auto where = file_values::of(p);
        if (!where) return make_error("model.file '" + printable(file, 0) + "': unit " + name + " has a parameter outside the file's mapping");
        u.values.push_back(std::move(*where));
        if (p.numel() > 1) p.set_data(torch::zeros({1}, p.options()).expand(p.sizes()));
      }
    return {};
  }

 private:
  struct unit {
    torch::jit::Module module;
    std::unique_ptr<gate_slot> slot;
    std::vector<file_values> values;  // loaded mapped: where its parameters' values lie in the file
  };
  // A Sequential's children, or the names the module declares.
  result<std::vector<std::string>> unit_names() {
    const auto type = m_->jit().type()->name();
    const std::string qn = type ? type->qualifiedName() : "";
    const bool sequential = qn.rfind("__torch__.torch.nn.modules.container.", 0) == 0 && qn.size() >= 11 && qn.compare(qn.size() - 11, 11, ".Sequential") == 0;
    std::vector<std::string> seen;
    if (sequential) {
      for (const auto& c : m_->jit().named_children()) seen.push_back(c.name);
      return seen;
    }
    if (!m_->jit().hasattr("dtactor_units")) return seen;
    const std::string what = "dtactor_units ";
    const c10::IValue names = m_->jit().attr("dtactor_units");
    if (!names.isList() || names.toListRef().empty()) return make_error(what + "must be a non-empty list of submodule names (List[str])");
    std::set<std::string> modules;
    for (const auto& m : m_->jit().named_modules())
      if (!m.name.empty()) modules.insert(m.name);
    for (const auto& v : names.toListRef()) {
      if (!v.isString()) return make_error(what + "must be a list of submodule names (List[str])");
      const std::string& name = v.toStringRef();
      if (!modules.count(name)) return make_error(what + "names '" + printable(name) + "', which is no submodule of the module");
      for (const auto& other : seen)
        if (other == name || inside(name, other) || inside(other, name))
          return make_error(what + "names '" + printable(other) + "' and '" + printable(name) + "': a unit is named once and lies in no other");
      seen.push_back(name);
    }
    return seen;
  }
  static bool inside(const std::string& name, const std::string& outer) { return name.size() > outer.size() && name.compare(0, outer.size() + 1, outer + ".") == 0; }
  // Floating-point inputs in the dtype of the module's parameters (bf16
  // under train.precision = bf16).
  torch::Tensor in_parameter_dtype(const torch::Tensor& x) {
    if (!x.is_floating_point()) return x;
    for (const auto& p : m_->jit().parameters(true))
      if (p.is_floating_point()) return p.scalar_type() == x.scalar_type() ? x : x.to(p.scalar_type());
    return x;
  }
  // The module's forward, with its units' calls gated where it has units.
  torch::Tensor forward(const torch::Tensor& x) { return (forward_ ? (*forward_)({x}) : m_->jit().forward({x})).toTensor(); }
  std::map<std::string, unit> units_;
  std::optional<unit_calls> forward_, loss_method_;  // with units only
  std::shared_ptr<scripted> m_;
  std::shared_ptr<sample_source> train_, eval_;
  loss_kind loss_;
  bool nll_ = false, has_loss_method_ = false;
  std::shared_ptr<sharded_source> sharded_train_, sharded_eval_;
};

// The .npy array at `path`, which `key` names.
result<npy_array> open_array(const std::string& key, const std::string& path) {
  if (path.empty()) return make_error(key + " is not set (model.name = torchscript trains on .npy arrays: set data.train_inputs and data.train_targets)");
  auto a = npy_array::open(path);
  if (!a) return make_error(key + ": " + a.message());
  return a;
}

// A task's training and held-out samples.
struct split_sources {
  std::shared_ptr<sample_source> train, eval;
};

// model.file, loaded; `mapped`: without reading its values where the file
// allows it (model/scripted_load), with `*was_mapped` saying whether it
// did. Errors name the file: missing, not TorchScript, no forward.
result<torch::jit::Module> load_module(const std::string& file, bool mapped, bool* was_mapped) {
  if (file.empty()) return make_error("model.name = torchscript needs model.file, a file written by torch.jit.script(module).save(PATH)");
  std::error_code ec;
  if (!std::filesystem::is_regular_file(file, ec)) return make_error("model.file '" + file + "' does not exist (or is not a file)");
  torch::jit::Module jm;
  *was_mapped = false;
  if (mapped) {
    auto m = load_mapped(file);
    if (!m) return m.err();
    if (m.value()) {
      jm = std::move(*m.value());
      *was_mapped = true;
    }
  }
  try {
    if (!*was_mapped) jm = torch::jit::load(file);
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    return make_error("model.file '" + file + "' is not a TorchScript file torch::jit::load can read: " + what.substr(0, what.find('\n')));
  }
  if (!jm.find_method("forward")) return make_error("model.file '" + file + "': the module has no forward method");
  return jm;
}

// The held-out share of a source: its last samples (at least one, and at
// least one left to train on).
result<split_sources> hold_out(std::shared_ptr<sample_source> all, double val_fraction) {
  const int64_t n = all->size();
  const int64_t held =
      std::clamp<int64_t>(static_cast<int64_t>(std::llround(val_fraction * static_cast<double>(n))), n > 1 ? 1 : 0, std::max<int64_t>(0, n - 1));
  if (n - held < 1) return make_error("no training samples left after data.val_fraction");
  return split_sources{std::make_shared<subset_source>(all, 0, n - held), std::make_shared<subset_source>(all, n - held, held)};
}

// nanoGPT's .bin token streams (data.train_tokens, data.eval_tokens): a
// sample is a window of model.context + 1 tokens. Training takes every start
// position; evaluation windows side by side.
result<split_sources> open_token_sources(const model_settings& m, const data_settings& d) {
  const int64_t context = m.context;
  const auto vocab = static_cast<uint32_t>(m.vocab_size);
  auto open_tokens = [&](const std::string& key, const std::string& path) -> result<std::shared_ptr<token_file>> {
    auto f = token_file::open(path, vocab, static_cast<uint64_t>(context) + 2);
    if (!f) return make_error(key + ": " + f.message());
    return std::make_shared<token_file>(std::move(f.value()));
  };
  auto tf = open_tokens("data.train_tokens", d.train_tokens);
  if (!tf) return tf.err();
  if (!d.eval_tokens.empty()) {
    auto ef = open_tokens("data.eval_tokens", d.eval_tokens);
    if (!ef) return ef.err();
    return split_sources{std::make_shared<token_source>(tf.value(), context, 1, 0, static_cast<int64_t>(tf.value()->size()) - context),
                         std::make_shared<token_source>(ef.value(), context, context, 0, (static_cast<int64_t>(ef.value()->size()) - 1) / context)};
  }
  // Held out: the stream's last share, cut at a window boundary so no
  // evaluation token is ever trained on.
  const int64_t n = static_cast<int64_t>(tf.value()->size());
  const double val_fraction = d.val_fraction;
  const int64_t cut = n - std::max<int64_t>(context + 1, static_cast<int64_t>(std::llround(val_fraction * static_cast<double>(n))));
  if (cut < context + 1) return make_error("data.train_tokens: too few tokens to hold out data.val_fraction and still train");
  return split_sources{std::make_shared<token_source>(tf.value(), context, 1, 0, cut - context),
                       std::make_shared<token_source>(tf.value(), context, context, cut, (n - cut - 1) / context)};
}

// .npy arrays (data.train_inputs/targets, data.eval_inputs/targets), each
// pair with the same first axis; without eval arrays, data.val_fraction of
// the training ones is held out.
result<split_sources> open_array_sources(const data_settings& d) {
  auto tin = open_array("data.train_inputs", d.train_inputs);
  if (!tin) return tin.err();
  auto ttg = open_array("data.train_targets", d.train_targets);
  if (!ttg) return ttg.err();
  if (tin->rows() != ttg->rows())
    return make_error("data.train_inputs has " + std::to_string(tin->rows()) + " samples ('" + tin->path() + "'), data.train_targets " +
                      std::to_string(ttg->rows()) + " ('" + ttg->path() + "'): they must have the same first axis");
  auto all = std::make_shared<array_source>(std::move(tin.value()), std::move(ttg.value()));
  if (d.eval_inputs.empty() && d.eval_targets.empty()) {
    if (all->size() < 2) return make_error("data.train_inputs has fewer than 2 samples: nothing to hold out for evaluation");
    return hold_out(all, d.val_fraction);
  }
  auto a = open_array("data.eval_inputs", d.eval_inputs);
  if (!a) return a.err();
  auto b = open_array("data.eval_targets", d.eval_targets);
  if (!b) return b.err();
  if (a->rows() != b->rows())
    return make_error("data.eval_inputs has " + std::to_string(a->rows()) + " samples, data.eval_targets " + std::to_string(b->rows()) +
                      ": they must have the same first axis");
  return split_sources{all, std::make_shared<array_source>(std::move(a.value()), std::move(b.value()))};
}

// The task's data: one of three kinds (tar shards, token streams, arrays),
// sharded when a key names shards.
result<split_sources> open_sources(const model_settings& m, const data_settings& d) {
  const bool tokens = !d.train_tokens.empty();
  const bool tars = !d.train_shards.empty();
  auto sharded_key = [](std::initializer_list<const std::string*> specs) {
    for (const std::string* spec : specs)
      if (names_shards(*spec)) return true;
    return false;
  };
  if (tars + tokens + !d.train_inputs.empty() > 1)
    return make_error("set one of data.train_shards, data.train_tokens and data.train_inputs/data.train_targets: they are three kinds of data");
  std::optional<result<sharded_split>> sharded;
  if (tars) sharded = open_tar_shards(d);
  else if (tokens && sharded_key({&d.train_tokens, &d.eval_tokens})) sharded = open_token_shards(m, d);
  else if (!tokens && sharded_key({&d.train_inputs, &d.train_targets, &d.eval_inputs, &d.eval_targets})) sharded = open_npy_shards(d);
  if (sharded) {
    if (!*sharded) return sharded->err();
    return split_sources{sharded->value().train, sharded->value().eval};
  }
  return tokens ? open_token_sources(m, d) : open_array_sources(d);
}

// The contract, on a first batch of two samples: one clear line when the
// module and the data do not fit each other. In evaluation mode, so that
// the check changes nothing (a BatchNorm's running statistics stay the
// file's).
status check_first_batch(torchscript_task& t, const std::string& file) {
  struct evaluating {
    torch::nn::Module& m;
    bool was = m.is_training();
    ~evaluating() { m.train(was); }
  } mode{*t.module()};
  mode.m.eval();
  try {
    torch::NoGradGuard no_grad;
    std::vector<int64_t> first{0};
    if (t.train_size() > 1) first.push_back(1);
    auto l = t.loss_sum(first);
    if (!l.defined() || l.numel() != 1 || !std::isfinite(l.item<double>()))
      return make_error("model.file '" + file + "': the loss of a first batch is not one finite value");
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    return make_error("model.file '" + file + "' does not fit the data: " + what.substr(0, what.find('\n')));
  } catch (const std::exception& e) {
    std::string what = e.what();
    return make_error("model.file '" + file + "' does not fit the data: " + what.substr(0, what.find('\n')));
  }
  return {};
}

}  // namespace

result<std::unique_ptr<task>> make_torchscript_task(const config& cfg) {
  auto s = job_settings_of(cfg);
  if (!s) return s.err();
  return make_torchscript_task(s.value());
}

result<std::unique_ptr<task>> make_torchscript_task(const job_settings& s) {
  const std::string& file = s.model.file;
  // Built deferred (train.zero = 3, bf16 masters sharded): no rank reads
  // the whole module while it starts.
  bool mapped = false;
  auto jm = load_module(file, block_values_deferred(), &mapped);
  if (!jm) return jm.err();
  auto data = open_sources(s.model, s.data);
  if (!data) return data.err();
  auto m = std::make_shared<scripted>(std::move(jm.value()));
  auto t = std::make_unique<torchscript_task>(m, data->train, data->eval, s.modes.loss, s.train.loss_is_nll);
  if (t->train_size() < 1) return make_error("no training samples");
  if (auto st = t->find_units(file); !st) return st.err();
  if (mapped)
    if (auto st = t->defer_unit_values(file); !st) return st.err();
  if (auto st = check_first_batch(*t, file); !st) return st.err();
  return std::unique_ptr<task>(std::move(t));
}

}  // namespace dtactor
