#pragma once
// Where checkpoints live: a flat namespace of named objects (files in a
// directory, local or a shared mount; objects under an S3 prefix). Objects
// are written whole through a writer that streams (chunks in, nothing
// buffered whole) and appears only on commit(): a writer destroyed without
// commit() leaves nothing under the name. No LibTorch here.
//
// Thread safety: one store may be used from several threads at once; a
// writer belongs to one thread.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "storage/fs.hpp"
#include "dtactor/result.hpp"

namespace dtactor {

struct object_info {
  std::string name;
  uint64_t size = 0;
};

class object_writer {
 public:
  virtual ~object_writer() = default;  // without commit(): aborted, nothing appears
  virtual status write(const void* data, size_t size) = 0;
  // Makes the object appear, whole and durable, under its name (replacing one
  // of the same name).
  virtual status commit() = 0;
};

class object_store {
 public:
  virtual ~object_store() = default;
  // "/abs/dir" or "s3://bucket/prefix": for messages.
  virtual const std::string& location() const = 0;
  virtual result<std::unique_ptr<object_writer>> create(const std::string& name) = 0;
  // Reads up to `size` bytes at `offset` into `dst`; returns how many (fewer
  // only at the end of the object). Error when the object is missing.
  virtual result<uint64_t> read(const std::string& name, uint64_t offset, void* dst, uint64_t size) = 0;
  // Size of an object, or nullopt when there is none of that name.
  virtual result<std::optional<uint64_t>> size_of(const std::string& name) = 0;
  // Every object (not temp files of writers in flight), in name order.
  virtual result<std::vector<object_info>> list() = 0;
  // Removing an object that is not there is success.
  virtual status remove(const std::string& name) = 0;
  // Drops what writers that died left behind (temp files of other
  // processes, unfinished uploads). Only the process that owns the store's
  // location calls it: without `stale` (the coordinator at start) it drops
  // every write in flight elsewhere too; with `stale`, only the writes
  // whose object name it accepts (a running coordinator: writes of
  // generations that are over), whoever writes them.
  virtual void sweep_stale_writes(const std::function<bool(const std::string& object)>& stale = {}) = 0;

  // Creates `name` with `bytes` only where no object of that name exists,
  // atomically against other creators: false when one existed. Stores
  // that cannot promise it say so (an error): only S3 creates this way.
  virtual result<bool> put_if_absent(const std::string& name, std::string_view bytes);

  // Whole small objects (manifests). get() refuses an object the store says
  // is larger than `max_bytes`: the size a damaged or planted file, or an S3
  // server's Content-Length, claims never decides how much memory is taken.
  status put(const std::string& name, std::string_view bytes);
  result<std::string> get(const std::string& name, uint64_t max_bytes = max_small_object_bytes);
  static constexpr uint64_t max_small_object_bytes = 64ull << 20;
};

// A directory: objects are files written as write_file_atomic does (temp
// file, fsync, rename, fsync of the directory), through `env`. Creates the
// directory and proves it writable. Temp files of writers that died are
// not swept here (sweep_stale_writes).
result<std::unique_ptr<object_store>> open_directory_store(const std::string& dir, fs_env& env = default_fs_env());

// The same over an existing directory, for reading only: nothing is
// created, probed or swept (a read-only mount works).
result<std::unique_ptr<object_store>> open_directory_store_readonly(const std::string& dir);

// A checkpoint location as given in config or on the command line: a
// directory path (made absolute), or "s3://bucket/prefix" (storage/s3_store:
// credentials and region from the environment; `s3_endpoint`, else
// AWS_ENDPOINT_URL, for S3-compatible servers other than AWS).
result<std::unique_ptr<object_store>> open_object_store(const std::string& location, fs_env& env = default_fs_env(),
                                                        const std::string& s3_endpoint = "");

// The same for reading only (eval, export, data shards): a directory is
// neither created nor probed nor swept (a read-only mount works); s3:// as
// above. The one factory of stores from a location: every caller that
// reads or writes by URL goes through these two.
result<std::unique_ptr<object_store>> open_object_store_readonly(const std::string& location, const std::string& s3_endpoint = "");

// The location in a form another process on another machine can use: an
// absolute directory path, or the s3:// URL unchanged.
std::string absolute_location(const std::string& location);

}  // namespace dtactor
