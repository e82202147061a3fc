#pragma once
// The data order contract (ARCHITECTURE.md): the samples of global step t are
// a pure function of (seed, t, global batch size). Global sample position
// p = t * B + j walks through epochs e = p / N of a per-epoch permutation of
// the N samples; rank r of a world of w takes its contiguous slice of the
// step's global batch. The world size therefore never changes what a step
// learns from, only who computes it.
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace dtactor {

// Sharded data (docs/data.md, "The order"): a streaming reader cannot afford
// a permutation over every sample of the data set, which would touch every
// shard every step. With a shard layout (the samples of each shard, indices
// of shard k following those of shard k-1), epoch e instead permutes the
// shards (keyed by seed and e), cuts that sequence into blocks of
// `block_shards` consecutive shards, and permutes the samples within each
// block (keyed by seed, e and the block): positions walk through the blocks
// in turn, so a step reads from one block's shards only (two at a block
// boundary), and a reader can fetch the next block while this one trains.
// Still a pure function of (seed, position): every sample exactly once per
// epoch, whatever the world size, the faults or the restarts.
struct shard_layout {
  std::vector<int64_t> samples;  // per shard, >= 1 each
  int64_t block_shards = 1;      // >= 1
};

class data_order {
 public:
  data_order(uint64_t seed, int64_t dataset_size, int64_t global_batch);
  // Sharded: the data set's size is the sum of the layout's samples.
  data_order(uint64_t seed, shard_layout layout, int64_t global_batch);

  // All sample indices of global step t, in order.
  std::vector<int64_t> global_batch(int64_t step) const;
  // Rank r's slice of global step t's batch; slices of ranks 0..w-1 concatenate
  // to global_batch(step). Sizes differ by at most one when w does not divide B.
  std::vector<int64_t> rank_slice(int64_t step, int rank, int world) const;
  // Index of the sample at global position p (p counts samples over all steps).
  int64_t sample_at(int64_t position) const;

  int64_t dataset_size() const { return n_; }
  int64_t global_batch_size() const { return b_; }
  bool sharded() const { return !shards_.empty(); }

  // Sharded only: the shards that positions from `position` on read, block
  // by block (the whole block of `position` first), crossing into the next
  // epoch, until `count` shards are listed (or every block of two epochs).
  // What a reader should hold now and fetch next, most urgent first.
  std::vector<int64_t> shards_from(int64_t position, int64_t count) const;
  // Sharded only: the shard that holds sample index i.
  int64_t shard_of(int64_t index) const;

 private:
  // One epoch's shard sequence and its blocks (sharded only).
  struct epoch_plan {
    int64_t epoch = -1;
    std::vector<int64_t> perm;    // permuted position k -> shard
    std::vector<int64_t> prefix;  // samples before permuted position k (size S + 1)
  };
  const epoch_plan& plan_of(int64_t epoch) const;  // under mu_

  uint64_t seed_;
  int64_t n_, b_;
  std::vector<int64_t> shards_;  // samples per shard (empty: unsharded)
  std::vector<int64_t> first_;   // index of each shard's first sample (size S + 1)
  int64_t block_ = 1;
  mutable std::mutex mu_;
  mutable epoch_plan cached_;
};

// The half-open range [begin, end) of rank r's part when `total` items are
// split over `world` ranks as evenly as possible.
std::pair<int64_t, int64_t> split_range(int64_t total, int rank, int world);

}  // namespace dtactor
