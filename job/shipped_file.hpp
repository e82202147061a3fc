#pragma once
// Files the coordinator ships with a job (a torchscript job's module file):
// put once into the checkpoint store under a content-addressed name, fetched
// by a rank that lacks the file (or holds a different one) into a local
// cache, checked against the coordinator's digest. Bulk bytes never travel
// on the control plane: plans carry only the object's name and digest.
#include <string>

#include "dtactor/result.hpp"
#include "storage/object_store.hpp"

namespace dtactor {

struct shipped_file {
  std::string object;  // "<prefix><xxh3 hex><suffix>", e.g. module-0123abcd.pt
  std::string digest;  // "<size>:<xxh3 hex>" (job/job_config file_digest)
  bool uploaded = false;  // false: the store already held it
};

// Puts `path` into `store` as prefix + hash + suffix unless an object of that
// name and size is already there (a restarted coordinator, a second job).
result<shipped_file> ship_file(object_store& store, const std::string& path, const std::string& prefix, const std::string& suffix);

// The local path of `object` with `digest`: `preferred` itself when it exists
// with that digest, else a copy in `cache_dir` (kept, content-addressed;
// fetched from `store` when absent, written to a temp file and renamed, so
// ranks of one machine can fetch at once). A fetched copy whose size or hash
// differs from `digest` is an error naming the object, never used.
struct fetched_file {
  std::string path;
  bool fetched = false;     // read from the store now
  uint64_t bytes = 0;
};
result<fetched_file> fetch_shipped_file(object_store& store, const std::string& object, const std::string& digest, const std::string& preferred,
                                        const std::string& cache_dir);

// ${TMPDIR:-/tmp}/dtactor-<uid>/shipped: where ranks keep fetched files.
std::string shipped_cache_dir();

}  // namespace dtactor
