// dtactor-shards.json (data/data_shards.hpp): the index beside a data
// set's shards, in a directory or S3 prefix that others can write; every
// reader of the shards parses it. Properties: an accepted entry names a
// plain file (no '/'), and its digest is "<bytes>:<16 lower-case hex>" with
// the entry's own byte count.
#include <string>

#include "fuzz/fuzz_util.hpp"
#include "data/data_shards.hpp"

using namespace dtactor;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto index = parse_shard_index(text, "s3://bucket/corpus/dtactor-shards.json");
  if (!index) {
    if (index.message().find('\n') != std::string::npos) fuzz::fail("an error of more than one line");
    return 0;
  }
  for (const auto& [name, e] : index.value()) {
    if (name.empty() || name.find('/') != std::string::npos) fuzz::fail("an entry that is not a plain file name");
    const std::string head = std::to_string(e.bytes) + ":";
    if (e.digest.size() != head.size() + 16 || e.digest.compare(0, head.size(), head) != 0) fuzz::fail("a digest not of the form <bytes>:<xxh3>");
  }
  return 0;
}
