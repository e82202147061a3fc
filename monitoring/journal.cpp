#include "monitoring/journal.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "base/async_log.hpp"

namespace dtactor {

journal::~journal() {
  if (fd_ >= 0) ::close(fd_);
}

status journal::open(const std::string& path, fs_env& env) {
  std::lock_guard<std::mutex> lock(mu_);
  if (fd_ >= 0) ::close(fd_);
  fd_ = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) return make_error("cannot open journal '" + path + "': " + std::strerror(errno));
  env_ = &env;
  path_ = path;
  return {};
}

uint64_t journal::failed_writes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_;
}

void journal::write(const ev::journal_event& e) { write(ev::name_of(e), ev::to_json(e)); }

void journal::write(std::string_view event, const nlohmann::json& fields) {
  nlohmann::json line = nlohmann::json::object();
  line["t"] = unix_time_now();
  line["event"] = event;
  for (auto& [k, v] : fields.items()) line[k] = v;
  // Non-finite floats are not JSON; the replacement keeps the line parseable.
  std::string text = line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  std::lock_guard<std::mutex> lock(mu_);
  if (fd_ < 0) return;
  // One writer per run directory (its lock): the end is where this line starts.
  const off_t end = ::lseek(fd_, 0, SEEK_END);
  if (int err = env_->write_all(fd_, text.data(), text.size()); err != 0) {
    if (end >= 0) (void)::ftruncate(fd_, end);
    if (failed_++ == 0)
      stderr_line("dtactor: cannot write to the journal '" + path_ + "': " + std::strerror(err) + "; its lines are missing until the disk takes them again");
  }
}

}  // namespace dtactor
