#pragma once
// One tensor of the training state as this process holds it: the whole
// tensor, or (train.zero >= 1) a window of a tensor whose elements the ranks
// hold in shards. The state stream (rank/state_io) is made of the logical
// tensors, the same on every rank and at every world size; each rank reads
// and writes the windows it holds.
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dtactor {

struct state_tensor {
  std::string name;
  torch::Tensor t;             // contiguous CPU: elements [first, first + t.numel()) of the logical tensor
  std::vector<int64_t> shape;  // the logical tensor's shape
  int64_t first = 0;
  bool sharded = false;  // a window (possibly empty) of a sharded tensor

  static state_tensor whole(std::string name, torch::Tensor t) {
    state_tensor s;
    s.name = std::move(name);
    s.shape.assign(t.sizes().begin(), t.sizes().end());
    s.t = std::move(t);
    return s;
  }
};

}  // namespace dtactor
