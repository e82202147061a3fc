#include "data/sample_log.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>

#include "storage/fs.hpp"

namespace dtactor {

namespace {

std::string file_safe(const std::string& s) {
  std::string out = s.empty() ? std::string("unnamed") : s;
  for (char& c : out) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
    if (!ok) c = '_';
  }
  return out;
}

const char* const fix_hint = " (set data.sample_log to a directory this user can write, or leave it empty: no audit log)";

}  // namespace

status check_sample_log_dir(const std::string& dir) {
  if (dir.empty()) return {};
  if (auto st = ensure_writable_dir(dir); !st) return make_error("data.sample_log: " + st.message() + fix_hint);
  return {};
}

result<std::unique_ptr<sample_log>> sample_log::open(const std::string& dir, const std::string& who) {
  if (auto st = check_sample_log_dir(dir); !st) return st.err();
  // A file of its own (a pid of an earlier run may have left one): only its
  // last line can then be torn, by this process dying in its write.
  const std::string stem = dir + "/samples-" + file_safe(who) + "-" + std::to_string(::getpid());
  for (int n = 0;; ++n) {
    const std::string path = stem + (n == 0 ? std::string() : "." + std::to_string(n)) + ".tsv";
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0644);
    if (fd >= 0) return std::unique_ptr<sample_log>(new sample_log(fd, path));
    if (errno != EEXIST || n >= 1000) return make_error("data.sample_log: cannot create '" + path + "': " + std::strerror(errno) + fix_hint);
  }
}

sample_log::~sample_log() {
  if (fd_ >= 0) ::close(fd_);
}

std::string sample_log::format_line(int64_t step, uint64_t generation, int global_rank, int world_size, const std::vector<int64_t>& samples,
                                    const std::vector<int>* fragments) {
  std::string line;
  line.reserve(48 + samples.size() * 8);
  line += std::to_string(step);
  line += '\t';
  line += std::to_string(generation);
  line += '\t';
  line += std::to_string(global_rank);
  line += '\t';
  line += std::to_string(world_size);
  line += '\t';
  for (size_t i = 0; i < samples.size(); ++i) {
    if (i > 0) line += ',';
    line += std::to_string(samples[i]);
  }
  if (fragments) {
    line += "\tfragments ";
    for (size_t i = 0; i < fragments->size(); ++i) {
      if (i > 0) line += ',';
      line += std::to_string((*fragments)[i]);
    }
  }
  line += '\n';
  return line;
}

std::string sample_log::format_synced_line(int64_t step, uint64_t generation, int global_rank, int world_size, int fragment, int fragments) {
  return std::to_string(step) + '\t' + std::to_string(generation) + '\t' + std::to_string(global_rank) + '\t' + std::to_string(world_size) +
         "\tsynced" + (fragment >= 0 ? " " + std::to_string(fragment) + "/" + std::to_string(fragments) : std::string()) + "\n";
}

status sample_log::append(int64_t step, uint64_t generation, int global_rank, int world_size, const std::vector<int64_t>& samples,
                          const std::vector<int>* fragments) {
  return write_line(format_line(step, generation, global_rank, world_size, samples, fragments));
}

status sample_log::append_synced(int64_t step, uint64_t generation, int global_rank, int world_size, int fragment, int fragments) {
  return write_line(format_synced_line(step, generation, global_rank, world_size, fragment, fragments));
}

status sample_log::write_line(const std::string& line) {
  // One write: with O_APPEND the line lands whole at the end of the file. A
  // short write (a full disk) is an error, not retried: a second write
  // would make the line two appends.
  for (;;) {
    const ssize_t n = ::write(fd_, line.data(), line.size());
    if (n == static_cast<ssize_t>(line.size())) return {};
    if (n < 0 && errno == EINTR) continue;
    const std::string why = n < 0 ? std::strerror(errno) : "short write (" + std::to_string(n) + " of " + std::to_string(line.size()) + " bytes)";
    return make_error("data.sample_log: cannot append to '" + path_ + "': " + why);
  }
}

namespace {

// The generation (second field) of the last whole line of `path`; nullopt
// when it has none.
result<std::optional<uint64_t>> last_generation_in(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return make_error("data.sample_log: cannot read '" + path + "': " + std::strerror(errno));
  struct stat sb {};
  if (::fstat(fd, &sb) != 0) {
    const int err = errno;
    ::close(fd);
    return make_error("data.sample_log: cannot read '" + path + "': " + std::strerror(err));
  }
  const off_t size = sb.st_size;
  // Windows growing from the end until one holds a line and the newline
  // before it (or the file's start).
  std::string buf;
  std::optional<uint64_t> out;
  for (off_t window = 64 * 1024;; window *= 4) {
    const off_t from = window >= size ? 0 : size - window;
    buf.resize(static_cast<size_t>(size - from));
    size_t got = 0;
    while (got < buf.size()) {
      const ssize_t n = ::pread(fd, buf.data() + got, buf.size() - got, from + static_cast<off_t>(got));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    buf.resize(got);
    const size_t end = buf.rfind('\n');  // a torn last line (no newline) does not count
    if (end != std::string::npos) {
      const size_t begin_nl = end == 0 ? std::string::npos : buf.rfind('\n', end - 1);
      if (begin_nl != std::string::npos || from == 0) {
        const size_t begin = begin_nl == std::string::npos ? 0 : begin_nl + 1;
        const std::string line = buf.substr(begin, end - begin);
        const size_t tab = line.find('\t');
        if (tab != std::string::npos) {
          char* stop = nullptr;
          const unsigned long long g = std::strtoull(line.c_str() + tab + 1, &stop, 10);
          if (stop != line.c_str() + tab + 1 && *stop == '\t') out = g;
        }
        break;
      }
    }
    if (from == 0) break;
  }
  ::close(fd);
  return out;
}

}  // namespace

result<uint64_t> newest_logged_generation(const std::string& dir) {
  uint64_t newest = 0;
  std::error_code ec;
  if (dir.empty() || !std::filesystem::is_directory(dir, ec)) return newest;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("samples-", 0) != 0 || name.size() < 4 || name.compare(name.size() - 4, 4, ".tsv") != 0) continue;
    auto g = last_generation_in(e.path().string());
    if (!g) return g.err();
    if (g.value()) newest = std::max(newest, *g.value());
  }
  if (ec) return make_error("data.sample_log: cannot list '" + dir + "': " + ec.message());
  return newest;
}

}  // namespace dtactor
