// The node-wide cache of remote shards (data/data_shards.hpp, docs/data.md):
// a directory shared by the ranks of a node, bounded by data.cache_bytes,
// coordinated between processes by lock files; shards are fetched whole
// from their object store, verified against their size and digest, and
// evicted least recently used first.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <set>
#include <thread>

#include "base/hash.hpp"
#include "data/shard_reader_impl.hpp"
#include "storage/fs.hpp"
#include "storage/object_store.hpp"

namespace dtactor {

namespace {

std::string os_reason(int err) { return std::strerror(err); }

// Writes all `n` bytes of `p` at `offset` of `fd`: 0, or the errno.
int pwrite_all(int fd, const char* p, uint64_t n, uint64_t offset) {
  for (uint64_t w = 0; w < n;) {
    const ssize_t k = ::pwrite(fd, p + w, n - w, static_cast<off_t>(offset + w));
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return k < 0 ? errno : EIO;
    w += static_cast<uint64_t>(k);
  }
  return 0;
}

}  // namespace

namespace shard_detail {

result<std::optional<cache_lock>> cache_lock::take(const std::string& path, bool wait) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return make_error("cannot open lock file '" + path + "': " + os_reason(errno));
  for (;;) {
    if (::flock(fd, LOCK_EX | (wait ? 0 : LOCK_NB)) == 0) break;
    const int err = errno;
    if (err == EINTR) continue;
    ::close(fd);
    if (err == EWOULDBLOCK && !wait) return std::optional<cache_lock>();
    return make_error("cannot lock '" + path + "': " + os_reason(err));
  }
  cache_lock l;
  l.fd_ = fd;
  return std::optional<cache_lock>(std::move(l));
}

bool older(const cache_entry& a, const cache_entry& b) {
  if (a.used.tv_sec != b.used.tv_sec) return a.used.tv_sec < b.used.tv_sec;
  if (a.used.tv_nsec != b.used.tv_nsec) return a.used.tv_nsec < b.used.tv_nsec;
  return a.name < b.name;
}

bool is_cache_file_name(const std::string& n) {
  return n.size() > 17 && n[16] == '-' && std::all_of(n.begin(), n.begin() + 16, [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); });
}

}  // namespace shard_detail

using namespace shard_detail;

result<object_store*> shard_reader::impl::store_for(size_t i) {
  const std::string location = split_url(shards[i].url).first;
  std::lock_guard<std::mutex> lock(stores_mu);
  auto it = stores.find(location);
  if (it != stores.end()) return it->second.get();
  auto s = open_object_store_readonly(location, opt.s3_endpoint);
  if (!s) return shard_error(i, s.message());
  return stores.emplace(location, std::move(s.value())).first->second.get();
}

bool shard_reader::impl::cached_with_size(size_t i) const {
  struct stat sb {};
  return ::stat(cache_path(i).c_str(), &sb) == 0 && S_ISREG(sb.st_mode) && static_cast<uint64_t>(sb.st_size) == shards[i].bytes;
}

void shard_reader::impl::touch(size_t i) const { (void)::utimensat(AT_FDCWD, cache_path(i).c_str(), nullptr, 0); }

std::pair<std::vector<cache_entry>, uint64_t> shard_reader::impl::scan(const std::string& own) const {
  std::vector<cache_entry> files;
  uint64_t used = 0;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(opt.cache_dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.empty() || name[0] == '.') continue;
    const std::string path = opt.cache_dir + "/" + name;
    struct stat sb {};
    if (::lstat(path.c_str(), &sb) != 0 || !S_ISREG(sb.st_mode)) continue;
    if (is_atomic_temp_name(name)) {
      const std::string owner = name.substr(0, name.rfind(".tmp."));
      auto l = owner == own ? result<std::optional<cache_lock>>(std::optional<cache_lock>()) : cache_lock::take(lock_path(owner), false);
      if (owner == own || (l && l.value())) {
        ::unlink(path.c_str());
        continue;
      }
      used += static_cast<uint64_t>(sb.st_size);
    } else if (is_cache_file_name(name)) {
      used += static_cast<uint64_t>(sb.st_size);
      files.push_back({name, static_cast<uint64_t>(sb.st_size), sb.st_mtim});
    }
  }
  return {std::move(files), used};
}

void shard_reader::impl::rescan() {
  auto space = cache_lock::take(locks_dir + "/" + space_lock_name, true);
  if (space) note_usage(scan().second);
}

result<std::pair<int, std::string>> shard_reader::impl::reserve(size_t i, bool urgent, fetch_outcome& outcome) {
  const uint64_t need = shards[i].bytes;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(5);
  for (auto pause = std::chrono::milliseconds(5);; pause = std::min(pause * 2, std::chrono::milliseconds(200))) {
    {
      auto space = cache_lock::take(locks_dir + "/" + space_lock_name, true);
      if (!space) return shard_error(i, "data cache: " + space.message());
      auto [files, used] = scan(cache_name[i]);
      if (used + need > opt.cache_bytes) {
        std::set<std::string> in_next, in_use;
        {
          std::lock_guard<std::mutex> lock(core->mu);
          for (size_t k : next)
            if (remote[k]) in_next.insert(cache_name[k]);
          for (size_t k = 0; k < shards.size(); ++k)
            if (remote[k] && !held[k].expired()) in_use.insert(cache_name[k]);
        }
        std::sort(files.begin(), files.end(), older);
        for (int tier = 0; tier < (urgent ? 3 : 1) && used + need > opt.cache_bytes; ++tier)
          for (const auto& f : files) {
            if (used + need <= opt.cache_bytes) break;
            if (f.name == cache_name[i]) continue;
            const int t = in_use.count(f.name) ? 2 : in_next.count(f.name) ? 1 : 0;
            if (t != tier) continue;
            auto l = cache_lock::take(lock_path(f.name), false);
            if (!l || !l.value()) continue;  // being fetched, checked or mapped by someone
            if (::unlink((opt.cache_dir + "/" + f.name).c_str()) == 0) used -= f.bytes;
          }
      }
      if (used + need <= opt.cache_bytes) {
        static std::atomic<uint64_t> counter{0};
        const std::string tmp = cache_path(i) + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter.fetch_add(1));
        const int fd = ::open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
        if (fd < 0) return shard_error(i, "cannot create '" + tmp + "' in the data cache: " + os_reason(errno));
        int err = need == 0 ? 0 : ::fallocate(fd, 0, 0, static_cast<off_t>(need)) == 0 ? 0 : errno;
        if (err == EOPNOTSUPP || err == ENOSYS) err = ::ftruncate(fd, static_cast<off_t>(need)) == 0 ? 0 : errno;
        if (err) {
          ::close(fd);
          ::unlink(tmp.c_str());
          return shard_error(i, "cannot make room for " + std::to_string(need) + " bytes in the data cache " + opt.cache_dir + ": " + os_reason(err));
        }
        note_usage(used + need);
        outcome = fetch_outcome::done;
        return std::make_pair(fd, tmp);
      }
      note_usage(used);
    }
    if (!urgent) {
      outcome = fetch_outcome::no_room;
      return std::make_pair(-1, std::string());
    }
    if (std::chrono::steady_clock::now() > deadline)
      return shard_error(i, "no room in the data cache " + opt.cache_dir + " (data.cache_bytes " + std::to_string(opt.cache_bytes) + ") for " +
                                std::to_string(need) + " bytes after 5 minutes: other processes' fetches fill it; raise data.cache_bytes");
    std::this_thread::sleep_for(pause);  // other processes' fetches in flight hold the room: no event reaches us
  }
}

result<fetch_outcome> shard_reader::impl::fetch(size_t i, bool urgent) {
  auto count_failed = [&](error e) {
    with_stats([](shard_reader_stats& x) { ++x.shards_failed; });
    return e;
  };
  auto store = store_for(i);
  if (!store) return count_failed(store.err());
  const std::string name = split_url(shards[i].url).second;
  if (auto st = check_object(i, *store.value(), name); !st) return count_failed(st.err());
  fetch_outcome outcome = fetch_outcome::done;
  auto reserved = reserve(i, urgent, outcome);
  if (!reserved) return count_failed(reserved.err());
  if (outcome != fetch_outcome::done) return outcome;
  const auto [fd, tmp] = reserved.value();
  auto copied = copy_into(i, *store.value(), name, fd, tmp, urgent);
  if (!copied || copied.value() != fetch_outcome::done) {
    ::close(fd);
    ::unlink(tmp.c_str());
    rescan();
    if (!copied) return count_failed(copied.err());
    return copied.value();
  }
  if (auto st = install(i, fd, tmp); !st) return count_failed(st.err());
  with_stats([&](shard_reader_stats& x) {
    ++x.shards_verified;
    verified[i] = true;
  });
  return fetch_outcome::done;
}

status shard_reader::impl::check_object(size_t i, object_store& store, const std::string& name) {
  auto size = store.size_of(name);
  if (!size) return shard_error(i, size.message());
  if (!size.value()) return shard_error(i, "no such object (removed since the shards were listed?)");
  if (*size.value() != shards[i].bytes) return shard_error(i, std::to_string(*size.value()) + " bytes, " + says(i) + std::to_string(shards[i].bytes));
  return {};
}

result<fetch_outcome> shard_reader::impl::copy_into(size_t i, object_store& store, const std::string& name, int fd, const std::string& tmp,
                                                    bool urgent) {
  const shard_info& s = shards[i];
  std::vector<char> buf(static_cast<size_t>(std::min<uint64_t>(chunk_bytes, std::max<uint64_t>(s.bytes, 1))));
  hasher h;
  uint64_t at = 0;
  while (at < s.bytes) {
    if (!urgent && stopping.load()) return fetch_outcome::stopped;
    auto n = store.read(name, at, buf.data(), std::min<uint64_t>(buf.size(), s.bytes - at));
    if (!n) return shard_error(i, n.message());
    with_stats([&](shard_reader_stats& x) { x.bytes_read_s3 += n.value(); });
    if (n.value() == 0) return shard_error(i, "the object ended after " + std::to_string(at) + " bytes, " + says(i) + std::to_string(s.bytes));
    if (const int err = pwrite_all(fd, buf.data(), n.value(), at))
      return shard_error(i, "cannot write '" + tmp + "' in the data cache: " + os_reason(err));
    h.update(buf.data(), n.value());
    at += n.value();
  }
  const std::string got = digest_of(at, h.digest());
  if (!s.digest.empty() && got != s.digest)
    return shard_error(
        i, "its bytes hash to " + got + ", the index says " + s.digest + " (changed since `dtactor data index`: restore it, or index again)");
  return fetch_outcome::done;
}

status shard_reader::impl::install(size_t i, int fd, const std::string& tmp) {
  if (::fdatasync(fd) != 0 || ::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    rescan();
    return shard_error(i, "cannot write '" + tmp + "' in the data cache: " + os_reason(err));
  }
  int rename_err = 0;
  {
    // Under the space lock: a directory listing that runs beside a rename
    // may see neither name (or both), and the bound rests on every count.
    auto space = cache_lock::take(locks_dir + "/" + space_lock_name, true);
    if (!space) {
      ::unlink(tmp.c_str());
      return shard_error(i, "data cache: " + space.message());
    }
    if (::rename(tmp.c_str(), cache_path(i).c_str()) != 0) rename_err = errno;
  }
  if (rename_err) {
    ::unlink(tmp.c_str());
    rescan();
    return shard_error(i, "cannot rename '" + tmp + "' in the data cache: " + os_reason(rename_err));
  }
  return {};
}

result<std::optional<std::shared_ptr<const shard_bytes>>> shard_reader::impl::map_cached(size_t i) {
  using none = std::optional<std::shared_ptr<const shard_bytes>>;
  const std::string path = cache_path(i);
  struct stat sb {};
  if (::stat(path.c_str(), &sb) != 0) return none();
  if (!S_ISREG(sb.st_mode) || static_cast<uint64_t>(sb.st_size) != shards[i].bytes) {
    ::unlink(path.c_str());
    rescan();
    return none();
  }
  auto m = mapped_file::open(path);
  if (!m) return shard_error(i, "the data cache: " + m.message());
  bool check = false;
  {
    std::lock_guard<std::mutex> lock(core->mu);
    check = !shards[i].digest.empty() && !verified[i];
  }
  if (check) {
    if (digest_of(m->size(), hash64(m->data(), m->size())) != shards[i].digest) {
      ::unlink(path.c_str());
      rescan();
      return none();
    }
    std::lock_guard<std::mutex> lock(core->mu);
    verified[i] = true;
  }
  touch(i);
  return none(std::make_shared<mapped_shard>(std::move(m.value()), core));
}

result<std::pair<std::shared_ptr<const shard_bytes>, bool>> shard_reader::impl::load(size_t i, bool waited) {
  const bool present_before = !waited && cached_with_size(i);
  auto lock = cache_lock::take(lock_path(cache_name[i]), true);
  if (!lock) return shard_error(i, "data cache: " + lock.message());
  auto have = map_cached(i);
  if (!have) return have.err();
  if (have.value()) return std::make_pair(*have.value(), present_before);
  auto f = fetch(i, true);
  if (!f) return f.err();
  auto after = map_cached(i);
  if (!after) return after.err();
  if (!after.value()) return shard_error(i, "the data cache lost it right after the fetch");
  return std::make_pair(*after.value(), false);
}

fetch_outcome shard_reader::impl::prefetch(size_t j) {
  if (cached_with_size(j)) {
    touch(j);
    return fetch_outcome::done;
  }
  auto lock = cache_lock::take(lock_path(cache_name[j]), false);
  if (!lock || !lock.value()) return fetch_outcome::done;  // another process is at it
  if (cached_with_size(j)) return fetch_outcome::done;
  auto f = fetch(j, false);
  return f ? f.value() : fetch_outcome::done;  // a failure is counted; get() tries again and says why
}

}  // namespace dtactor
