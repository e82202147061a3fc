// dictd databases (model/dictd.hpp) and the text data built on them
// (model/text_data.hpp): the index (headword, offset, length in dictd's
// base64) and the gzip/dictzip text of Debian's dict-* packages, read in
// place. Input: records; the first is the index, the second the .dict.dz
// bytes. Properties: read_dictd never crashes; every entry it returns lies
// inside the text; the eng-ita pairs and GCIDE's text are built from any
// database without crashing.
#include <filesystem>
#include <fstream>

#include "fuzz/fuzz_util.hpp"
#include "model/dictd.hpp"
#include "model/text_data.hpp"

using namespace dtactor;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // read_dictd takes a path prefix: the two files live in a directory of
  // this process, in memory (/dev/shm) where there is one: rewriting a file
  // on ext4 flushes it to the disk on every input.
  struct scratch_dir {
    std::string path;
    scratch_dir() {
      const std::filesystem::path base = std::filesystem::is_directory("/dev/shm") ? "/dev/shm" : std::filesystem::temp_directory_path();
      path = (base / ("dtactor-fuzz-dictd-" + std::to_string(::getpid()))).string();
      std::filesystem::create_directories(path);
    }
    ~scratch_dir() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  };
  static const scratch_dir dir;
  const std::string prefix = dir.path + "/db";
  fuzz::reader in(data, size);
  (void)in.u8();
  const std::string index = in.payload();
  (void)in.u8();
  const std::string dz = in.payload();
  std::ofstream(prefix + ".index", std::ios::binary | std::ios::trunc) << index;
  std::ofstream(prefix + ".dict.dz", std::ios::binary | std::ios::trunc) << dz;
  auto db = read_dictd(prefix, "");
  if (!db) return 0;
  for (const auto& e : db->entries) {
    if (e.offset > db->text.size() || e.length > db->text.size() - e.offset) fuzz::fail("an entry outside the text");
    (void)utf8_length(db->definition(e));
  }
  // The two data sets built on dictd: eng->ita pairs and GCIDE's text.
  (void)split_pairs(freedict_pairs(db.value(), 32), 0.1);
  (void)gcide_corpus(db.value(), 0.1, 1 << 16);
  return 0;
}
