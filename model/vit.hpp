#pragma once
// Vision Transformer (Dosovitskiy et al.) sized for 28x28 greyscale images:
// patch embedding, class token, learned positions, pre-LN encoder blocks.
#include <torch/torch.h>

#include "model/layers.hpp"

namespace dtactor {

struct vit_options {
  int64_t image_size = 28;
  int64_t channels = 1;
  int64_t patch = 7;
  int64_t classes = 10;
  block_options blk;
  int64_t layers = 4;
};

struct vit_impl : torch::nn::Module {
  explicit vit_impl(const vit_options& o);
  // x: float [B, C, H, W] (normalised); returns logits [B, classes].
  torch::Tensor forward(const torch::Tensor& x);

  vit_options opts;
  torch::nn::Linear patch_embed{nullptr}, head{nullptr};
  torch::Tensor cls_token, pos_embed;
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE_IMPL(vit, vit_impl);

}  // namespace dtactor
