#include "model/diloco.hpp"

#include <cmath>

namespace dtactor {

outer_optimizer::outer_optimizer(flat_adamw& inner, outer_options o) : inner_(inner), o_(o) {
  torch::NoGradGuard no_grad;
  for (const auto& p : inner_.flat_params()) {
    global_.push_back(p.detach().clone());
    momentum_.push_back(torch::zeros_like(p));
  }
  anchor_ = torch::zeros({1}, torch::kInt64);
}

bool outer_optimizer::due(int64_t step) const {
  if (step <= anchor()) return false;
  return (o_.every > 0 && step % o_.every == 0) || step >= o_.max_steps;
}

int64_t outer_optimizer::boundary_after(int64_t step) const {
  int64_t b = o_.every > 0 ? (step / o_.every + 1) * o_.every : o_.max_steps;
  return std::min(b, o_.max_steps);
}

double outer_optimizer::pseudo_gradients() {
  torch::NoGradGuard no_grad;
  const auto params = inner_.flat_params();
  auto grads = inner_.flat_grads();
  double sq = 0;
  for (size_t g = 0; g < params.size(); ++g) {
    torch::sub_out(grads[g], global_[g], params[g]);
    const double n = grads[g].norm().item<double>();
    sq += n * n;
  }
  return std::sqrt(sq);
}

double outer_optimizer::apply(int workers, int64_t step) {
  torch::NoGradGuard no_grad;
  const auto params = inner_.flat_params();
  auto grads = inner_.flat_grads();
  double sq = 0;
  for (size_t g = 0; g < params.size(); ++g) {
    auto& d = grads[g];
    d.div_(static_cast<double>(std::max(1, workers)));
    const double n = d.norm().item<double>();
    sq += n * n;
    // torch.optim.SGD(momentum=mu, nesterov=True) without dampening: the
    // first step's buffer is the gradient itself, as mu * 0 + d.
    momentum_[g].mul_(o_.momentum).add_(d);
    d.add_(momentum_[g], o_.momentum);
    global_[g].sub_(d, o_.lr);
    params[g].copy_(global_[g]);
    d.zero_();
  }
  anchor_.fill_(step);
  return std::sqrt(sq);
}

void outer_optimizer::reset_to_global() {
  torch::NoGradGuard no_grad;
  const auto params = inner_.flat_params();
  for (size_t g = 0; g < params.size(); ++g) params[g].copy_(global_[g]);
}

int64_t outer_optimizer::payload_bytes() const {
  int64_t n = 0;
  for (const auto& t : global_) n += t.numel() * t.element_size();
  return n;
}

int64_t outer_optimizer::state_bytes() const { return 2 * payload_bytes(); }

std::vector<state_tensor> outer_optimizer::state_tensors() const {
  std::vector<state_tensor> out;
  for (size_t g = 0; g < global_.size(); ++g) out.push_back(state_tensor::whole("outer/global." + std::to_string(g), global_[g]));
  for (size_t g = 0; g < momentum_.size(); ++g) out.push_back(state_tensor::whole("outer/momentum." + std::to_string(g), momentum_[g]));
  out.push_back(state_tensor::whole("outer/anchor", anchor_));
  return out;
}

}  // namespace dtactor
