#pragma once
// AdamW over flat buffers: every parameter and every gradient is a view into
// one contiguous tensor per parameter group (weight decay or not, one dtype),
// so clipping, the optimizer step and zeroing are a handful of tensor ops per
// step instead of a handful per parameter, and the step itself is one fused
// loop over float32 CPU buffers (model/adamw_kernel). The arithmetic is
// torch::optim::AdamW's (1.13), element by element, so results match it to
// rounding; the gradient norm is summed in another order.
//
// Gradients stay views of the flat buffer as long as nobody replaces
// param.grad(): autograd accumulates into a defined gradient in place. If a
// gradient was replaced or reset (e.g. Module::zero_grad(true)), the next
// clip/step copies it back into the buffer first.
//
// Checkpoints: save() writes the flat state; load() also reads the optimizer
// section of older checkpoints, written by torch::optim::AdamW.
#include <torch/torch.h>

#include <cstdint>
#include <vector>

namespace dtactor {

struct flat_adamw_options {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
};

class flat_adamw {
 public:
  // params: the module's parameters in module order; those with dim >= 2 get
  // weight decay, the others (biases, norms, embeddings of dim 1) do not.
  // Re-points every parameter's data into the flat buffers.
  flat_adamw(std::vector<torch::Tensor> params, const flat_adamw_options& o);

  void set_lr(double lr) { opts_.lr = lr; }
  // Global 2-norm of the gradients; scales them to max_norm when above it
  // (as torch::nn::utils::clip_grad_norm_). Returns the norm before clipping.
  double clip_grad_norm(double max_norm);
  void step();
  void zero_grad();

  // After anything replaced the parameters' storage (Module::load uses set_):
  // copies their values back into the flat buffers and re-points them.
  void rebind();

  void save(torch::serialize::OutputArchive& ar) const;
  // Reads what save() wrote, or torch::optim::AdamW's own format. Throws
  // c10::Error when the state does not fit these parameters.
  void load(torch::serialize::InputArchive& ar);

  int64_t steps_taken() const { return step_; }
  void set_steps_taken(int64_t n) { step_ = n; }

  // The optimizer's state as live flat tensors, for checkpoints and state
  // transfer (written into in place when loading): "optim/exp_avg.<g>",
  // "optim/exp_avg_sq.<g>" per parameter group, in group order.
  std::vector<std::pair<std::string, torch::Tensor>> state_tensors() const;

 private:
  struct slot {
    torch::Tensor param;
    size_t group = 0;
    int64_t offset = 0, numel = 0;
    torch::Tensor param_view, grad_view;  // this parameter's place in its group's buffers
  };
  struct group {
    bool decay = false;
    torch::Tensor params, grads, exp_avg, exp_avg_sq;  // flat
  };
  torch::Tensor view(const torch::Tensor& flat, const slot& s) const { return flat.narrow(0, s.offset, s.numel).view(s.param.sizes()); }
  void gather_grads();  // grads that are not views of the buffer are copied into it

  std::vector<slot> slots_;
  std::vector<group> groups_;
  std::vector<torch::Tensor> decay_order_, no_decay_order_;  // torch::optim::AdamW's param group order (older checkpoints)
  flat_adamw_options opts_;
  int64_t step_ = 0;
};

}  // namespace dtactor
