#pragma once
// Part of dtactor's public C++ API (dtactor/dtactor.hpp): sharded data for a
// task of your own. A data key may name many shard files (docs/data.md):
//   "data/train-*.csv"                 a glob in the last path component
//   "data/train-{000..127}.csv"        a range (every file must exist)
//   "a.csv, b.csv, more/c-*.csv"       a comma-separated list of the above
//   "s3://bucket/corpus/train-*.csv"   objects in S3 (globs and ranges too)
// shard_set::open resolves the key's value and reads the shards with the
// job's data.cache_dir, data.cache_bytes and data.s3_endpoint: local shards
// are mapped in place, S3 shards are fetched into a bounded cache that the
// ranks of a node share, verified against the shard index
// (dtactor-shards.json, written by `dtactor data index SPEC`) and read
// ahead on a thread of the set's own. No LibTorch here.
//
// A task that trains from shards keeps two rules (dtactor/task.hpp,
// docs/cpp_api.md "Sharded data"):
// * train_shard_samples() returns the samples of each shard in the set's
//   order (shard k's indices follow those of shard k - 1; the sum is
//   train_size()), the same on every rank: take them from records() (the
//   index, or a count of a local shard), never from a shard's parse that
//   could differ between nodes.
// * upcoming_shards(ks) hands ks to read_ahead() and lets go of every shard
//   not in ks (its shard_data and whatever was parsed from it): the engine
//   reads only those next, and the cache cannot evict a shard still held.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "dtactor/config.hpp"
#include "dtactor/result.hpp"

namespace dtactor {

// Throw it from loss_sum or evaluate when a shard cannot be read or does not
// hold what was promised (a row that does not parse, fewer records than
// counted): a data problem no restart can fix. The rank reports it as such
// and the job ends with the exception's first line (exit 1), instead of
// retrying generations. Say which shard and what to do.
struct data_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// One shard of a set, as listed.
struct shard_entry {
  std::string url;     // an absolute path, or s3://bucket/key
  uint64_t bytes = 0;  // its size
  // Its records (the samples of a .tar, the rows of a .npy, the lines of a
  // .csv, .tsv, .jsonl or .txt, a last line without a newline included) as
  // the shard index counted them, or as records(i) counted them since;
  // -1 while unknown.
  int64_t records = -1;
};

// The bytes of one shard. Valid while this handle or a copy of it lives,
// even if the cache evicts the shard's file meanwhile; a held shard is never
// evicted by read-ahead. Default-constructed: empty.
class shard_data {
 public:
  shard_data() = default;
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  std::string_view text() const { return {reinterpret_cast<const char*>(data_), size_}; }
  explicit operator bool() const { return keep_ != nullptr; }

 private:
  friend class shard_set;
  std::shared_ptr<const void> keep_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// What a set is read for: training checks that data.cache_bytes holds
// (1 + data.read_ahead_blocks) x data.shuffle_block_shards of the largest
// S3 shards (what a step reads and what is fetched ahead of it); evaluation
// reads one shard after another and needs room for two.
enum class shard_use { train, eval };

// The shards one data key names, open for reading. Not thread-safe: use it
// from the training thread (the engine calls a task from that one thread).
class shard_set {
 public:
  // Opens the shards the string key `key` names, with the job's data.*
  // settings. The value may also be one plain local file: a set of one
  // shard (sharded() is false; a shard index beside it is not consulted,
  // its records are counted). Errors are one line starting with the key: an
  // empty value, nothing matching, a missing file of a range, a shard
  // whose size differs from its index, S3 unreachable, a data.cache_bytes
  // too small for `use`.
  static result<std::unique_ptr<shard_set>> open(const config& cfg, const std::string& key, shard_use use = shard_use::train);
  ~shard_set();
  shard_set(const shard_set&) = delete;
  shard_set& operator=(const shard_set&) = delete;

  // The key and its value, as given to open.
  const std::string& key() const;
  const std::string& spec() const;
  // Whether the value names shards (a glob, a range, a list, s3://) rather
  // than one local file. A task keeps one file's behaviour (no
  // train_shard_samples, one permutation over all samples) when it is not.
  bool sharded() const;

  // The shards, sorted by url.
  size_t size() const;
  const std::vector<shard_entry>& shards() const;

  // Shard i's bytes: mapped in place when local; from the cache when in S3,
  // fetched and verified first if not there (waiting for the read-ahead
  // thread if it is fetching it). Error: one line naming the shard
  // (missing, unreadable, a size or digest other than listed or indexed).
  result<shard_data> get(size_t i);

  // The shards needed next, most urgent first (what upcoming_shards
  // receives): S3 shards among them are fetched in the background, as far
  // as data.cache_bytes allows without evicting one of them or one still
  // held. Replaces the previous hint. Local shards need nothing.
  void read_ahead(const std::vector<int64_t>& next);

  // Shard i's records: from the shard index; else, for a local shard,
  // counted by reading it (once; shards()[i].records keeps it). Errors, one
  // line naming the shard: an S3 shard the index does not count (run
  // `dtactor data index SPEC` once: nodes then know every shard's records
  // without fetching it), a kind without records (other than .tar, .npy,
  // .csv, .tsv, .jsonl, .txt), a shard that does not parse as its kind.
  result<int64_t> records(size_t i);
  // Every shard's records, in order (the first error, as above).
  result<std::vector<int64_t>> all_records();

 private:
  shard_set() = default;
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace dtactor
