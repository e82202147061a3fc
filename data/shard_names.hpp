#pragma once
// Internal to data/: what the shard files (shard_spec.cpp, shard_index.cpp,
// shard_cache.cpp, shard_reader.cpp) share about shard names and urls, and
// the resolver that turns a spec into shards. Not API: data/data_shards.hpp
// is.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "data/data_shards.hpp"
#include "storage/object_store.hpp"

namespace dtactor::shard_detail {

constexpr uint64_t chunk_bytes = 8ull << 20;  // one ranged GET / one read while hashing

inline bool is_s3(std::string_view s) { return s.rfind("s3://", 0) == 0; }

inline bool has_glob(std::string_view s) { return s.find_first_of("*?[") != std::string_view::npos; }

// `s` without leading and trailing blanks (space, tab, CR, LF).
std::string trim(const std::string& s);

// Names from listings and index files are outside bytes: messages show
// them on one line, control bytes escaped, long ones cut (300 bytes).
std::string printable(std::string_view s);

// "s3://b/p/name" -> ("s3://b/p", "name"); "/d/name" -> ("/d", "name").
std::pair<std::string, std::string> split_url(const std::string& url);

inline std::string join_url(const std::string& location, const std::string& name) { return location == "/" ? "/" + name : location + "/" + name; }

// "<bytes>:<xxh3 hex>", the form of file_digest and of the index's digests.
std::string digest_of(uint64_t bytes, uint64_t xxh3);

// Opens stores and lists locations once per resolve; every error it makes
// names the spec.
class resolver {
 public:
  resolver(std::string spec, std::string endpoint) : spec_(std::move(spec)), endpoint_(std::move(endpoint)) {}

  // "data '<spec>': <what>".
  error fail(const std::string& what) const;

  // The store of a location (a directory or s3://bucket/prefix), opened once.
  result<object_store*> store_at(const std::string& location);

  // The location's listing, listed once.
  result<const std::vector<object_info>*> listing(const std::string& location);

  // The shards of `spec`, sorted and unique, with digests from the indexes
  // when `use_index`.
  result<std::vector<shard_info>> resolve(bool use_index);

 private:
  // Adds the shards one expanded item names (a glob or one file).
  status add(const std::string& pattern, bool from_range, std::vector<shard_info>& out);
  // Checks the shards against the index of their location, where there is
  // one, and takes their digests and record counts from it.
  status apply_indexes(std::vector<shard_info>& shards);

  std::string spec_, endpoint_;
  std::map<std::string, std::unique_ptr<object_store>> stores_;
  std::map<std::string, std::vector<object_info>> listings_;
};

}  // namespace dtactor::shard_detail
