#pragma once
// Where a task's samples come from, as batches of tensors (docs/data.md):
// rows of .npy arrays, windows of a token stream, and the sharded sources
// (token shards, WebDataset-style tar shards, .npy shard pairs) read through
// a shard_reader. The torchscript task and the built-in ViT use them.
#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "dtactor/config.hpp"
#include "dtactor/result.hpp"
#include "data/data_shards.hpp"
#include "data/npy.hpp"
#include "job/settings.hpp"

namespace dtactor {

class sample_source {
 public:
  virtual ~sample_source() = default;
  virtual int64_t size() const = 0;
  // Inputs and targets of these samples, stacked on a first axis.
  virtual std::pair<torch::Tensor, torch::Tensor> batch(const std::vector<int64_t>& rows) const = 0;
};

// Rows of an .npy array as a batch tensor: floating dtypes as float32,
// integers as int64, bools as bool.
torch::Tensor rows_of(const npy_array& a, const std::vector<int64_t>& idx);

class array_source : public sample_source {
 public:
  array_source(npy_array in, npy_array tg) : in_(std::move(in)), tg_(std::move(tg)) {}
  int64_t size() const override { return in_.rows(); }
  std::pair<torch::Tensor, torch::Tensor> batch(const std::vector<int64_t>& rows) const override { return {rows_of(in_, rows), rows_of(tg_, rows)}; }

 private:
  npy_array in_, tg_;
};

// Windows of one token stream: sample i starts at position first + i * stride
// (inputs: `context` tokens, targets: the same shifted by one).
class token_source : public sample_source {
 public:
  token_source(std::shared_ptr<token_file> f, int64_t context, int64_t stride, int64_t first, int64_t count)
      : f_(std::move(f)), context_(context), stride_(stride), first_(first), count_(count) {}
  int64_t size() const override { return count_; }
  std::pair<torch::Tensor, torch::Tensor> batch(const std::vector<int64_t>& rows) const override;

 private:
  std::shared_ptr<token_file> f_;
  int64_t context_, stride_, first_, count_;
};

// A subset of a source's samples (the held-out share of one source).
class subset_source : public sample_source {
 public:
  subset_source(std::shared_ptr<sample_source> s, int64_t from, int64_t count) : s_(std::move(s)), from_(from), count_(count) {}
  int64_t size() const override { return count_; }
  std::pair<torch::Tensor, torch::Tensor> batch(const std::vector<int64_t>& rows) const override;

 private:
  std::shared_ptr<sample_source> s_;
  int64_t from_, count_;
};

// Samples of shards read through a shard_reader. Logical shard k (the
// engine's shard index, docs/data.md "The order") is one shard of the
// reader, or two (an .npy pair: inputs and targets); its samples follow
// those of shard k - 1. A shard that cannot be read, or whose contents do
// not match what was promised (sample counts, token ids, shapes), throws
// data_error with one line naming it.
class sharded_source : public sample_source {
 public:
  sharded_source(std::shared_ptr<shard_reader> reader, std::vector<std::vector<size_t>> ids, std::vector<int64_t> per_shard);
  int64_t size() const override { return first_.back(); }
  const std::vector<int64_t>& per_shard() const { return per_shard_; }
  // The reader's shards behind these logical shards, in order.
  std::vector<size_t> reader_ids(const std::vector<int64_t>& ks) const;
  // Before a step: the reader fetches these logical shards ahead (most
  // urgent first); mappings of shards not among them are let go.
  void upcoming(const std::vector<int64_t>& ks);
  // Evaluation, reading from `row` on: the reader fetches the next `count`
  // shards ahead; hold_only({}) afterwards lets them all go.
  void read_ahead_from(int64_t row, int64_t count);
  void hold_only(const std::vector<int64_t>& ks);
  // Reads (and checks) logical shard k now: an error is returned, not thrown.
  status open_shard(int64_t k);
  // The samples this rank's next step will most likely ask for: a source
  // whose samples cost time to decode prepares them on a thread of its own
  // (batch() gives the same either way). Default: nothing.
  virtual void upcoming_samples(const std::vector<int64_t>& indices) { (void)indices; }

 protected:
  // (logical shard, sample within it) of sample i.
  std::pair<int64_t, int64_t> locate(int64_t i) const;
  // Reader shard `part` of logical shard k, held until hold_only drops k;
  // check_shard runs the first time this process reads a reader shard.
  // Thread-safe: the pointer keeps the bytes valid even if hold_only lets
  // them go meanwhile.
  std::shared_ptr<const shard_bytes> bytes_ptr(int64_t k, size_t part = 0) const;
  const shard_bytes& bytes(int64_t k, size_t part = 0) const { return *bytes_ptr(k, part); }
  virtual void check_shard(int64_t k, size_t part, const shard_bytes& b) const {
    (void)k, (void)part, (void)b;
  }
  // Drops what a subclass derived from logical shard k (hold_only let it go).
  virtual void released(int64_t k) const { (void)k; }
  const std::string& url(int64_t k, size_t part = 0) const;

  std::shared_ptr<shard_reader> reader_;
  std::vector<std::vector<size_t>> ids_;
  std::vector<int64_t> per_shard_, first_;
  mutable std::mutex mu_;  // held_, checked_, and what subclasses derive per shard (released() runs under it)
  mutable std::map<std::pair<int64_t, size_t>, std::shared_ptr<const shard_bytes>> held_;
  mutable std::set<size_t> checked_;
};

// A source and the shard reader behind it, for the train and eval splits.
struct sharded_split {
  std::shared_ptr<sharded_source> train, eval;
  std::shared_ptr<shard_reader> reader;
};

// data.train_tokens / data.eval_tokens as shards of uint16 token ids
// (windows of model.context + 1 tokens; training at every position,
// evaluation side by side).
result<sharded_split> open_token_shards(const model_settings& m, const data_settings& d);
// data.train_shards / data.eval_shards: WebDataset-style tar shards; the
// input of a sample is its first member among data.shard_inputs, the
// target its first among data.shard_targets (images decoded to float
// [channels, height, width] in [0, 1], .npy arrays as they are, .cls class
// ids as int64).
result<sharded_split> open_tar_shards(const data_settings& d);
// data.train_inputs / data.train_targets (and the eval keys) as shards of
// .npy arrays, paired in order: the k-th input shard and the k-th target
// shard hold the same number of rows.
result<sharded_split> open_npy_shards(const data_settings& d);

}  // namespace dtactor
