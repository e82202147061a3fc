#pragma once
// Checkpoints in an object store (a directory, local or a shared mount; or
// S3): written in parts by the ranks, committed by a manifest written last,
// fenced by membership generation. No LibTorch here: the state is bytes.
//
// The state of a checkpoint is one logical byte stream: the tensors the
// manifest lists (name, dtype, shape, offset, size), back to back. It is
// stored as parts, each a contiguous byte range of the stream written by one
// rank ("ckpt-<step>.g<generation>.r<rank>-of-<world>.part": raw bytes, no
// header; a rank writing several ranges, ZeRO, names its k-th, k > 0,
// "...r<rank>-of-<world>.<k>.part"), and one manifest ("ckpt-<step, 9
// digits>.manifest"): "DTACMAN2", u32 length, the serialized
// pb::checkpoint_meta (parts with sizes and XXH3-64 checksums, tensors,
// step, generation, digests, metrics, config), u64 XXH3-64 of those bytes;
// integers little-endian. The stream does not depend on how many ranks wrote
// it: any world size reads it back.
//
// No manifest, no checkpoint: parts appear as the ranks write them; only the
// commit (the manifest, written atomically after every part is known to be
// stored whole) makes them a checkpoint. Parts that no manifest references
// are swept (after a crash, or a generation that never completed its
// checkpoint).
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint.pb.h"
#include "storage/checkpoint_plan.hpp"
#include "storage/fs.hpp"
#include "storage/manifest_plan.hpp"
#include "storage/object_store.hpp"
#include "dtactor/result.hpp"

namespace dtactor {

inline constexpr uint32_t checkpoint_format_version = 2;

struct checkpoint_policy {
  int keep_last = 3;  // >= 1
  bool keep_best = true;
  std::string best_metric;  // keep_best has no effect while empty
  bool higher_is_better = true;
};

struct checkpoint_entry {
  std::string name;  // the manifest's object name
  int64_t step;
  std::map<std::string, double> metrics;  // empty when the manifest does not check out
};

struct committed_checkpoint {
  std::string name;      // manifest object name
  std::string location;  // store location + "/" + name, for messages
  uint64_t bytes = 0;    // state bytes
  std::vector<int64_t> kept;  // steps of the valid checkpoints left after rotation, ascending
};

// Manifest signing (docs/security.md), for the whole process: with a
// non-empty key (the job key's MAC key) every manifest written carries
// "DTACMAC1" and the HMAC-SHA256 of all its bytes before that tag, and a
// manifest read without a valid one is refused (reported like a corrupt one,
// naming it). Empty (the default): manifests are written unsigned and read
// as before. Set once at startup, before any store is used; not thread-safe.
void set_checkpoint_mac_key(std::string key);
bool checkpoint_mac_enabled();

// "ckpt-000001200.manifest" for step 1200.
std::string manifest_name(int64_t step);
// "ckpt-000001200.g7.r0-of-2.part": rank 0's first (or only) range; its
// range `index` > 0 (a ZeRO shard's scattered ranges) is
// "ckpt-000001200.g7.r0-of-2.<index>.part".
std::string part_name(int64_t step, uint64_t generation, int rank, int world, int index = 0);
// Which ranges a rank writes and reads: storage/checkpoint_plan.hpp
// (part_range, rank_ranges, plan_load).

// Stores `size` bytes as object `name` in chunks (never a second whole copy),
// hashing as it goes. Returns the part's entry for the manifest (name,
// offset, size, xxh3; rank and node_id left for the caller).
result<pb::checkpoint_part> write_part(object_store& store, const std::string& name, uint64_t offset, const char* data, uint64_t size);
// The same with the bytes made piece by piece: fill(at, n, dst) puts bytes
// [at, at + n) of the part into dst, n at most `scratch_bytes`, and `scratch`
// is where (checkpoint.direct: a part written from the training state
// itself, with no part-sized buffer).
result<pb::checkpoint_part> write_part(object_store& store, const std::string& name, uint64_t offset, uint64_t size,
                                       const std::function<void(uint64_t at, uint64_t n, char* dst)>& fill, char* scratch, uint64_t scratch_bytes);

// The meta's structural checks (format version, parts covering the stream
// exactly, tensors inside it with sizes their dtype and shape imply).
status check_manifest(const pb::checkpoint_meta& meta);
// Bytes per element of a dtype name ("float32" -> 4), 0 when unknown.
int dtype_size(const std::string& dtype);

class checkpoint_store {
 public:
  // Opens (creating a directory if needed) and checks it is writable; sweeps
  // writers' temp files and parts of steps up to the newest committed one
  // that no manifest references. Errors: keep_last < 1; "checkpoint
  // directory '/x' is not writable: Permission denied".
  // `s3_endpoint`: see open_object_store.
  static result<checkpoint_store> open(const std::string& location, checkpoint_policy policy, fs_env& env = default_fs_env(),
                                       const std::string& s3_endpoint = "");
  // For reading only (eval, export): no probe, no sweep, nothing created.
  static result<checkpoint_store> open_readonly(const std::string& location, const std::string& s3_endpoint = "");
  // A store around an object store the caller made (tests).
  static checkpoint_store over(std::shared_ptr<object_store> objects, checkpoint_policy policy);

  // Commits the checkpoint `meta` describes (its parts already stored):
  // refuses a generation lower than the newest committed one (a stale
  // writer), a meta that fails check_manifest, or a part that is missing or
  // of another size in the store; then writes the manifest atomically,
  // rotates (keep_last newest, the best, the one just written) and removes
  // the parts no manifest references that are no newer than this step or
  // come from an older generation. On error nothing committed changes.
  result<committed_checkpoint> commit(pb::checkpoint_meta meta);

  // A manifest and its structural checks. The error is the bare reason
  // ("manifest checksum mismatch", "part '...' is missing"). Errors of a
  // checkpoint's own bytes (here, verify and read_stream: undecodable,
  // missing, short, a checksum) carry errc::corrupt_checkpoint; errors
  // reaching the store do not.
  // `key_refused` is set when it is refused for the job key alone.
  result<pb::checkpoint_meta> read_manifest(const std::string& name, bool* key_refused = nullptr);
  // With a job key: an error (one line naming one) when the store holds
  // manifests refused for the key alone, another key's or unsigned ones. A
  // job must not write there: its checkpoints would overwrite theirs step
  // for step. Their parts are never swept (commit, open).
  status check_no_foreign_manifests();
  // Every part present with its size; with `checksums`, also read whole and
  // hashed (bounded memory).
  status verify(const pb::checkpoint_meta& meta, bool checksums);
  // The newest checkpoint whose manifest and parts check out (with
  // `checksums`, read whole). Each newer one that does not is reported
  // through on_skip(name, reason). nullopt when none. Steps in `excluded`
  // (refused by a rank of the job) are passed over unread.
  result<std::optional<pb::checkpoint_meta>> newest_valid(const std::function<void(const std::string&, const std::string&)>& on_skip,
                                                          bool checksums, const std::set<int64_t>& excluded = {});

  // The state stream of a checkpoint, in order, in chunks:
  // fn(stream_offset, data, size). Each part's checksum is checked when its
  // last byte has been read (so fn may have seen bytes of a corrupt part: a
  // caller loading into live tensors must treat them as torn on error).
  // With `wanted`, only the parts for which wanted(stream_offset, size) is
  // true are read (each still whole, so its checksum is checked): a rank
  // of a sharded job reads the parts that hold its shards.
  status read_stream(const pb::checkpoint_meta& meta, const std::function<status(uint64_t, const char*, size_t)>& fn,
                     const std::function<bool(uint64_t, uint64_t)>& wanted = {});
  // What a load plan (plan_load) names: each of its parts read whole, its
  // checksum checked when its last byte has been read, and fn given only
  // the bytes the plan keeps, in stream order (the same caveat on errors).
  status read_planned(const pb::checkpoint_meta& meta, const load_plan& plan, const std::function<status(uint64_t, const char*, size_t)>& fn);

  // Committed checkpoints (manifests), ascending by step.
  std::vector<checkpoint_entry> list();
  // Highest generation among manifests that check out; 0 when none.
  uint64_t newest_generation();
  // Removes parts no manifest references whose step is <= up_to_step or whose
  // generation is below `older_than_generation`.
  void sweep_orphans(int64_t up_to_step, uint64_t older_than_generation = 0);

  object_store& objects() { return *objects_; }
  const std::string& location() const { return objects_->location(); }
  const checkpoint_policy& policy() const { return policy_; }

 private:
  checkpoint_store(std::shared_ptr<object_store> objects, checkpoint_policy policy)
      : objects_(std::move(objects)), policy_(std::move(policy)) {}
  struct scanned {
    std::string name;
    int64_t step;
    std::optional<pb::checkpoint_meta> meta;
    bool key_refused = false;                // refused for the job key alone (another key's, or unsigned while keyed)
    std::vector<std::string> foreign_parts;  // such a manifest's parts: never swept
  };
  std::vector<scanned> scan();
  // Part `p` whole, through `buf`, hashed: fn(stream_offset, data, size).
  status read_part(const pb::checkpoint_part& p, std::string& buf, const std::function<status(uint64_t, const char*, size_t)>& fn);
  // Returns the steps of the valid checkpoints it kept, ascending.
  std::vector<int64_t> rotate(const std::string& just_written);

  std::shared_ptr<object_store> objects_;
  checkpoint_policy policy_;
};

// What `dtactor eval` / `export` are given: a run directory (its
// checkpoints/), a checkpoint directory or s3:// location (its newest valid
// checkpoint), or one manifest file. Reports skipped ones through on_skip.
struct checkpoint_target {
  std::shared_ptr<checkpoint_store> store;
  pb::checkpoint_meta meta;
  std::string name;  // location/manifest, for messages
};
result<checkpoint_target> open_checkpoint_target(const std::string& target,
                                                 const std::function<void(const std::string&, const std::string&)>& on_skip,
                                                 const std::string& s3_endpoint = "");

}  // namespace dtactor
