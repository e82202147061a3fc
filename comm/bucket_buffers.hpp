#pragma once
// The gradient reducer's bucket buffers, kept from one generation's reducer
// to the next. A new reducer (grad_sync) would otherwise allocate and zero
// a buffer as large as the gradients (4 bytes a parameter: 808 MB for the
// 202M GPT), faulting every page in while the other ranks wait for its
// first step; the buckets of a reducer over the same parameters with the
// same bucket size are the same, so it takes the last one's instead. A
// warm rank fills it before its first plan (bucket_buffers_for), so that a
// joining rank's reducer faults nothing in either.
//
// Every element of a bucket is written before each exchange (a gradient,
// zeros for a parameter without one, the control words), so what a taken
// buffer held is never read. A buffer is only taken when nothing else
// references its storage: a collective of an abandoned step that may
// still write into it (its process group parked, rank/generation.hpp)
// holds a reference, and such a buffer is left to the allocator.
#include <torch/torch.h>

#include <cstdint>
#include <mutex>
#include <vector>

namespace dtactor {

class bucket_buffers {
 public:
  // A buffer a reducer no longer needs.
  void give(torch::Tensor t);
  // A given buffer of n elements of o's dtype that nobody else references
  // (removed from here); undefined when there is none.
  torch::Tensor take(int64_t n, const torch::TensorOptions& o);
  // Drops what no reducer took (the layout changed, or no reducer this
  // generation: a world of one).
  void clear();
  int64_t bytes() const;
  // Of bytes(), those take() could hand out now (a finished collective's
  // thread lets go of its inputs a moment after the wait for it returned).
  int64_t takeable_bytes() const;

 private:
  mutable std::mutex mu_;
  std::vector<torch::Tensor> free_;
};

}  // namespace dtactor
