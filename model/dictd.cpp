#include "model/dictd.hpp"

#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

namespace dtactor {

namespace {

int base64_digit(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

std::string install_hint(const std::string& package) {
  return package.empty() ? std::string() : " (install Debian package " + package + ")";
}

}  // namespace

std::optional<uint64_t> decode_dictd_base64(std::string_view digits) {
  if (digits.empty()) return std::nullopt;
  uint64_t v = 0;
  for (char c : digits) {
    int d = base64_digit(c);
    if (d < 0) return std::nullopt;
    if (v > (std::numeric_limits<uint64_t>::max() >> 6)) return std::nullopt;
    v = (v << 6) | static_cast<uint64_t>(d);
  }
  return v;
}

bool is_dictd_meta_headword(std::string_view h) {
  return h.rfind("00-database-", 0) == 0 || h.rfind("00database", 0) == 0;
}

result<std::string> read_gzip_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return make_error("cannot read '" + path + "': " + std::strerror(errno));
  std::string packed((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return make_error("cannot read '" + path + "': I/O error");

  z_stream zs{};
  // 16 + MAX_WBITS: expect a gzip header; dictzip is gzip with an extra field.
  if (inflateInit2(&zs, 16 + MAX_WBITS) != Z_OK) return make_error("zlib could not start inflating '" + path + "'");
  std::string out;
  out.reserve(packed.size() * 4);
  zs.next_in = reinterpret_cast<Bytef*>(packed.data());
  zs.avail_in = static_cast<uInt>(packed.size());
  char buf[1 << 16];
  int rc = Z_OK;
  while (true) {
    zs.next_out = reinterpret_cast<Bytef*>(buf);
    zs.avail_out = sizeof buf;
    rc = inflate(&zs, Z_NO_FLUSH);
    out.append(buf, sizeof buf - zs.avail_out);
    if (rc == Z_STREAM_END) {
      // Concatenated gzip members are legal; continue with the next one.
      if (zs.avail_in == 0) break;
      if (inflateReset(&zs) != Z_OK) break;
      continue;
    }
    if (rc == Z_BUF_ERROR || (rc == Z_OK && zs.avail_in == 0 && zs.avail_out != 0)) {
      rc = Z_DATA_ERROR;  // input ended inside the stream: truncated file
      break;
    }
    if (rc != Z_OK) break;
  }
  std::string why = zs.msg ? zs.msg : (rc == Z_DATA_ERROR ? "truncated or corrupt data" : "zlib error " + std::to_string(rc));
  inflateEnd(&zs);
  if (rc != Z_STREAM_END) return make_error("'" + path + "' is not a valid gzip/dictzip file (" + why + "); reinstall it or fix the path");
  return out;
}

result<dictd_database> read_dictd(const std::string& prefix, const std::string& package) {
  const std::string index_path = prefix + ".index", dict_path = prefix + ".dict.dz";
  std::ifstream index(index_path, std::ios::binary);
  if (!index) return make_error("cannot read dictd index '" + index_path + "': " + std::strerror(errno) + install_hint(package));
  auto text = read_gzip_file(dict_path);
  if (!text) {
    std::ifstream probe(dict_path, std::ios::binary);
    return make_error(text.message() + (probe ? std::string() : install_hint(package)));
  }
  dictd_database db;
  db.text = std::move(text.value());
  std::string line;
  int64_t line_no = 0;
  while (std::getline(index, line)) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    auto t1 = line.find('\t');
    auto t2 = t1 == std::string::npos ? t1 : line.find('\t', t1 + 1);
    auto bad = [&](const std::string& what) {
      return make_error(index_path + ":" + std::to_string(line_no) + ": " + what + "; the dictd files are damaged, reinstall them" + install_hint(package));
    };
    if (t2 == std::string::npos) return bad("expected 'headword<TAB>offset<TAB>length'");
    // Some indexes carry a fourth column (original headword); it is ignored.
    auto t3 = line.find('\t', t2 + 1);
    std::string_view sv(line);
    auto off = decode_dictd_base64(sv.substr(t1 + 1, t2 - t1 - 1));
    auto len = decode_dictd_base64(sv.substr(t2 + 1, t3 == std::string::npos ? std::string_view::npos : t3 - t2 - 1));
    if (!off || !len) return bad("offset or length is not dictd base64");
    if (*off > db.text.size() || *len > db.text.size() - *off)
      return bad("entry points past the end of '" + dict_path + "' (" + std::to_string(db.text.size()) + " bytes)");
    std::string headword = line.substr(0, t1);
    if (is_dictd_meta_headword(headword)) continue;
    db.entries.push_back(dictd_entry{std::move(headword), *off, *len});
  }
  if (index.bad()) return make_error("cannot read dictd index '" + index_path + "': I/O error");
  return db;
}

}  // namespace dtactor
