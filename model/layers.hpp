#pragma once
// Transformer building blocks shared by the three models: multi-head
// attention and a pre-LayerNorm block with optional cross-attention.
// A block can run under activation checkpointing: its activations are not
// stored but recomputed in backward (with the same dropout masks).
#include <torch/torch.h>

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

  block_options opts;
  gate_slot gate;  // train.zero = 3: gathered as one unit
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr}, ln3{nullptr};
  attention self_attn{nullptr}, cross_attn{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE_IMPL(block, block_impl);

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
