#pragma once
// Reader for dictd databases (the format of Debian's dict-* packages): a
// text index `P.index` of `headword \t offset \t length` lines, offsets and
// lengths in dictd's base64, into the gzip/dictzip-compressed text `P.dict.dz`.
// No LibTorch here: the data tests stay cheap to build.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dtactor/result.hpp"

namespace dtactor {

struct dictd_entry {
  std::string headword;
  uint64_t offset = 0;  // byte offset into dictd_database::text
  uint64_t length = 0;  // bytes
};

struct dictd_database {
  std::string text;                  // the whole decompressed .dict.dz
  std::vector<dictd_entry> entries;  // in index order, meta entries removed

  // The definition of an entry; valid while this database lives.
  std::string_view definition(const dictd_entry& e) const { return std::string_view(text).substr(e.offset, e.length); }
};

// Decodes a dictd base64 number (alphabet A-Za-z0-9+/, most significant digit
// first). Empty, invalid or overflowing input gives nullopt.
std::optional<uint64_t> decode_dictd_base64(std::string_view digits);

// Whether a headword names one of dictd's meta entries ("00-database-info",
// or "00databaseinfo" as dictfmt writes them without --allchars).
bool is_dictd_meta_headword(std::string_view headword);

// Reads prefix + ".index" and prefix + ".dict.dz". `package` names the Debian
// package that ships the files, for the error message ("install Debian
// package ..."). Errors: a missing/unreadable file, a corrupt gzip stream, a
// malformed index line, an entry that points past the end of the text.
result<dictd_database> read_dictd(const std::string& prefix, const std::string& package);

// Decompresses a whole gzip (or dictzip) file; errors name the file.
result<std::string> read_gzip_file(const std::string& path);

}  // namespace dtactor
