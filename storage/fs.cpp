#include "storage/fs.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <system_error>

namespace dtactor {

namespace {

std::atomic<uint64_t> temp_counter{0};

std::string os_reason(int err) { return std::strerror(err); }

std::string parent_dir(const std::string& path) {
  auto parent = std::filesystem::path(path).parent_path().string();
  return parent.empty() ? std::string(".") : parent;
}

std::string unique_suffix() {
  return ".tmp." + std::to_string(::getpid()) + "." + std::to_string(temp_counter.fetch_add(1));
}

// Returns 0 or an errno value (close can report a deferred write error).
int close_fd(int fd) { return ::close(fd) == 0 ? 0 : errno; }

int sync_dir(const std::string& dir, fs_env& env) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return errno;
  int err = env.sync(fd);
  ::close(fd);
  return err;
}

}  // namespace

int fs_env::write_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    ssize_t n = ::write(fd, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
  return 0;
}

int fs_env::sync(int fd) { return ::fsync(fd) == 0 ? 0 : errno; }

int fs_env::rename(const std::string& from, const std::string& to) {
  return ::rename(from.c_str(), to.c_str()) == 0 ? 0 : errno;
}

fs_env& default_fs_env() {
  static fs_env env;
  return env;
}

status write_file_atomic(const std::string& path, const std::vector<std::string_view>& pieces, fs_env& env) {
  const std::string tmp = path + unique_suffix();
  auto fail = [&](const char* what, int err) -> status {
    ::unlink(tmp.c_str());
    return make_error("cannot write '" + path + "' (" + what + "): " + os_reason(err));
  };

  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return make_error("cannot write '" + path + "' (create temp file): " + os_reason(errno));
  for (std::string_view piece : pieces) {
    if (int err = env.write_all(fd, piece.data(), piece.size())) {
      ::close(fd);
      return fail("write", err);
    }
  }
  if (int err = env.sync(fd)) {
    ::close(fd);
    return fail("fsync", err);
  }
  if (int err = close_fd(fd)) return fail("close", err);
  if (int err = env.rename(tmp, path)) return fail("rename", err);
  if (int err = sync_dir(parent_dir(path), env))
    return make_error("wrote '" + path + "' but could not fsync its directory: " + os_reason(err));
  return {};
}

bool is_atomic_temp_name(std::string_view name) {
  // "<base>.tmp.<digits>.<digits>"
  auto digits_at = [&](size_t begin, size_t end) {
    if (begin >= end) return false;
    for (size_t i = begin; i < end; ++i)
      if (name[i] < '0' || name[i] > '9') return false;
    return true;
  };
  size_t last_dot = name.rfind('.');
  if (last_dot == std::string_view::npos || last_dot == 0) return false;
  size_t pid_dot = name.rfind('.', last_dot - 1);
  if (pid_dot == std::string_view::npos || pid_dot < 4) return false;
  if (!digits_at(last_dot + 1, name.size()) || !digits_at(pid_dot + 1, last_dot)) return false;
  return name.substr(pid_dot - 4, 4) == ".tmp" && pid_dot - 4 > 0;
}

status ensure_writable_dir(const std::string& dir) {
  auto not_writable = [&](const std::string& reason) -> status {
    return make_error("directory '" + dir + "' is not writable: " + reason);
  };
  if (dir.empty()) return make_error("directory '' is not writable: empty path");
  std::error_code ec;
  auto st = std::filesystem::status(dir, ec);
  if (std::filesystem::exists(st)) {
    if (!std::filesystem::is_directory(st)) return not_writable("it exists and is not a directory");
  } else {
    std::filesystem::create_directories(dir, ec);
    if (ec) return not_writable(ec.message());
  }
  const std::string probe = dir + "/.dtactor-probe" + unique_suffix();
  int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return not_writable(os_reason(errno));
  ::close(fd);
  if (::unlink(probe.c_str()) != 0) return not_writable("cannot remove probe file: " + os_reason(errno));
  return {};
}

result<std::string> read_file(const std::string& path) {
  auto fail = [&](int err) { return make_error("cannot read '" + path + "': " + os_reason(err)); };
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return fail(errno);
  struct stat sb {};
  if (::fstat(fd, &sb) != 0) {
    int err = errno;
    ::close(fd);
    return fail(err);
  }
  if (S_ISDIR(sb.st_mode)) {
    ::close(fd);
    return fail(EISDIR);
  }
  // Sized from fstat, read in place; grows if the file grows meanwhile.
  std::string data(static_cast<size_t>(sb.st_size) + 1, '\0');
  size_t used = 0;
  for (;;) {
    if (used == data.size()) data.resize(data.size() * 2);
    ssize_t n = ::read(fd, data.data() + used, data.size() - used);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      return fail(err);
    }
    if (n == 0) break;
    used += static_cast<size_t>(n);
  }
  data.resize(used);
  ::close(fd);
  return data;
}

status remove_file(const std::string& path) {
  if (::unlink(path.c_str()) != 0 && errno != ENOENT)
    return make_error("cannot remove '" + path + "': " + os_reason(errno));
  return {};
}

namespace {

std::string read_holder(int fd) {
  char buf[512];
  const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  if (n <= 0) return "another process";
  std::string text(buf, static_cast<size_t>(n));
  while (!text.empty() && (text.back() == '\n' || text.back() == '\0')) text.pop_back();
  return text.empty() ? "another process" : text;
}

}  // namespace

result<file_lock> file_lock::try_acquire(const std::string& path, const std::string& what) {
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return make_error("cannot open '" + path + "': " + os_reason(errno));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    std::string who = err == EWOULDBLOCK ? read_holder(fd) : std::string{};
    ::close(fd);
    if (err == EWOULDBLOCK) return make_error(who, errc::busy);
    return make_error("cannot lock '" + path + "': " + os_reason(err));
  }
  const std::string text = "pid " + std::to_string(::getpid()) + " (" + what + ")\n";
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size())) {
    // The lock holds; only the description for others is missing.
  }
  file_lock l;
  l.fd_ = fd;
  return l;
}

std::string file_lock::holder(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return {};
  std::string who;
  // A shared lock succeeds only when no exclusive holder is alive.
  if (::flock(fd, LOCK_SH | LOCK_NB) == 0)
    ::flock(fd, LOCK_UN);
  else if (errno == EWOULDBLOCK)
    who = read_holder(fd);
  ::close(fd);
  return who;
}

file_lock& file_lock::operator=(file_lock&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

file_lock::~file_lock() {
  if (fd_ >= 0) ::close(fd_);
}

std::string run_dir_lock_path(const std::string& run_dir) { return run_dir + "/.dtactor.lock"; }

std::string run_dir_busy_message(const std::string& run_dir, const error& why) {
  if (why.code != errc::busy) return "run directory '" + run_dir + "': " + why.message;
  return "run directory '" + run_dir + "' is in use by another dtactor (" + why.message +
         "); wait for it to end, stop it, or choose another --run-dir";
}

result<mapped_file> mapped_file::open(const std::string& path) {
  auto fail = [&](const std::string& why) { return make_error("'" + path + "': " + why); };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return fail(std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return fail("not a regular file");
  }
  mapped_file m;
  m.size_ = static_cast<std::size_t>(st.st_size);
  if (m.size_ > 0) {
    void* p = ::mmap(nullptr, m.size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return fail(std::string("cannot map it: ") + std::strerror(err));
    }
    m.map_ = p;
  }
  ::close(fd);  // the mapping stays
  return m;
}

mapped_file::mapped_file(mapped_file&& o) noexcept : map_(o.map_), size_(o.size_) {
  o.map_ = nullptr;
  o.size_ = 0;
}

mapped_file& mapped_file::operator=(mapped_file&& o) noexcept {
  if (this != &o) {
    if (map_) ::munmap(map_, size_);
    map_ = o.map_;
    size_ = o.size_;
    o.map_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

mapped_file::~mapped_file() {
  if (map_) ::munmap(map_, size_);
}

void mapped_file::advise_sequential() const {
  if (map_) ::madvise(map_, size_, MADV_SEQUENTIAL);
}

void mapped_file::advise_random() const {
  if (map_) ::madvise(map_, size_, MADV_RANDOM);
}

}  // namespace dtactor
