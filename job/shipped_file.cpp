#include "job/shipped_file.hpp"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <vector>

#include "storage/fs.hpp"
#include "base/hash.hpp"
#include "job/job_config.hpp"

namespace dtactor {

namespace {
constexpr uint64_t chunk = 8ull << 20;
}

result<shipped_file> ship_file(object_store& store, const std::string& path, const std::string& prefix, const std::string& suffix) {
  auto digest = file_digest(path);  // "<size>:<xxh3 hex>", as the ranks report it
  if (!digest) return digest.err();
  auto m = mapped_file::open(path);
  if (!m) return m.err();
  shipped_file out;
  out.digest = digest.value();
  out.object = prefix + out.digest.substr(out.digest.find(':') + 1) + suffix;
  auto have = store.size_of(out.object);
  if (!have) return make_error("checkpoint store " + store.location() + ": " + have.message());
  if (have.value() && *have.value() == m->size()) return out;
  auto w = store.create(out.object);
  if (!w) return make_error("cannot put '" + path + "' into " + store.location() + ": " + w.message());
  const auto* p = reinterpret_cast<const char*>(m->data());
  for (uint64_t off = 0; off < m->size(); off += chunk)
    if (auto st = w.value()->write(p + off, std::min<uint64_t>(chunk, m->size() - off)); !st)
      return make_error("cannot put '" + path + "' into " + store.location() + ": " + st.message());
  if (auto st = w.value()->commit(); !st) return make_error("cannot put '" + path + "' into " + store.location() + ": " + st.message());
  out.uploaded = true;
  return out;
}

std::string shipped_cache_dir() {
  const char* t = std::getenv("TMPDIR");
  std::string base = t && *t ? t : "/tmp";
  return base + "/dtactor-" + std::to_string(::getuid()) + "/shipped";
}

result<fetched_file> fetch_shipped_file(object_store& store, const std::string& object, const std::string& digest, const std::string& preferred,
                                        const std::string& cache_dir) {
  const auto colon = digest.find(':');
  if (colon == std::string::npos) return make_error("shipped file '" + object + "': bad digest '" + digest + "'");
  const uint64_t size = std::strtoull(digest.substr(0, colon).c_str(), nullptr, 10);
  std::error_code ec;
  if (!preferred.empty() && std::filesystem::exists(preferred, ec)) {
    auto d = file_digest(preferred);
    if (d && d.value() == digest) return fetched_file{preferred, false, size};
  }
  const std::string cached = cache_dir + "/" + object;
  if (std::filesystem::exists(cached, ec)) {
    auto d = file_digest(cached);
    if (d && d.value() == digest) return fetched_file{cached, false, size};
  }
  std::filesystem::create_directories(cache_dir, ec);
  if (ec) return make_error("cannot create '" + cache_dir + "': " + ec.message());
  const std::string tmp = cached + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return make_error("cannot write '" + tmp + "'");
    std::vector<char> buf(static_cast<size_t>(std::min<uint64_t>(chunk, std::max<uint64_t>(size, 1))));
    hasher h;
    uint64_t off = 0;
    while (off < size) {
      auto n = store.read(object, off, buf.data(), std::min<uint64_t>(buf.size(), size - off));
      if (!n) {
        std::filesystem::remove(tmp, ec);
        return make_error("cannot fetch '" + object + "' from " + store.location() + ": " + n.message());
      }
      if (n.value() == 0) break;
      h.update(buf.data(), n.value());
      out.write(buf.data(), static_cast<std::streamsize>(n.value()));
      off += n.value();
    }
    out.close();
    const std::string got = std::to_string(off) + ":" + hex64(h.digest());
    if (!out || got != digest) {
      std::filesystem::remove(tmp, ec);
      return make_error("'" + object + "' in " + store.location() + " is not the file the coordinator shipped (" + got + ", expected " + digest + ")");
    }
  }
  std::filesystem::rename(tmp, cached, ec);
  if (ec) return make_error("cannot rename '" + tmp + "': " + ec.message());
  return fetched_file{cached, true, size};
}

}  // namespace dtactor
