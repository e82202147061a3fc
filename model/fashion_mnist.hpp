#pragma once
// Fashion-MNIST from the IDX .gz files of Debian's dataset-fashion-mnist,
// read in place, no conversion step: each file is inflated whole by
// libdeflate (its CRC32 and length checked), which takes a rank's start
// less than half the time of zlib's streaming read.
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dtactor/result.hpp"

namespace dtactor {

enum class gz_inflater {
  libdeflate,  // the whole file in one call; falls back to zlib for what it cannot take in one go
  zlib,        // streamed (gzread): any gzip file, several members included
};

// A .gz file's decompressed bytes. Errors name the file and what is wrong.
result<std::vector<uint8_t>> inflate_gz_file(const std::string& path, gz_inflater how = gz_inflater::libdeflate);

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
