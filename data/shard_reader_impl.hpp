#pragma once
// Internal to data/: the shard reader's state (shard_reader::impl), shared by
// shard_cache.cpp (the node-wide cache directory of remote shards: locks,
// room, fetch, verify) and shard_reader.cpp (the public reader and its
// read-ahead thread). Not API: data/data_shards.hpp is.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <ctime>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "data/data_shards.hpp"
#include "data/shard_names.hpp"
#include "storage/fs.hpp"
#include "storage/object_store.hpp"

namespace dtactor {

namespace shard_detail {

constexpr const char* locks_subdir = ".locks";         // lock files of the cache directory
constexpr const char* space_lock_name = "space.lock";  // held while the cache's bytes are counted and reserved

// An flock on a lock file of the cache: per shard (whoever fetches, checks
// or evicts the shard's cached file holds it) and one for the cache's space.
// The kernel drops a dead holder's lock. Lock files are never removed (a
// removed lock file would let two holders lock two different inodes).
class cache_lock {
 public:
  // wait: block until it is ours; else nullopt when someone holds it.
  static result<std::optional<cache_lock>> take(const std::string& path, bool wait);
  cache_lock(cache_lock&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  cache_lock& operator=(cache_lock&&) = delete;
  ~cache_lock() {
    if (fd_ >= 0) ::close(fd_);
  }

 private:
  cache_lock() = default;
  int fd_ = -1;
};

// Wakes the read-ahead thread; shared with the shard_bytes handed out, so
// that a release (which may free room) is an event it can wait on.
struct wake_core {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t wake = 0;
};

class mapped_shard final : public shard_bytes {
 public:
  mapped_shard(mapped_file m, std::shared_ptr<wake_core> core) : m_(std::move(m)), core_(std::move(core)) {}
  ~mapped_shard() override {
    if (!core_) return;
    std::lock_guard<std::mutex> lock(core_->mu);
    ++core_->wake;
    core_->cv.notify_all();
  }
  const uint8_t* data() const override { return m_.data(); }
  size_t size() const override { return m_.size(); }

 private:
  mapped_file m_;
  std::shared_ptr<wake_core> core_;
};

struct cache_entry {
  std::string name;
  uint64_t bytes = 0;
  timespec used{};  // mtime: get() touches a shard's file, so this is the last use on the node
};

// Least recently used first (then by name).
bool older(const cache_entry& a, const cache_entry& b);

// A cached shard's file name: 16 hex digits, '-', more.
bool is_cache_file_name(const std::string& n);

enum class fetch_outcome { done, no_room, stopped };

}  // namespace shard_detail

struct shard_reader::impl {
  std::vector<shard_info> shards;
  shard_cache_options opt;
  std::string locks_dir;
  std::vector<bool> remote;
  std::vector<std::string> cache_name;  // remote shards: file name in the cache directory
  std::shared_ptr<shard_detail::wake_core> core = std::make_shared<shard_detail::wake_core>();
  std::atomic<bool> stopping{false};

  // Guarded by core->mu. No shard_bytes may be destroyed while it is held
  // (its destructor takes it): check weak pointers with expired().
  std::vector<std::shared_ptr<const shard_bytes>> local_maps;
  std::vector<std::weak_ptr<const shard_bytes>> held;
  std::vector<bool> busy;      // a get() or the read-ahead thread is on it in this process
  std::vector<bool> verified;  // digest checked by this reader
  std::vector<size_t> next;
  uint64_t next_generation = 0;
  std::set<size_t> done;  // of `next`: handled by the read-ahead thread
  bool idle = true, stop = false;
  uint64_t idle_wake = 0;  // core->wake when the thread last found nothing more to do
  shard_reader_stats st;

  std::mutex stores_mu;
  std::map<std::string, std::unique_ptr<object_store>> stores;
  std::thread thread;

  std::string cache_path(size_t i) const { return opt.cache_dir + "/" + cache_name[i]; }
  std::string lock_path(const std::string& file) const { return locks_dir + "/" + file + ".lock"; }

  error shard_error(size_t i, const std::string& what) const { return make_error("shard " + shard_detail::printable(shards[i].url) + ": " + what); }
  std::string says(size_t i) const { return shards[i].digest.empty() ? "the listing said " : "the index says "; }

  template <class F>
  void with_stats(F f) {
    std::lock_guard<std::mutex> lock(core->mu);
    f(st);
  }

  void note_usage(uint64_t used) {
    with_stats([&](shard_reader_stats& s) {
      s.cache_used_bytes = used;
      s.cache_peak_bytes = std::max(s.cache_peak_bytes, used);
    });
  }

  // The store of shard i's location, opened once per reader.
  result<object_store*> store_for(size_t i);
  // Whether shard i's file is in the cache with the right size.
  bool cached_with_size(size_t i) const;
  // Marks shard i's cached file used now (its mtime orders eviction).
  void touch(size_t i) const;

  // The cache's files (cached shards and fetches in flight); drops temp
  // files whose fetcher died (its shard's lock is free, or is held by the
  // caller, who fetches `own` itself). Under the space lock.
  std::pair<std::vector<shard_detail::cache_entry>, uint64_t> scan(const std::string& own = "") const;
  // Counts the cache's bytes again (after a file was dropped).
  void rescan();

  // Makes room for shard i and creates its temp file at full size, so that
  // every process counts it from now on. urgent (get()): may evict shards of
  // the read-ahead hint and shards still held here (their mappings stay
  // valid), and waits for room that other processes' fetches hold; else
  // (read-ahead) evicts neither, and says no_room.
  result<std::pair<int, std::string>> reserve(size_t i, bool urgent, shard_detail::fetch_outcome& outcome);

  // Fetches shard i into the cache (the caller holds its lock): checks the
  // object's size, streams it into a reserved temp file while hashing,
  // compares the digest, renames it into place.
  result<shard_detail::fetch_outcome> fetch(size_t i, bool urgent);
  // The object of shard i is there with the size the listing or index gave.
  status check_object(size_t i, object_store& store, const std::string& name);
  // Streams shard i's object into `fd` (temp file `tmp`, reserved at full
  // size) while hashing, and checks the digest: done, or stopped when the
  // reader stops (read-ahead only), or an error. The temp file stays the
  // caller's to drop.
  result<shard_detail::fetch_outcome> copy_into(size_t i, object_store& store, const std::string& name, int fd, const std::string& tmp, bool urgent);
  // Syncs and closes `fd`, renames `tmp` to shard i's cached file under the
  // space lock; on an error `tmp` is removed.
  status install(size_t i, int fd, const std::string& tmp);

  // The cached file of shard i, mapped, if it is there and right (the
  // caller holds its lock). A file of the wrong size, or one whose digest
  // this process finds wrong (once per shard), is removed: stale, from
  // another version of the data.
  result<std::optional<std::shared_ptr<const shard_bytes>>> map_cached(size_t i);
  // get() of a remote shard whose `busy` this thread holds: (bytes, hit).
  result<std::pair<std::shared_ptr<const shard_bytes>, bool>> load(size_t i, bool waited);
  // The read-ahead thread's part for shard j.
  shard_detail::fetch_outcome prefetch(size_t j);

  // Nothing more to do until an event after `seen` (the wake count the
  // decision was made at).
  void go_idle(std::unique_lock<std::mutex>& lk, uint64_t seen);
  // The read-ahead thread: fetches what the hint names, until stop.
  void run();
};

}  // namespace dtactor
