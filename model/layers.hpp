#pragma once
// Transformer building blocks shared by the three models: multi-head
// attention and a pre-LayerNorm block with optional cross-attention.
// A block can run under activation checkpointing: its activations are not
// stored but recomputed in backward (with the same dropout masks).
#include <torch/torch.h>

#include <optional>
#include <string>
#include <vector>

#include "dtactor/param_gate.hpp"

namespace dtactor {

struct attention_impl : torch::nn::Module {
  attention_impl(int64_t dim, int64_t heads, double dropout);
  // q_in: [B,T,D], kv_in: [B,S,D]; mask: additive, broadcastable to [B,H,T,S]
  // (undefined = none).
  torch::Tensor forward(const torch::Tensor& q_in, const torch::Tensor& kv_in, const torch::Tensor& mask);

  int64_t dim, heads;
  double dropout;
  torch::nn::Linear q{nullptr}, kv{nullptr}, out{nullptr};
};
TORCH_MODULE_IMPL(attention, attention_impl);

struct block_options {
  int64_t dim = 64;
  int64_t heads = 4;
  double mlp_ratio = 4.0;
  double dropout = 0.0;
  bool cross_attention = false;  // decoder block of an encoder-decoder
  bool checkpointed = false;     // activation checkpointing
};

struct block_impl : torch::nn::Module {
  explicit block_impl(const block_options& o);
  // x: [B,T,D]; memory: [B,S,D] when cross_attention; masks additive.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& self_mask = {}, const torch::Tensor& memory = {},
                        const torch::Tensor& memory_mask = {});
  // The computation itself, without checkpointing.
  torch::Tensor compute(const torch::Tensor& x, const torch::Tensor& self_mask, const torch::Tensor& memory,
                        const torch::Tensor& memory_mask);

  // The values of a new block built with the generator as it was when
  // this one was (defer_block_values), in parameters() order.
  std::vector<torch::Tensor> initial_values() const;

  block_options opts;
  gate_slot gate;  // train.zero = 3: gathered as one unit
  // Built under defer_block_values: the generator as this block found it
  // (its parameters hold no values of their own).
  std::optional<at::Generator> initial_rng;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr}, ln3{nullptr};
  attention self_attn{nullptr}, cross_attn{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE_IMPL(block, block_impl);

// While one lives, the blocks this thread builds keep no parameter values
// (train.zero = 3, the rank worker: a rank then never holds the whole
// model while it starts). Each block still draws its initialisation from
// the global generator, so everything built after it gets the values it
// would have got; its parameters become zero-strided views of one element, which
// model/flat_adamw maps to pages it never touches, and block_units' units
// carry `initial` (dtactor/param_gate.hpp) to make the values again.
class defer_block_values {
 public:
  explicit defer_block_values(bool on);
  ~defer_block_values();
  defer_block_values(const defer_block_values&) = delete;
  defer_block_values& operator=(const defer_block_values&) = delete;

 private:
  bool was_;
};
// A parameter built under defer_block_values whose values are not made yet.
bool awaits_initial_values(const torch::Tensor& t);
// Whether this thread builds under defer_block_values now (a TorchScript
// module is then loaded without reading its values: model/scripted_load).
bool block_values_deferred();

// train.zero = 3: every block of `blocks` as a unit, named prefix.<i>, in
// the list's order.
std::vector<param_unit> block_units(const torch::nn::ModuleList& blocks, const std::string& prefix);

// Additive causal mask [T,T]: 0 on and below the diagonal, -inf above.
torch::Tensor causal_mask(int64_t t);
// Additive key-padding mask [B,1,1,S] from a bool tensor [B,S] (true = pad).
torch::Tensor padding_mask(const torch::Tensor& is_pad);

// Sinusoidal position encoding [len, dim] ("Attention Is All You Need").
torch::Tensor sinusoidal_positions(int64_t len, int64_t dim);

}  // namespace dtactor
