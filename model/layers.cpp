#include "model/layers.hpp"

#include <ATen/autocast_mode.h>

#include <array>
#include <cmath>
#include <limits>

namespace dtactor {

attention_impl::attention_impl(int64_t dim_, int64_t heads_, double dropout_) : dim(dim_), heads(heads_), dropout(dropout_) {
  TORCH_CHECK(dim % heads == 0, "model.dim (", dim, ") must be divisible by model.heads (", heads, ")");
  q = register_module("q", torch::nn::Linear(dim, dim));
  kv = register_module("kv", torch::nn::Linear(dim, 2 * dim));
  out = register_module("out", torch::nn::Linear(dim, dim));
}

torch::Tensor attention_impl::forward(const torch::Tensor& q_in, const torch::Tensor& kv_in, const torch::Tensor& mask) {
  const int64_t b = q_in.size(0), t = q_in.size(1), s = kv_in.size(1), hd = dim / heads;
  auto qh = q(q_in).view({b, t, heads, hd}).transpose(1, 2);
  auto kvh = kv(kv_in).view({b, s, 2, heads, hd}).permute({2, 0, 3, 1, 4});
  auto kh = kvh[0], vh = kvh[1];
  auto scores = torch::matmul(qh, kh.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd)));
  if (mask.defined()) scores = scores + mask.to(scores.scalar_type());
  auto probs = torch::softmax(scores, -1);
  if (dropout > 0 && is_training()) probs = torch::dropout(probs, dropout, true);
  auto ctx = torch::matmul(probs, vh).transpose(1, 2).reshape({b, t, dim});
  return out(ctx);
}

namespace {
thread_local bool deferring_block_values = false;
}  // namespace

defer_block_values::defer_block_values(bool on) : was_(deferring_block_values) { deferring_block_values = on; }
defer_block_values::~defer_block_values() { deferring_block_values = was_; }
bool block_values_deferred() { return deferring_block_values; }

bool awaits_initial_values(const torch::Tensor& t) {
  if (!t.defined() || t.numel() <= 1) return false;
  for (int64_t st : t.strides())
    if (st != 0) return false;
  return true;
}

block_impl::block_impl(const block_options& o) : opts(o) {
  if (deferring_block_values) initial_rng = at::detail::getDefaultCPUGenerator().clone();
  const int64_t hidden = std::max<int64_t>(1, static_cast<int64_t>(std::llround(o.dim * o.mlp_ratio)));
  ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.dim})));
  self_attn = register_module("self_attn", attention(o.dim, o.heads, o.dropout));
  if (o.cross_attention) {
    ln3 = register_module("ln3", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.dim})));
    cross_attn = register_module("cross_attn", attention(o.dim, o.heads, o.dropout));
  }
  ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.dim})));
  fc1 = register_module("fc1", torch::nn::Linear(o.dim, hidden));
  fc2 = register_module("fc2", torch::nn::Linear(hidden, o.dim));
  if (initial_rng) {
    // One element a parameter, seen through zero strides.
    torch::NoGradGuard no_grad;
    for (auto& p : parameters()) p.set_data(torch::zeros({1}, p.options()).expand(p.sizes()));
  }
}

std::vector<torch::Tensor> block_impl::initial_values() const {
  TORCH_CHECK(initial_rng.has_value(), "initial_values: the block was not built deferred");
  const at::Generator& gen = at::detail::getDefaultCPUGenerator();
  const at::Tensor now = gen.get_state();
  at::Generator(gen).set_state(initial_rng->get_state());
  std::vector<torch::Tensor> out;
  try {
    defer_block_values off(false);
    block_impl fresh(opts);
    for (auto& p : fresh.parameters()) out.push_back(p.detach());
  } catch (...) {
    at::Generator(gen).set_state(now);
    throw;
  }
  at::Generator(gen).set_state(now);
  return out;
}

torch::Tensor block_impl::compute(const torch::Tensor& x, const torch::Tensor& self_mask, const torch::Tensor& memory,
                                  const torch::Tensor& memory_mask) {
  auto drop = [&](const torch::Tensor& t) { return opts.dropout > 0 ? torch::dropout(t, opts.dropout, is_training()) : t; };
  auto h = ln1(x);
  auto y = x + drop(self_attn(h, h, self_mask));
  if (opts.cross_attention) y = y + drop(cross_attn(ln3(y), memory, memory_mask));
  y = y + drop(fc2(torch::gelu(fc1(ln2(y)))));
  return y;
}

namespace {

// Reentrant activation checkpointing (like torch.utils.checkpoint with
// preserve_rng_state): forward runs without building a graph; backward
// restores the RNG and autocast state, recomputes with a graph and
// backpropagates through it. Parameter gradients accumulate as usual.
struct checkpoint_fn : torch::autograd::Function<checkpoint_fn> {
  // The block's four inputs, of which the undefined ones (no mask, no memory)
  // are left out of `inputs` (autograd cannot track undefined tensors);
  // bit i of `present` says whether slot i was given.
  static std::array<torch::Tensor, 4> slots(const std::vector<torch::Tensor>& inputs, int64_t present) {
    std::array<torch::Tensor, 4> out;
    size_t j = 0;
    for (int i = 0; i < 4; ++i)
      if (present & (1 << i)) out[i] = inputs[j++];
    return out;
  }

  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::TensorList inputs, int64_t present, block_impl* self) {
    auto gen = at::detail::getDefaultCPUGenerator();
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      ctx->saved_data["rng"] = gen.get_state();
    }
    ctx->saved_data["self"] = reinterpret_cast<int64_t>(self);
    ctx->saved_data["present"] = present;
    ctx->saved_data["autocast"] = at::autocast::is_cpu_enabled();
    std::vector<torch::Tensor> in(inputs.begin(), inputs.end());
    ctx->save_for_backward(in);
    torch::NoGradGuard no_grad;
    auto s = slots(in, present);
    return self->compute(s[0], s[1], s[2], s[3]);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grad_out) {
    auto* self = reinterpret_cast<block_impl*>(ctx->saved_data["self"].toInt());
    std::vector<torch::Tensor> inputs;
    for (auto& t : ctx->get_saved_variables()) {
      if (t.is_floating_point() && t.requires_grad()) {
        auto d = t.detach();
        d.set_requires_grad(true);
        inputs.push_back(d);
      } else {
        inputs.push_back(t.detach());
      }
    }
    auto gen = at::detail::getDefaultCPUGenerator();
    torch::Tensor rng_now;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      rng_now = gen.get_state();
      gen.set_state(ctx->saved_data["rng"].toTensor());
    }
    const bool prev_autocast = at::autocast::is_cpu_enabled();
    at::autocast::set_cpu_enabled(ctx->saved_data["autocast"].toBool());
    torch::Tensor out;
    {
      torch::AutoGradMode grad_on(true);
      auto s = slots(inputs, ctx->saved_data["present"].toInt());
      out = self->compute(s[0], s[1], s[2], s[3]);
    }
    at::autocast::set_cpu_enabled(prev_autocast);
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(rng_now);
    }
    torch::autograd::backward({out}, {grad_out[0]});
    torch::autograd::variable_list grads;
    for (auto& t : inputs) grads.push_back(t.requires_grad() ? t.grad() : torch::Tensor());
    grads.push_back(torch::Tensor());  // present
    grads.push_back(torch::Tensor());  // self
    return grads;
  }
};

}  // namespace

torch::Tensor block_impl::forward(const torch::Tensor& x, const torch::Tensor& self_mask, const torch::Tensor& memory,
                                  const torch::Tensor& memory_mask) {
  return gated(gate, {x, self_mask, memory, memory_mask}, [this](const std::vector<torch::Tensor>& in) {
    if (opts.checkpointed && is_training() && torch::GradMode::is_enabled()) {
      std::vector<torch::Tensor> kept;
      int64_t present = 0;
      for (int i = 0; i < 4; ++i)
        if (in[static_cast<size_t>(i)].defined()) {
          kept.push_back(in[static_cast<size_t>(i)]);
          present |= 1 << i;
        }
      return checkpoint_fn::apply(torch::TensorList(kept), present, this);
    }
    return compute(in[0], in[1], in[2], in[3]);
  });
}

std::vector<param_unit> block_units(const torch::nn::ModuleList& blocks, const std::string& prefix) {
  std::vector<param_unit> out;
  for (size_t i = 0; i < blocks->size(); ++i) {
    auto* b = blocks->ptr(i)->as<block_impl>();
    param_unit u{prefix + "." + std::to_string(i), &b->gate, b->parameters(), nullptr};
    if (b->initial_rng) u.initial = [b] { return b->initial_values(); };
    out.push_back(std::move(u));
  }
  return out;
}

torch::Tensor causal_mask(int64_t t) {
  return torch::triu(torch::full({t, t}, -std::numeric_limits<float>::infinity()), 1);
}

torch::Tensor padding_mask(const torch::Tensor& is_pad) {
  auto m = torch::zeros(is_pad.sizes(), torch::kFloat).masked_fill(is_pad, -std::numeric_limits<float>::infinity());
  return m.unsqueeze(1).unsqueeze(1);
}

torch::Tensor sinusoidal_positions(int64_t len, int64_t dim) {
  auto pos = torch::arange(len, torch::kFloat).unsqueeze(1);
  auto i = torch::arange(0, dim, 2, torch::kFloat);
  auto div = torch::exp(i * (-std::log(10000.0) / dim));
  auto pe = torch::zeros({len, dim});
  pe.index_put_({torch::indexing::Slice(), torch::indexing::Slice(0, torch::indexing::None, 2)}, torch::sin(pos * div));
  auto cosv = torch::cos(pos * div);
  pe.index_put_({torch::indexing::Slice(), torch::indexing::Slice(1, torch::indexing::None, 2)},
                cosv.index({torch::indexing::Slice(), torch::indexing::Slice(0, dim / 2)}));
  return pe;
}

}  // namespace dtactor
