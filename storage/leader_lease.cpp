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
#include "storage/object_store.hpp"

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

// Where a lease of files lives: a directory on a shared file system, or an
// object store whose server creates an object only where absent.
class lease_space {
 public:
  virtual ~lease_space() = default;
  // Creates `name` with `text` only where it does not exist (one of
  // several creators wins). False: it existed.
  virtual result<bool> create_exclusive(const std::string& name, const std::string& text) = 0;
  // Replaces `name` whole.
  virtual status replace(const std::string& name, const std::string& text) = 0;
  // At most 4 KiB of `name`; nullopt when it cannot be read.
  virtual std::optional<std::string> read(const std::string& name) = 0;
  virtual result<std::vector<std::string>> names() = 0;
  virtual void remove(const std::string& name) = 0;
};

// O_EXCL creates, rename replaces.
class directory_space final : public lease_space {
 public:
  explicit directory_space(fs::path dir) : dir_(std::move(dir)) {}

  result<bool> create_exclusive(const std::string& name, const std::string& text) override {
    const fs::path p = dir_ / name;
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

  status replace(const std::string& name, const std::string& text) override {
    const fs::path p = dir_ / name;
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

  std::optional<std::string> read(const std::string& name) override { return read_small(dir_ / name); }

  result<std::vector<std::string>> names() override {
    std::error_code ec;
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir_, ec)) out.push_back(e.path().filename().string());
    if (ec) return make_error("leader lease: cannot read " + printable(dir_.string()) + ": " + ec.message());
    return out;
  }

  void remove(const std::string& name) override {
    std::error_code ec;
    fs::remove(dir_ / name, ec);
  }

 private:
  fs::path dir_;
};

// Objects under an S3 prefix: created with If-None-Match: * (the server
// refuses a second creation), replaced by a plain PUT; S3's reads and
// lists are strongly consistent.
class store_space final : public lease_space {
 public:
  explicit store_space(std::unique_ptr<object_store> store) : store_(std::move(store)) {}

  result<bool> create_exclusive(const std::string& name, const std::string& text) override { return store_->put_if_absent(name, text); }
  status replace(const std::string& name, const std::string& text) override { return store_->put(name, text); }

  std::optional<std::string> read(const std::string& name) override {
    auto got = store_->get(name, 4096);
    if (!got) return std::nullopt;
    return std::move(got.value());
  }

  result<std::vector<std::string>> names() override {
    auto listed = store_->list();
    if (!listed) return listed.err();
    std::vector<std::string> out;
    for (auto& o : listed.value()) out.push_back(std::move(o.name));
    return out;
  }

  void remove(const std::string& name) override { (void)store_->remove(name); }

 private:
  std::unique_ptr<object_store> store_;
};

// A lease of files in a lease_space (leader_lease.hpp): epoch-N created
// by one winner, heartbeat-N replaced at every renewal.
class file_lease final : public leader_lease {
 public:
  file_lease(std::unique_ptr<lease_space> space, lease_options o) : space_(std::move(space)), o_(std::move(o)) {
    if (!o_.now) o_.now = [] { return clock_type::now(); };
  }

  result<lease_claim> try_acquire(const lease_holder& me) override {
    auto cur = current();
    if (!cur) return cur.err();
    if (cur->epoch > 0 && !lapsed(*cur)) return lease_claim{false, *cur};
    lease_holder mine = me;
    mine.epoch = cur->epoch + 1;
    auto won = take_epoch(mine);
    if (!won) return won.err();
    if (!*won) {
      auto now_held = current();
      if (!now_held) return now_held.err();
      return lease_claim{false, *now_held};
    }
    return lease_claim{true, mine};
  }

  result<std::optional<uint64_t>> reclaim() override {
    if (!held_) return make_error("leader lease: reclaimed without holding it");
    auto cur = current();
    if (!cur) return cur.err();
    if (cur->epoch != held_->epoch) {  // another took a newer epoch
      held_.reset();
      return std::optional<uint64_t>();
    }
    lease_holder mine = *held_;
    ++mine.epoch;
    auto won = take_epoch(mine);
    if (!won) return won.err();
    if (!*won) {
      held_.reset();
      return std::optional<uint64_t>();
    }
    return std::optional<uint64_t>(mine.epoch);
  }

  result<renewal> renew() override {
    if (!held_) return make_error("leader lease: renewed without holding it");
    if (space_->read(epoch_file(held_->epoch + 1))) {
      held_.reset();
      return renewal::deposed;
    }
    if (auto st = beat(false); !st) return st.err();
    return renewal::renewed;
  }

  result<lease_holder> current() override {
    auto names = space_->names();
    if (!names) return names.err();
    uint64_t newest = 0;
    for (const auto& name : names.value()) {
      if (name.rfind("epoch-", 0) != 0) continue;
      char* end = nullptr;
      const unsigned long long n = std::strtoull(name.c_str() + 6, &end, 10);
      if (end && *end == '\0') newest = std::max<uint64_t>(newest, n);
    }
    lease_holder h;
    h.epoch = newest;
    if (newest == 0) return h;
    const json j = json::parse(space_->read(epoch_file(newest)).value_or(""), nullptr, false);
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
  // Creates `mine`'s epoch file where absent and holds it: false when
  // another was first (unless the creation was ours and only its answer
  // was lost: a retried request).
  result<bool> take_epoch(const lease_holder& mine) {
    const std::string text = json{{"holder", mine.holder}, {"address", mine.address}}.dump();
    auto won = space_->create_exclusive(epoch_file(mine.epoch), text);
    if (!won) return won.err();
    if (!*won && space_->read(epoch_file(mine.epoch)) != text) return false;
    held_ = mine;
    counter_ = 0;
    if (auto st = beat(false); !st) return st.err();
    forget_older(mine.epoch);
    return true;
  }

  // The holder's heartbeat: its epoch's counter, one more each renewal.
  status beat(bool released) {
    const json j = {{"counter", ++counter_}, {"released", released}};
    return space_->replace(beat_file(held_->epoch), j.dump());
  }

  // The holder of `h` let it lapse: its heartbeat said released, or has
  // not changed for the TTL on this process's clock (watched from the
  // first call that saw this epoch).
  bool lapsed(const lease_holder& h) {
    const std::string beat_text = space_->read(beat_file(h.epoch)).value_or("");
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
    for (uint64_t e = epoch >= 2 ? epoch - 2 : 0; e >= 1 && e + 8 > epoch; --e) {
      space_->remove(epoch_file(e));
      space_->remove(beat_file(e));
    }
  }

  struct watch {
    uint64_t epoch;
    std::string beat;
    clock_type::time_point since;
  };
  std::unique_ptr<lease_space> space_;
  lease_options o_;
  std::optional<lease_holder> held_;
  uint64_t counter_ = 0;
  std::optional<watch> watched_;
};

// An S3 server that ignores If-None-Match would let two standbys take one
// epoch: a probe object created twice must be refused the second time.
status check_conditional_writes(object_store& store) {
  const std::string probe = "probe-" + std::to_string(::getpid()) + "-" + std::to_string(clock_type::now().time_since_epoch().count());
  auto first = store.put_if_absent(probe, "probe");
  if (!first) return first.err();
  auto second = store.put_if_absent(probe, "probe");
  (void)store.remove(probe);
  if (!second) return second.err();
  if (!*first || *second)
    return make_error("leader lease: " + printable(store.location()) +
                      " does not honour conditional writes (If-None-Match: *): one object was created twice; use etcd://HOST:PORT or a "
                      "directory on a shared file system");
  return {};
}

}  // namespace

result<std::unique_ptr<leader_lease>> open_directory_lease(const std::string& dir, lease_options o) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (!fs::is_directory(dir, ec)) return make_error("leader lease: " + printable(dir) + " is not a directory that can be made");
  return std::unique_ptr<leader_lease>(std::make_unique<file_lease>(std::make_unique<directory_space>(fs::path(dir)), std::move(o)));
}

result<std::unique_ptr<leader_lease>> open_store_lease(std::unique_ptr<object_store> store, lease_options o) {
  if (auto st = check_conditional_writes(*store); !st) return st.err();
  return std::unique_ptr<leader_lease>(std::make_unique<file_lease>(std::make_unique<store_space>(std::move(store)), std::move(o)));
}

std::string lease_place_problem(const std::string& where) {
  if (where.empty()) return "leader lease: no place given (etcd://HOST:PORT[/PREFIX] or a directory)";
  if (where.rfind("etcd://", 0) == 0) {
    if (where.size() == 7 || where[7] == '/') return "leader lease: " + printable(where) + " names no etcd host (etcd://HOST:PORT[/PREFIX])";
    return {};
  }
  if (where.rfind("s3://", 0) == 0) {
    if (where.size() == 5 || where[5] == '/') return "leader lease: " + printable(where) + " names no bucket (s3://BUCKET/PREFIX)";
    return {};
  }
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
  if (where.rfind("s3://", 0) == 0) {
    auto store = open_object_store(where, default_fs_env(), o.s3_endpoint);
    if (!store) return make_error("leader lease: " + store.message());
    return open_store_lease(std::move(store.value()), std::move(o));
  }
  return open_directory_lease(where, std::move(o));
}

}  // namespace dtactor
