#pragma once
// The data order contract (ARCHITECTURE.md): the samples of global step t are
// a pure function of (seed, t, global batch size). Global sample position
// p = t * B + j walks through epochs e = p / N of a per-epoch permutation of
// the N samples; rank r of a world of w takes its contiguous slice of the
// step's global batch. The world size therefore never changes what a step
// learns from, only who computes it.
#include <cstdint>
#include <vector>

namespace dtactor {

class data_order {
 public:
  data_order(uint64_t seed, int64_t dataset_size, int64_t global_batch);

  // All sample indices of global step t, in order.
  std::vector<int64_t> global_batch(int64_t step) const;
  // Rank r's slice of global step t's batch; slices of ranks 0..w-1 concatenate
  // to global_batch(step). Sizes differ by at most one when w does not divide B.
  std::vector<int64_t> rank_slice(int64_t step, int rank, int world) const;
  // Index of the sample at global position p (p counts samples over all steps).
  int64_t sample_at(int64_t position) const;

  int64_t dataset_size() const { return n_; }
  int64_t global_batch_size() const { return b_; }

 private:
  uint64_t seed_;
  int64_t n_, b_;
};

// The half-open range [begin, end) of rank r's part when `total` items are
// split over `world` ranks as evenly as possible.
std::pair<int64_t, int64_t> split_range(int64_t total, int rank, int world);

}  // namespace dtactor
