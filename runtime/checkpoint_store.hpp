#pragma once
// A directory of disk checkpoints: atomic, checksummed, rotated, and fenced
// by membership generation. No LibTorch here: sections are opaque bytes.
//
// File layout (all integers little-endian):
//   "DTACKPT1"                      8-byte magic
//   u32 meta_length
//   meta_length bytes               serialized pb::checkpoint_meta
//   u64 XXH3-64 of the meta bytes
//   section bytes, back to back, in the order of meta.sections (each entry
//   carries the section's size and XXH3-64)
// and nothing after the last section.
//
// File names: "ckpt-<step, zero-padded to 9 digits>.dtc". One writer per
// directory is expected (the job's current generation); the generation
// fence in save() turns away a stale writer that comes back.
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint.pb.h"
#include "runtime/fs.hpp"
#include "runtime/result.hpp"

namespace dtactor {

inline constexpr uint32_t checkpoint_format_version = 1;

struct checkpoint_policy {
  int keep_last = 3;  // >= 1
  bool keep_best = true;
  std::string best_metric;  // keep_best has no effect while empty
  bool higher_is_better = true;
};

struct checkpoint_entry {
  std::string path;
  int64_t step;
  std::map<std::string, double> metrics;
};

struct loaded_checkpoint {
  std::string path;
  pb::checkpoint_meta meta;
  std::map<std::string, std::string> sections;  // name -> bytes
};

// "ckpt-000001200.dtc" for step 1200.
std::string checkpoint_file_name(int64_t step);

class checkpoint_store {
 public:
  // Creates the directory if needed, checks it is writable and removes temp
  // files left by a writer that died mid-save. Errors: keep_last < 1;
  // "checkpoint directory '/x' is not writable: Permission denied".
  // Saves reach the disk through `env` (which must outlive the store).
  static result<checkpoint_store> open(std::string dir, checkpoint_policy policy, fs_env& env = default_fs_env());

  // Fills meta.sections (names, sizes, XXH3) and meta.format_version, writes
  // the file for meta.step atomically (replacing one of the same step), then
  // rotates. Returns the path. Refuses a meta whose generation is lower than
  // newest_generation() (read from disk at save time: it turns away a stale
  // writer, it is not a lock between two live ones); on any error the
  // previous files are as they were.
  // Rotation keeps the file just written, the newest keep_last and the best
  // (see checkpoint_policy) and deletes only other checkpoints whose meta and
  // size check out (section checksums are not re-read: that would read every
  // checkpoint at each save); files it cannot remove are retried next save.
  result<std::string> save(pb::checkpoint_meta meta, const std::vector<std::pair<std::string, std::string>>& sections);

  // Reads and fully validates one file (magic, lengths, meta checksum and
  // parse, every section's size and checksum, exact end). The error is the
  // bare reason, e.g. "checksum mismatch in section 'model'".
  static result<loaded_checkpoint> load(const std::string& path);

  // The newest (highest step) checkpoint that validates. Every newer one that
  // does not is reported through on_skip(path, reason) (may be empty) and
  // left on disk. Empty optional when none validates or none exists; an error
  // only when the directory cannot be listed.
  result<std::optional<loaded_checkpoint>> load_newest_valid(
      const std::function<void(const std::string&, const std::string&)>& on_skip) const;

  // Checkpoint files present, ascending by step. Reads only metas; a file
  // whose meta or size does not check out is listed with empty metrics.
  std::vector<checkpoint_entry> list() const;

  // Highest generation among checkpoints whose meta and size check out;
  // 0 when there are none.
  uint64_t newest_generation() const;

  const std::string& dir() const { return dir_; }
  const checkpoint_policy& policy() const { return policy_; }

 private:
  checkpoint_store(std::string dir, checkpoint_policy policy, fs_env& env);
  void rotate(const std::string& just_written) const;

  std::string dir_;
  checkpoint_policy policy_;
  fs_env* env_;
};

}  // namespace dtactor
