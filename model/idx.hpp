#pragma once
// IDX files, the format of (Fashion-)MNIST: a big-endian header (a magic
// number, then the size of each axis) followed by the bytes. The header
// checks live here, without LibTorch (the fuzz target fuzz/idx_pair.cpp
// and the tests call them); model/fashion_mnist.cpp makes the tensors.
#include <cstdint>
#include <string>
#include <vector>

#include "dtactor/result.hpp"

namespace dtactor {

struct idx_shape {
  int64_t images = 0;  // N
  int64_t rows = 0;
  int64_t cols = 0;
};

// Checks an image file (magic 0x803: N x rows x cols bytes after a 16-byte
// header) and its label file (magic 0x801: N bytes after 8), both read
// whole: magic numbers, and sizes that match the files exactly. Errors name
// the file and what is wrong with it.
result<idx_shape> check_idx_pair(const std::vector<uint8_t>& images, const std::string& images_path, const std::vector<uint8_t>& labels,
                                 const std::string& labels_path);

}  // namespace dtactor
