#pragma once
// Sharded data sets (issue 29, docs/data.md): a data key names many shard
// files, locally (a glob or a list) or in S3 (s3://bucket/prefix/train-*.bin),
// and each process reads them through a shard_reader: local shards are
// mapped in place (the page cache is their cache), S3 shards are fetched
// whole into a bounded local cache directory shared by the ranks of a node,
// verified, and read ahead on a thread of its own. No LibTorch here.
#include <atomic>
#include <condition_variable>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "dtactor/result.hpp"
#include "dtactor/shards.hpp"
#include "storage/fs.hpp"

namespace dtactor {

class object_store;

struct shard_info {
  std::string url;     // absolute path, or s3://bucket/key
  uint64_t bytes = 0;  // from the listing (or stat)
  // "<bytes>:<xxh3 hex>" (the form of file_digest) from the shard index
  // (dtactor-shards.json beside the shards); empty when there is no index.
  std::string digest;
  // Records in the shard as `dtactor data index` counted them (the samples
  // of a .tar, the rows of a .npy, the lines of a .csv/.tsv/.jsonl/.txt;
  // data/webdataset.hpp), from the index; -1 when unknown.
  int64_t records = -1;
};

// The name of the index file `dtactor data index` writes beside the shards.
inline constexpr const char* shard_index_name = "dtactor-shards.json";

// Whether a data key's value names shards (a glob, a list, braces, s3://)
// rather than one local file.
bool names_shards(const std::string& spec);

// Resolves a data key's value into its shards, sorted by url:
//   - "data/train-*.bin": a glob (*, ?, [...]) in the last path component;
//   - "data/train-{000..127}.bin": a zero-padded range (every file must exist);
//   - "a.bin,b.bin,data/c-*.bin": a comma-separated list of the above;
//   - "s3://bucket/corpus/train-*.bin" (also with {..} ranges): listed from S3,
//     credentials as the checkpoint store finds them, `s3_endpoint` else
//     AWS_ENDPOINT_URL.
// Relative local paths are taken from the working directory. When the
// directory (or S3 prefix) holds dtactor-shards.json, every shard must be in
// it with the listed size, and gets its digest from it. Errors are one line
// naming the spec: no match, a missing file of a range, a size that differs
// from the index, an unreadable index.
result<std::vector<shard_info>> resolve_shards(const std::string& spec, const std::string& s3_endpoint = "");

// One digest of a whole shard set (urls, sizes and index digests), for the
// cross-node data check: "<shards>x<total bytes>:<xxh3 hex>".
std::string shard_set_digest(const std::vector<shard_info>& shards);

// `dtactor data index SPEC`: reads every shard once and writes
// dtactor-shards.json (name, bytes, xxh3) into each directory / S3 prefix
// the shards are in. Returns how many shards were indexed. An index already
// there keeps its entries for other files still present with their size
// (indexing train-* and then val-* of one directory leaves both indexed).
// `on_index` (optional) hears of each index written: where it is, how many
// shards of this spec it took and their bytes.
using shard_index_written = std::function<void(const std::string& index_url, size_t shards, uint64_t bytes)>;
result<size_t> write_shard_index(const std::string& spec, const std::string& s3_endpoint = "", const shard_index_written& on_index = {});

// The entries of a dtactor-shards.json (bytes of the file, as read), by
// shard name: {"version":1,"shards":[{"name":N,"bytes":B,"xxh3":"<16 hex>"}]}.
// Error: one line saying what is malformed (`where` names the file).
// Outside bytes: fuzz/shard_index.cpp drives it.
struct shard_index_entry {
  uint64_t bytes = 0;
  std::string digest;  // "<bytes>:<xxh3 hex>"
  int64_t records = -1;  // "records", when the index counted them
};
result<std::map<std::string, shard_index_entry>> parse_shard_index(const std::string& text, const std::string& where);

struct shard_cache_options {
  std::string cache_dir;       // data.cache_dir (empty: $TMPDIR/dtactor-data-cache)
  uint64_t cache_bytes = 0;    // data.cache_bytes: the most the cache directory holds
  std::string s3_endpoint;     // data.s3_endpoint
};

// What a reader did, for the journal and Prometheus (monotonic counters
// except the gauges).
struct shard_reader_stats {
  uint64_t bytes_read_local = 0;   // bytes of local shards mapped and touched
  uint64_t bytes_read_s3 = 0;      // bytes fetched from S3
  uint64_t cache_hits = 0;         // get() found the shard ready (mapped, or in the cache)
  uint64_t cache_misses = 0;       // get() had to wait for a fetch
  uint64_t shards_verified = 0;    // fetched shards whose size and digest matched
  uint64_t shards_failed = 0;      // fetches that failed or did not verify
  uint64_t read_ahead_depth = 0;   // gauge: shards queued or in flight on the read-ahead thread
  uint64_t cache_used_bytes = 0;   // gauge: bytes in the cache directory now
  uint64_t cache_peak_bytes = 0;   // the most seen in it
};

// The bytes of one shard, valid while the shared_ptr lives (even if the
// cache evicts the file meanwhile).
class shard_bytes {
 public:
  virtual ~shard_bytes() = default;
  virtual const uint8_t* data() const = 0;
  virtual size_t size() const = 0;
};

class shard_reader {
 public:
  // Checks the options (cache_bytes must hold the two largest shards when
  // any shard is remote: one being read, one being fetched); creates the
  // cache directory. Nothing is fetched yet.
  static result<std::unique_ptr<shard_reader>> open(std::vector<shard_info> shards, shard_cache_options options);
  ~shard_reader();  // stops and joins the read-ahead thread

  const std::vector<shard_info>& shards() const;

  // Shard i's bytes: mapped in place when local; from the cache when remote,
  // fetched first (verified against size and digest) if not there, waiting
  // for the read-ahead thread if it is fetching it. Several processes
  // sharing one cache directory fetch a shard once (a lock file per shard).
  // Errors: one line naming the shard (missing, unreadable, wrong size or
  // digest: "shard s3://b/train-007.bin: 1048576 bytes, the index says
  // 1048580"); never a silent skip. A shard's file found in the cache
  // (another rank's fetch, an earlier run) is checked for its size each
  // time and, when the index gives a digest, hashed once per reader, at
  // its first get(); a stale file is removed and fetched again.
  result<std::shared_ptr<const shard_bytes>> get(size_t i);

  // The shards needed next, most urgent first: the read-ahead thread fetches
  // those not in the cache, as far as cache_bytes allows without evicting a
  // shard in `next` or one handed out by get() and still held. Replaces the
  // previous hint.
  void read_ahead(std::vector<size_t> next);

  // Waits until the read-ahead thread has done what it can for the current
  // hint (each shard fetched, found in the cache, failed, or waiting for
  // room); false if that takes longer than `timeout`. For tests and
  // benchmarks: a reader never needs it.
  bool wait_read_ahead(std::chrono::milliseconds timeout);

  shard_reader_stats stats() const;

 private:
  shard_reader() = default;
  struct impl;
  std::unique_ptr<impl> impl_;
};

// data_error (thrown by a task whose shard cannot be read during training:
// missing, unreadable, not matching its index, ids outside the vocabulary)
// is part of the public API, dtactor/shards.hpp: the rank reports it as a
// data problem no new generation can fix, and the coordinator ends the job
// with its one line (docs/data.md).

// Every shard reader of this process together (a rank's step reports carry
// it): counters include readers already destroyed; read_ahead_depth sums the
// live ones, cache_used_bytes is the largest a live one saw (one directory).
// Nothing when this process never opened a reader.
std::optional<shard_reader_stats> process_shard_reader_stats();

}  // namespace dtactor
