#pragma once
// Durable file operations for small, precious files (checkpoints, journals).
// Every failure is a value whose message names the path and the OS reason.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "dtactor/result.hpp"

namespace dtactor {

// The system calls through which durable writes reach the disk
// (write_file_atomic, the checkpoint store, the journal). Whoever writes gets
// one passed in (LevelDB's Env through Options); tests pass a subclass that
// fails on purpose (disk full, I/O error). Each returns 0 on success or an
// errno value. Implementations must be thread-safe.
class fs_env {
 public:
  virtual ~fs_env() = default;
  // Writes all `size` bytes or fails; a failure may leave a prefix written.
  virtual int write_all(int fd, const char* data, size_t size);
  virtual int sync(int fd);
  virtual int rename(const std::string& from, const std::string& to);
};

// The POSIX environment (the plain system calls).
fs_env& default_fs_env();

// Replaces `path` with the concatenation of `pieces` so that a crash or a
// failure at any point leaves either the old content or the new one, never a
// mix: writes a unique temp file in the same directory (path + ".tmp.<pid>.<n>"),
// fsyncs it, renames it over `path` and fsyncs the directory. On failure the
// temp file is removed and `path` is untouched (except when only the final
// directory fsync fails: then the new content is in place but may not be
// durable yet, and an error is still returned).
status write_file_atomic(const std::string& path, const std::vector<std::string_view>& pieces, fs_env& env = default_fs_env());

// True for names write_file_atomic uses for its temp files of `path`'s kind:
// "<anything>.tmp.<pid>.<n>". Used to sweep leftovers of a crashed writer.
bool is_atomic_temp_name(std::string_view file_name);

// Creates `dir` and its parents if needed, then proves it is writable by
// creating and removing a probe file. Error: "directory '/x' is not
// writable: Permission denied" (callers prefix what the directory is for).
status ensure_writable_dir(const std::string& dir);

// The whole file. Error: "cannot read '/x': No such file or directory".
result<std::string> read_file(const std::string& path);

// Removes a file; a file that is already gone is success.
status remove_file(const std::string& path);

// An advisory lock (flock) on a file, held until the object is destroyed or
// the process ends: the kernel drops a dead process's lock, so a crashed
// holder never blocks the next one. The file holds the holder's pid and a
// description, for the message a second claimant gets. The descriptor is
// close-on-exec: child processes never inherit the lock.
class file_lock {
 public:
  // Takes the lock without waiting. Error: errc::busy with the holder's
  // description, "pid 1234 (what)", when a live process holds it; else
  // "cannot open '/x': reason" (or cannot lock).
  static result<file_lock> try_acquire(const std::string& path, const std::string& what);
  // The description "pid N (what)" of the live holder of `path`'s lock, or
  // "" when nobody holds it (also when the file does not exist).
  static std::string holder(const std::string& path);

  file_lock() = default;
  file_lock(file_lock&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  file_lock& operator=(file_lock&& o) noexcept;
  file_lock(const file_lock&) = delete;
  file_lock& operator=(const file_lock&) = delete;
  ~file_lock();
  bool held() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// The lock file of a run directory: one coordinator (or `dtactor train`)
// writes a run directory at a time.
std::string run_dir_lock_path(const std::string& run_dir);
// "run directory 'D' is in use by another dtactor (pid N (...)); ..." for
// the failed try_acquire of its lock (errc::busy), "run directory 'D': why"
// for any other failure.
std::string run_dir_busy_message(const std::string& run_dir, const error& why);

// A whole file mapped read-only (data files read in place, never copied
// whole into memory). Errors name the file: "'x': No such file or
// directory", "'x': not a regular file".
class mapped_file {
 public:
  static result<mapped_file> open(const std::string& path);

  mapped_file() = default;
  mapped_file(mapped_file&& o) noexcept;
  mapped_file& operator=(mapped_file&& o) noexcept;
  mapped_file(const mapped_file&) = delete;
  mapped_file& operator=(const mapped_file&) = delete;
  ~mapped_file();

  const uint8_t* data() const { return static_cast<const uint8_t*>(map_); }
  std::size_t size() const { return size_; }
  // Access pattern hint for the kernel: sequential (read-ahead) or random.
  void advise_sequential() const;
  void advise_random() const;

 private:
  void* map_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace dtactor
