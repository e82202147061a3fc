#pragma once
// Fashion-MNIST from the IDX .gz files of Debian's dataset-fashion-mnist,
// read in place (zlib), no conversion step.
#include <torch/torch.h>

#include <string>

#include "dtactor/result.hpp"

namespace dtactor {

struct image_set {
  torch::Tensor images;  // uint8 [N, rows, cols]
  torch::Tensor labels;  // int64 [N]
};

// Reads one IDX image file and its label file; checks magic numbers, counts
// and sizes. Errors name the file and what is wrong with it.
result<image_set> read_idx_pair(const std::string& images_path, const std::string& labels_path);

// split: "train" (60,000 images) or "test" (10,000).
result<image_set> load_fashion_mnist(const std::string& dir, const std::string& split);

}  // namespace dtactor
