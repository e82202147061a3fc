#include "storage/object_store.hpp"

#include "storage/s3_store.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

namespace dtactor {

status object_store::put(const std::string& name, std::string_view bytes) {
  auto w = create(name);
  if (!w) return w.err();
  if (auto st = w.value()->write(bytes.data(), bytes.size()); !st) return st;
  return w.value()->commit();
}

result<std::string> object_store::get(const std::string& name, uint64_t max_bytes) {
  auto size = size_of(name);
  if (!size) return size.err();
  if (!size.value()) return make_error("'" + name + "' is not in " + location());
  if (*size.value() > max_bytes)
    return make_error("'" + name + "' in " + location() + " is " + std::to_string(*size.value()) + " bytes, more than the " + std::to_string(max_bytes) +
                      " such an object can be: damaged, or not written by dtactor");
  std::string out(static_cast<size_t>(*size.value()), '\0');
  auto n = read(name, 0, out.data(), out.size());
  if (!n) return n.err();
  out.resize(n.value());
  return out;
}

namespace {

std::atomic<uint64_t> writer_counter{0};

std::string reason(int err) { return std::strerror(err); }

class dir_writer : public object_writer {
 public:
  dir_writer(std::string dir, std::string name, fs_env& env, int fd, std::string tmp)
      : dir_(std::move(dir)), name_(std::move(name)), env_(env), fd_(fd), tmp_(std::move(tmp)) {}
  ~dir_writer() override {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(tmp_.c_str());
  }
  status write(const void* data, size_t size) override {
    if (fd_ < 0) return make_error("cannot write '" + path() + "': writer already closed");
    if (int err = env_.write_all(fd_, static_cast<const char*>(data), size)) return fail("write", err);
    written_ += size;
    stream_out();
    return {};
  }
  status commit() override {
    if (fd_ < 0) return make_error("cannot write '" + path() + "': writer already closed");
    if (int err = env_.sync(fd_)) return fail("fsync", err);
    if (written_ >= stream_chunk) ::posix_fadvise(fd_, 0, 0, POSIX_FADV_DONTNEED);  // on disk now: out of the page cache
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) return fail("close", errno);
    if (int err = env_.rename(tmp_, path())) return fail("rename", err);
    committed_ = true;
    int dfd = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) return make_error("wrote '" + path() + "' but could not fsync its directory: " + reason(errno));
    const int err = env_.sync(dfd);
    ::close(dfd);
    if (err) return make_error("wrote '" + path() + "' but could not fsync its directory: " + reason(err));
    return {};
  }

 private:
  std::string path() const { return dir_ + "/" + name_; }
  // A large object (a checkpoint part: 1.2 GB a rank of a 200M-parameter
  // model) is written back as it is written, a chunk at a time, and each
  // chunk is dropped from the page cache once it is on disk. Otherwise the
  // whole part sits dirty in memory until commit's fsync writes it all at
  // once, and the training process beside it faults its pages in against
  // that (reclaim, writeback throttling). Advice only: where the file
  // system ignores it, commit's fsync still makes the object durable.
  static constexpr uint64_t stream_chunk = 32ull << 20;
  void stream_out() {
    while (written_ - started_ >= stream_chunk) {
      (void)::sync_file_range(fd_, static_cast<off_t>(started_), stream_chunk, SYNC_FILE_RANGE_WRITE);
      started_ += stream_chunk;
      // The chunk before the one just started: wait for it, then drop it.
      if (started_ - dropped_ < 2 * stream_chunk) continue;
      (void)::sync_file_range(fd_, static_cast<off_t>(dropped_), stream_chunk,
                              SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
      (void)::posix_fadvise(fd_, static_cast<off_t>(dropped_), stream_chunk, POSIX_FADV_DONTNEED);
      dropped_ += stream_chunk;
    }
  }
  status fail(const char* what, int err) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    ::unlink(tmp_.c_str());
    return make_error("cannot write '" + path() + "' (" + what + "): " + reason(err));
  }
  std::string dir_, name_;
  fs_env& env_;
  int fd_;
  std::string tmp_;
  bool committed_ = false;
  uint64_t written_ = 0, started_ = 0, dropped_ = 0;  // bytes written; of them, handed to writeback; dropped from the cache
};

class dir_store : public object_store {
 public:
  dir_store(std::string dir, fs_env& env) : dir_(std::move(dir)), env_(env) {}
  const std::string& location() const override { return dir_; }

  result<std::unique_ptr<object_writer>> create(const std::string& name) override {
    if (auto st = check_name(name); !st) return st.err();
    const std::string tmp = dir_ + "/" + name + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(writer_counter.fetch_add(1));
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) return make_error("cannot write '" + dir_ + "/" + name + "' (create temp file): " + reason(errno));
    return std::unique_ptr<object_writer>(std::make_unique<dir_writer>(dir_, name, env_, fd, tmp));
  }

  result<uint64_t> read(const std::string& name, uint64_t offset, void* dst, uint64_t size) override {
    const std::string path = dir_ + "/" + name;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return make_error("cannot read '" + path + "': " + reason(errno));
    uint64_t used = 0;
    while (used < size) {
      const ssize_t n = ::pread(fd, static_cast<char*>(dst) + used, size - used, static_cast<off_t>(offset + used));
      if (n < 0) {
        if (errno == EINTR) continue;
        const int err = errno;
        ::close(fd);
        return make_error("cannot read '" + path + "': " + reason(err));
      }
      if (n == 0) break;
      used += static_cast<uint64_t>(n);
    }
    ::close(fd);
    return used;
  }

  result<std::optional<uint64_t>> size_of(const std::string& name) override {
    const std::string path = dir_ + "/" + name;
    struct stat sb {};
    if (::stat(path.c_str(), &sb) != 0) {
      if (errno == ENOENT) return std::optional<uint64_t>();
      return make_error("cannot read '" + path + "': " + reason(errno));
    }
    if (!S_ISREG(sb.st_mode)) return make_error("'" + path + "' is not a regular file");
    return std::optional<uint64_t>(static_cast<uint64_t>(sb.st_size));
  }

  result<std::vector<object_info>> list() override {
    std::vector<object_info> out;
    std::error_code ec;
    std::filesystem::directory_iterator it(dir_, ec), end;
    if (ec) return make_error("cannot list '" + dir_ + "': " + ec.message());
    for (; it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (is_atomic_temp_name(name) || name.rfind(".dtactor-probe", 0) == 0) continue;
      std::error_code sec;
      if (!it->is_regular_file(sec)) continue;
      const auto size = it->file_size(sec);
      if (sec) continue;  // removed meanwhile
      out.push_back({name, static_cast<uint64_t>(size)});
    }
    if (ec) return make_error("cannot list '" + dir_ + "': " + ec.message());
    std::sort(out.begin(), out.end(), [](const object_info& a, const object_info& b) { return a.name < b.name; });
    return out;
  }

  status remove(const std::string& name) override { return remove_file(dir_ + "/" + name); }

  void sweep_stale_writes(const std::function<bool(const std::string&)>& stale) override {
    const std::string own = ".tmp." + std::to_string(::getpid()) + ".";
    std::error_code ec;
    for (std::filesystem::directory_iterator it(dir_, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (!is_atomic_temp_name(name)) continue;
      // "<object>.tmp.<pid>.<n>": the object the write was for.
      const bool drop = stale ? stale(name.substr(0, name.rfind(".tmp.", name.rfind('.') - 1))) : name.find(own) == std::string::npos;
      if (drop) (void)remove_file(it->path().string());
    }
  }

 private:
  static status check_name(const std::string& name) {
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..")
      return make_error("bad object name '" + name + "'");
    return {};
  }
  std::string dir_;
  fs_env& env_;
};

}  // namespace

result<bool> object_store::put_if_absent(const std::string& name, std::string_view) {
  return make_error("'" + location() + "/" + name + "': this store cannot create an object only where absent");
}

std::string absolute_location(const std::string& location) {
  if (location.rfind("s3://", 0) == 0) return location;
  std::error_code ec;
  auto abs = std::filesystem::absolute(location, ec);
  if (ec) return location;
  return abs.lexically_normal().string();
}

result<std::unique_ptr<object_store>> open_directory_store(const std::string& dir, fs_env& env) {
  const std::string abs = absolute_location(dir);
  std::string trimmed = abs;
  while (trimmed.size() > 1 && trimmed.back() == '/') trimmed.pop_back();
  if (auto st = ensure_writable_dir(trimmed); !st) return st.err();
  auto store = std::make_unique<dir_store>(trimmed, env);
  return std::unique_ptr<object_store>(std::move(store));
}

result<std::unique_ptr<object_store>> open_directory_store_readonly(const std::string& dir) {
  std::string abs = absolute_location(dir);
  while (abs.size() > 1 && abs.back() == '/') abs.pop_back();
  std::error_code ec;
  if (!std::filesystem::is_directory(abs, ec)) return make_error("'" + dir + "' is not a directory");
  return std::unique_ptr<object_store>(std::make_unique<dir_store>(abs, default_fs_env()));
}

result<std::unique_ptr<object_store>> open_object_store(const std::string& location, fs_env& env, const std::string& s3_endpoint) {
  if (location.rfind("s3://", 0) == 0) {
    auto o = s3_options_for(location, s3_endpoint);
    if (!o) return o.err();
    return open_s3_store(std::move(o.value()));
  }
  return open_directory_store(location, env);
}

result<std::unique_ptr<object_store>> open_object_store_readonly(const std::string& location, const std::string& s3_endpoint) {
  if (location.rfind("s3://", 0) == 0) {
    auto o = s3_options_for(location, s3_endpoint);
    if (!o) return o.err();
    return open_s3_store(std::move(o.value()));
  }
  return open_directory_store_readonly(location);
}

}  // namespace dtactor
