#include "storage/leader_lease.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "base/printable.hpp"

namespace dtactor {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

using clock_type = std::chrono::steady_clock;

std::string epoch_file(uint64_t epoch) { return "epoch-" + std::to_string(epoch); }
std::string beat_file(uint64_t epoch) { return "heartbeat-" + std::to_string(epoch); }

std::optional<std::string> read_small(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) return std::nullopt;
  std::string s(4096, '\0');
  in.read(s.data(), static_cast<std::streamsize>(s.size()));
  s.resize(static_cast<size_t>(in.gcount()));
  return s;
}

// Creates `p` with `text` only where it does not exist (O_EXCL: one of
// several creators wins). False: it existed.
result<bool> create_exclusive(const fs::path& p, const std::string& text) {
  const int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    if (errno == EEXIST) return false;
    return make_error("leader lease: cannot create " + printable(p.string()) + ": " + std::strerror(errno));
  }
  const bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()) && ::fsync(fd) == 0;
  ::close(fd);
  if (!ok) return make_error("leader lease: cannot write " + printable(p.string()) + ": " + std::strerror(errno));
  return true;
}

// Replaces `p` whole (a temporary file renamed over it).
status replace_file(const fs::path& p, const std::string& text) {
  const fs::path tmp = p.string() + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    if (!out.flush()) return make_error("leader lease: cannot write " + printable(tmp.string()));
  }
  std::error_code ec;
  fs::rename(tmp, p, ec);
  if (ec) return make_error("leader lease: cannot replace " + printable(p.string()) + ": " + ec.message());
  return {};
}

// A lease in a directory on a shared file system (leader_lease.hpp).
class directory_lease final : public leader_lease {
 public:
  directory_lease(fs::path dir, lease_options o) : dir_(std::move(dir)), o_(std::move(o)) {
    if (!o_.now) o_.now = [] { return clock_type::now(); };
  }

  result<lease_claim> try_acquire(const lease_holder& me) override {
    auto cur = current();
    if (!cur) return cur.err();
    if (cur->epoch > 0 && !lapsed(*cur)) return lease_claim{false, *cur};
    lease_holder mine = me;
    mine.epoch = cur->epoch + 1;
    const json text = {{"holder", mine.holder}, {"address", mine.address}};
    auto won = create_exclusive(dir_ / epoch_file(mine.epoch), text.dump());
    if (!won) return won.err();
    if (!*won) {
      auto now_held = current();  // another standby was first
      if (!now_held) return now_held.err();
      return lease_claim{false, *now_held};
    }
    held_ = mine;
    counter_ = 0;
    if (auto st = beat(false); !st) return st.err();
    forget_older(mine.epoch);
    return lease_claim{true, mine};
  }

  result<renewal> renew() override {
    if (!held_) return make_error("leader lease: renewed without holding it");
    std::error_code ec;
    if (fs::exists(dir_ / epoch_file(held_->epoch + 1), ec)) {
      held_.reset();
      return renewal::deposed;
    }
    if (auto st = beat(false); !st) return st.err();
    return renewal::renewed;
  }

  result<lease_holder> current() override {
    std::error_code ec;
    uint64_t newest = 0;
    for (const auto& e : fs::directory_iterator(dir_, ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("epoch-", 0) != 0) continue;
      char* end = nullptr;
      const unsigned long long n = std::strtoull(name.c_str() + 6, &end, 10);
      if (end && *end == '\0') newest = std::max<uint64_t>(newest, n);
    }
    if (ec) return make_error("leader lease: cannot read " + printable(dir_.string()) + ": " + ec.message());
    lease_holder h;
    h.epoch = newest;
    if (newest == 0) return h;
    const auto text = read_small(dir_ / epoch_file(newest));
    const json j = json::parse(text.value_or(""), nullptr, false);
    if (j.is_object()) {
      h.holder = j.value("holder", "");
      h.address = j.value("address", "");
    }
    return h;
  }

  status release() override {
    if (!held_) return {};
    auto st = beat(true);
    held_.reset();
    return st;
  }

 private:
  // The holder's heartbeat: its epoch's counter, one more each renewal.
  status beat(bool released) {
    const json j = {{"counter", ++counter_}, {"released", released}};
    return replace_file(dir_ / beat_file(held_->epoch), j.dump());
  }

  // The holder of `h` let it lapse: its heartbeat said released, or has
  // not changed for the TTL on this process's clock (watched from the
  // first call that saw this epoch).
  bool lapsed(const lease_holder& h) {
    const std::string beat_text = read_small(dir_ / beat_file(h.epoch)).value_or("");
    const json j = json::parse(beat_text, nullptr, false);
    if (j.is_object() && j.value("released", false)) return true;
    const auto now = o_.now();
    if (!watched_ || watched_->epoch != h.epoch || watched_->beat != beat_text) {
      watched_ = watch{h.epoch, beat_text, now};
      return false;
    }
    return now - watched_->since >= o_.ttl;
  }

  // Epochs two or more behind: nobody reads them again.
  void forget_older(uint64_t epoch) {
    std::error_code ec;
    for (uint64_t e = epoch >= 2 ? epoch - 2 : 0; e >= 1 && e + 8 > epoch; --e) {
      fs::remove(dir_ / epoch_file(e), ec);
      fs::remove(dir_ / beat_file(e), ec);
    }
  }

  struct watch {
    uint64_t epoch;
    std::string beat;
    clock_type::time_point since;
  };
  fs::path dir_;
  lease_options o_;
  std::optional<lease_holder> held_;
  uint64_t counter_ = 0;
  std::optional<watch> watched_;
};

}  // namespace

result<std::unique_ptr<leader_lease>> open_directory_lease(const std::string& dir, lease_options o) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (!fs::is_directory(dir, ec)) return make_error("leader lease: " + printable(dir) + " is not a directory that can be made");
  return std::unique_ptr<leader_lease>(std::make_unique<directory_lease>(fs::path(dir), std::move(o)));
}

std::string lease_place_problem(const std::string& where) {
  if (where.empty()) return "leader lease: no place given (etcd://HOST:PORT[/PREFIX] or a directory)";
  if (where.rfind("etcd://", 0) == 0) {
    if (where.size() == 7 || where[7] == '/') return "leader lease: " + printable(where) + " names no etcd host (etcd://HOST:PORT[/PREFIX])";
    return {};
  }
  if (where.rfind("s3://", 0) == 0)
    return "leader lease: " + printable(where) +
           ": a lease in S3 needs conditional writes (If-None-Match), which not every S3 server has; use etcd://HOST:PORT or a "
           "directory on a shared file system";
  if (where.find("://") != std::string::npos) return "leader lease: " + printable(where) + " is neither etcd://HOST:PORT[/PREFIX] nor a directory";
  return {};
}

result<std::unique_ptr<leader_lease>> open_leader_lease(const std::string& where, lease_options o) {
  if (o.ttl < std::chrono::milliseconds(100)) return make_error("leader lease: a TTL under 100 ms cannot be renewed in time");
  if (auto why = lease_place_problem(where); !why.empty()) return make_error(why);
  if (where.rfind("etcd://", 0) == 0) {
    const std::string rest = where.substr(7);
    const auto slash = rest.find('/');
    const std::string prefix = slash == std::string::npos ? "/dtactor" : rest.substr(slash);
    return open_etcd_lease(rest.substr(0, slash), prefix, std::move(o));
  }
  return open_directory_lease(where, std::move(o));
}

}  // namespace dtactor
