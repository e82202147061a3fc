#pragma once
// WebDataset-style tar shards (issue 29, docs/data.md "Tar shards"): a shard
// is a POSIX tar archive whose regular files are grouped into samples by
// key, WebDataset's convention: a file `dir/000123.cls` has the key
// `dir/000123` and the extension `cls` (everything after the first '.' of
// the file name), and the files of one sample are consecutive in the
// archive. Also the record counts `dtactor data index` writes into the
// shard index (tar samples, .npy rows, text lines). No LibTorch here.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "dtactor/result.hpp"

namespace dtactor {

// One regular file of a tar archive: its path (pax `path` and GNU long
// names applied, a leading "./" dropped) and where its bytes are.
struct tar_entry {
  std::string name;
  uint64_t offset = 0;  // of the file's first byte in the archive
  uint64_t size = 0;
};

// A push parser of tar archives (ustar, GNU and pax headers; sizes in octal
// or GNU base-256): feed() the archive's bytes in pieces of any size, in
// order; regular files are reported as their header is read (their bytes
// need not have arrived). Directories, links and devices are passed over.
// Errors, one line naming `where` and the byte offset: a header whose
// checksum is wrong, a size that is not a number, a pax record that does not
// parse, a long name over 64 KiB, and (at finish) an archive cut inside a
// header or a file.
class tar_scanner {
 public:
  using on_entry = std::function<status(const tar_entry&)>;
  tar_scanner(std::string where, on_entry sink);
  status feed(const uint8_t* data, size_t size);
  // The archive ended: an error if it ended inside a header or a file.
  status finish();
  // Whether the end-of-archive block (a zero block) was seen.
  bool ended() const { return state_ == state::end; }

 private:
  enum class state { header, skip, long_name, pax, end };
  status header_block(const uint8_t* b);
  status data_done();  // the current long name / pax data / file ended
  error fail(const std::string& what) const;

  std::string where_;
  on_entry sink_;
  state state_ = state::header;
  uint64_t at_ = 0;         // bytes consumed so far
  uint64_t remaining_ = 0;  // of the current skip / long name / pax data (padding included)
  uint64_t payload_ = 0;    // of that, the file's own bytes
  uint8_t block_[512]{};
  size_t block_fill_ = 0;
  std::string extra_;       // a long name's or a pax header's bytes being collected
  std::string next_name_;   // from a GNU long name or a pax path, for the next header
  uint64_t next_size_ = 0;  // from a pax size, for the next header
  bool have_next_size_ = false;
};

// One sample of a tar shard: its key and its files by extension
// (lower-cased, e.g. "jpg", "cls", "seg.png"), in archive order.
struct tar_sample {
  std::string key;
  std::vector<std::pair<std::string, tar_entry>> members;
  // The member with this extension, or nullptr.
  const tar_entry* member(const std::string& ext) const;
};

// Groups a tar archive's files into samples: a file's key is its path up to
// the first '.' of its file name, and a sample's files are consecutive. A
// file whose name has no '.' belongs to no sample (passed over), as does a
// WebDataset meta file (`__key__`-style names). Errors, one line naming
// `where`: a key that comes back after another key's files (the archive was
// not written sample by sample), two files with one key and one extension.
class tar_sample_grouper {
 public:
  using on_sample = std::function<status(tar_sample&&)>;
  tar_sample_grouper(std::string where, on_sample sink);
  status add(const tar_entry& e);
  status finish();  // hands over the last sample

 private:
  std::string where_;
  on_sample sink_;
  tar_sample current_;
  std::set<std::string> seen_;  // keys handed over (a key that comes back is refused)
};

// Every sample of a tar archive held in memory (a mapped shard).
result<std::vector<tar_sample>> read_tar_samples(const uint8_t* data, size_t size, const std::string& where);

// Counts a shard's records while its bytes stream past (`dtactor data index`
// reads every shard once): the samples of a `.tar`, the rows of a `.npy`,
// the lines of a `.csv`, `.tsv`, `.jsonl` or `.txt` (a last line without a
// newline counts). Other files have no record count.
class record_counter {
 public:
  virtual ~record_counter() = default;
  virtual status update(const uint8_t* data, size_t size) = 0;
  // The count, once every byte went through update(); `total` is the size.
  virtual result<int64_t> finish(uint64_t total) = 0;
  // A counter for the shard named `name` (its extension decides), or
  // nullptr when the kind has no record count.
  static std::unique_ptr<record_counter> for_name(const std::string& name, const std::string& where);
};

// The records of a whole file in memory, as record_counter counts them;
// -1 when its kind has none.
result<int64_t> count_records(const std::string& name, const uint8_t* data, size_t size, const std::string& where);

}  // namespace dtactor
