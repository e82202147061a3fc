#include "model/flat_adamw.hpp"

#include "model/adamw_kernel.hpp"

#include <cmath>
#include <limits>

namespace dtactor {

flat_adamw::flat_adamw(std::vector<torch::Tensor> params, const flat_adamw_options& o) : opts_(o) {
  torch::NoGradGuard no_grad;
  std::vector<int64_t> filled;  // per group
  for (auto& p : params) {
    if (!p.requires_grad()) continue;
    const bool decay = p.dim() >= 2;
    (decay ? decay_order_ : no_decay_order_).push_back(p);
    size_t g = 0;
    while (g < groups_.size() && !(groups_[g].decay == decay && groups_[g].params.scalar_type() == p.scalar_type())) ++g;
    if (g == groups_.size()) {
      groups_.push_back(group{decay, torch::empty({0}, p.options().requires_grad(false)), {}, {}, {}});
      filled.push_back(0);
    }
    slots_.push_back(slot{p, g, filled[g], p.numel(), {}, {}});
    filled[g] += p.numel();
  }
  for (size_t g = 0; g < groups_.size(); ++g) {
    auto& gr = groups_[g];
    const auto opts = gr.params.options();
    gr.params = torch::empty({filled[g]}, opts);
    gr.grads = torch::zeros({filled[g]}, opts);
    gr.exp_avg = torch::zeros({filled[g]}, opts);
    gr.exp_avg_sq = torch::zeros({filled[g]}, opts);
  }
  for (auto& s : slots_) {
    s.param_view = view(groups_[s.group].params, s);
    s.grad_view = view(groups_[s.group].grads, s);
  }
  rebind();
  for (auto& s : slots_) s.param.mutable_grad() = s.grad_view;
}

void flat_adamw::rebind() {
  torch::NoGradGuard no_grad;
  for (auto& s : slots_) {
    if (s.param.data_ptr() == s.param_view.data_ptr()) continue;
    s.param_view.copy_(s.param.detach());
    s.param.set_data(s.param_view);
  }
}

void flat_adamw::gather_grads() {
  // Pointer checks only (no tensor ops) when every gradient is still its view.
  torch::NoGradGuard no_grad;
  for (auto& s : slots_) {
    const auto& g = s.param.grad();
    if (g.defined() && g.data_ptr() == s.grad_view.data_ptr()) continue;
    if (g.defined())
      s.grad_view.copy_(g);
    else
      s.grad_view.zero_();
    s.param.mutable_grad() = s.grad_view;
  }
}

double flat_adamw::clip_grad_norm(double max_norm) {
  gather_grads();
  torch::NoGradGuard no_grad;
  if (groups_.empty()) return 0;
  std::vector<torch::Tensor> norms;
  for (auto& g : groups_) norms.push_back(g.grads.norm());
  auto total = norms.size() == 1 ? norms[0] : torch::stack(norms).norm();
  const double n = total.item<double>();
  if (std::isfinite(max_norm)) {
    // As clip_grad_norm_: scale by min(1, max_norm / (norm + 1e-6)).
    const double coef = max_norm / (n + 1e-6);
    if (coef < 1.0)
      for (auto& g : groups_) g.grads.mul_(coef);
  }
  return n;
}

void flat_adamw::step() {
  gather_grads();
  torch::NoGradGuard no_grad;
  ++step_;
  const double bc1 = 1 - std::pow(opts_.beta1, static_cast<double>(step_));
  const double bc2 = 1 - std::pow(opts_.beta2, static_cast<double>(step_));
  const double step_size = opts_.lr / bc1;
  for (auto& g : groups_) {
    const double wd = g.decay ? opts_.weight_decay : 0.0;
    if (g.params.scalar_type() == torch::kFloat && g.params.is_cpu()) {
      adamw_scalars k;
      k.decay_factor = static_cast<float>(1 - opts_.lr * wd);
      k.beta1 = static_cast<float>(opts_.beta1);
      k.one_minus_beta1 = static_cast<float>(1 - opts_.beta1);
      k.beta2 = static_cast<float>(opts_.beta2);
      k.one_minus_beta2 = static_cast<float>(1 - opts_.beta2);
      k.sqrt_bias_correction2 = static_cast<float>(std::sqrt(bc2));
      k.eps = static_cast<float>(opts_.eps);
      k.neg_step_size = static_cast<float>(-step_size);
      adamw_update(g.params.data_ptr<float>(), g.exp_avg.data_ptr<float>(), g.exp_avg_sq.data_ptr<float>(), g.grads.data_ptr<float>(),
                   g.params.numel(), k);
      continue;
    }
    // Other dtypes and devices: the same arithmetic as tensor ops.
    if (wd != 0) g.params.mul_(1 - opts_.lr * wd);
    g.exp_avg.mul_(opts_.beta1).add_(g.grads, 1 - opts_.beta1);
    g.exp_avg_sq.mul_(opts_.beta2).addcmul_(g.grads, g.grads, 1 - opts_.beta2);
    auto denom = (g.exp_avg_sq.sqrt() / std::sqrt(bc2)).add_(opts_.eps);
    g.params.addcdiv_(g.exp_avg, denom, -step_size);
  }
}

void flat_adamw::zero_grad() {
  gather_grads();
  for (auto& g : groups_) g.grads.zero_();
}

std::vector<std::pair<std::string, torch::Tensor>> flat_adamw::state_tensors() const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (size_t g = 0; g < groups_.size(); ++g) {
    out.emplace_back("optim/exp_avg." + std::to_string(g), groups_[g].exp_avg);
    out.emplace_back("optim/exp_avg_sq." + std::to_string(g), groups_[g].exp_avg_sq);
  }
  return out;
}

void flat_adamw::save(torch::serialize::OutputArchive& ar) const {
  ar.write("flat_adamw.version", torch::tensor(int64_t{1}));
  ar.write("flat_adamw.step", torch::tensor(step_));
  for (size_t g = 0; g < groups_.size(); ++g) {
    ar.write("flat_adamw.exp_avg." + std::to_string(g), groups_[g].exp_avg);
    ar.write("flat_adamw.exp_avg_sq." + std::to_string(g), groups_[g].exp_avg_sq);
  }
}

void flat_adamw::load(torch::serialize::InputArchive& ar) {
  torch::NoGradGuard no_grad;
  torch::Tensor version;
  if (ar.try_read("flat_adamw.version", version)) {
    TORCH_CHECK(version.item<int64_t>() == 1, "optimizer state version ", version.item<int64_t>(), " is newer than this dtactor");
    torch::Tensor st;
    ar.read("flat_adamw.step", st);
    std::vector<torch::Tensor> avg(groups_.size()), sq(groups_.size());
    for (size_t g = 0; g < groups_.size(); ++g) {
      ar.read("flat_adamw.exp_avg." + std::to_string(g), avg[g]);
      ar.read("flat_adamw.exp_avg_sq." + std::to_string(g), sq[g]);
      TORCH_CHECK(avg[g].sizes() == groups_[g].exp_avg.sizes() && sq[g].sizes() == groups_[g].exp_avg_sq.sizes(),
                  "optimizer state of parameter group ", g, " has ", avg[g].numel(), " values, the model ", groups_[g].exp_avg.numel());
    }
    for (size_t g = 0; g < groups_.size(); ++g) {
      groups_[g].exp_avg.copy_(avg[g]);
      groups_[g].exp_avg_sq.copy_(sq[g]);
    }
    step_ = st.item<int64_t>();
    return;
  }
  // torch::optim::AdamW's format (checkpoints written before the flat
  // optimizer): load it into an AdamW over stand-ins of the same shapes, in
  // the same groups, and copy its per-parameter state into the buffers.
  std::vector<torch::Tensor> decay, no_decay;
  for (auto& p : decay_order_) decay.push_back(torch::zeros_like(p).requires_grad_(true));
  for (auto& p : no_decay_order_) no_decay.push_back(torch::zeros_like(p).requires_grad_(true));
  std::vector<torch::optim::OptimizerParamGroup> pg;
  pg.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>());
  pg.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>());
  torch::optim::AdamW old(std::move(pg), torch::optim::AdamWOptions());
  old.load(ar);
  auto find = [&](const torch::Tensor& stand_in) -> torch::optim::AdamWParamState* {
    auto it = old.state().find(c10::guts::to_string(stand_in.unsafeGetTensorImpl()));
    return it == old.state().end() ? nullptr : static_cast<torch::optim::AdamWParamState*>(it->second.get());
  };
  int64_t step = 0;
  auto copy_state = [&](const std::vector<torch::Tensor>& originals, const std::vector<torch::Tensor>& stand_ins) {
    for (size_t i = 0; i < originals.size(); ++i) {
      const slot* s = nullptr;
      for (const auto& x : slots_)
        if (x.param.unsafeGetTensorImpl() == originals[i].unsafeGetTensorImpl()) s = &x;
      auto* st = find(stand_ins[i]);
      if (!s) continue;
      if (!st) {
        view(groups_[s->group].exp_avg, *s).zero_();
        view(groups_[s->group].exp_avg_sq, *s).zero_();
        continue;
      }
      TORCH_CHECK(st->exp_avg().sizes() == s->param.sizes(), "optimizer state does not fit parameter ", i);
      view(groups_[s->group].exp_avg, *s).copy_(st->exp_avg());
      view(groups_[s->group].exp_avg_sq, *s).copy_(st->exp_avg_sq());
      step = std::max(step, st->step());
    }
  };
  copy_state(decay_order_, decay);
  copy_state(no_decay_order_, no_decay);
  step_ = step;
}

}  // namespace dtactor
