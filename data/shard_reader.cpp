// The shard reader (data/data_shards.hpp, docs/data.md): local shards
// mapped in place, remote ones through the node's cache (shard_cache.cpp),
// a read-ahead thread that fetches the hinted shards, and the process's
// sums of every reader's counters.
#include <algorithm>
#include <cstdlib>

#include "base/hash.hpp"
#include "data/shard_reader_impl.hpp"
#include "storage/fs.hpp"

namespace dtactor {

using namespace shard_detail;

void shard_reader::impl::go_idle(std::unique_lock<std::mutex>& lk, uint64_t seen) {
  idle = true;
  idle_wake = seen;
  core->cv.notify_all();
  core->cv.wait(lk, [&] { return stop || core->wake != seen; });
}

void shard_reader::impl::run() {
  std::unique_lock<std::mutex> lk(core->mu);
  while (!stop) {
    std::optional<size_t> pick;
    uint64_t depth = 0;
    for (size_t j : next) {
      if (!remote[j] || done.count(j)) continue;
      ++depth;
      if (!pick && !busy[j]) pick = j;
    }
    st.read_ahead_depth = depth;
    const uint64_t seen = core->wake;
    if (!pick) {
      go_idle(lk, seen);
      continue;
    }
    idle = false;
    const size_t j = *pick;
    const uint64_t generation = next_generation;
    busy[j] = true;
    lk.unlock();
    const fetch_outcome o = prefetch(j);
    lk.lock();
    busy[j] = false;
    core->cv.notify_all();
    if (o == fetch_outcome::no_room) {
      go_idle(lk, seen);  // room comes with a new hint, a get() or a released shard
      continue;
    }
    if (generation == next_generation) done.insert(j);
  }
  st.read_ahead_depth = 0;
  idle = true;
  core->cv.notify_all();
}

namespace {
struct reader_registry {
  std::mutex mu;
  std::set<const shard_reader*> live;
  shard_reader_stats gone;  // counters of readers already destroyed
};
reader_registry& registry() {
  static reader_registry r;
  return r;
}
// Adds b's counters (and the larger peak) to a; gauges are the caller's.
void add_counters(shard_reader_stats& a, const shard_reader_stats& b) {
  a.bytes_read_local += b.bytes_read_local;
  a.bytes_read_s3 += b.bytes_read_s3;
  a.cache_hits += b.cache_hits;
  a.cache_misses += b.cache_misses;
  a.shards_verified += b.shards_verified;
  a.shards_failed += b.shards_failed;
  a.cache_peak_bytes = std::max(a.cache_peak_bytes, b.cache_peak_bytes);
}
}  // namespace

result<std::unique_ptr<shard_reader>> shard_reader::open(std::vector<shard_info> shards, shard_cache_options options) {
  auto d = std::make_unique<impl>();
  const size_t n = shards.size();
  d->remote.resize(n);
  d->cache_name.resize(n);
  uint64_t largest = 0, second = 0;
  bool any_remote = false;
  for (size_t i = 0; i < n; ++i) {
    if (!is_s3(shards[i].url)) continue;
    any_remote = true;
    d->remote[i] = true;
    std::string base = split_url(shards[i].url).second.substr(0, 150);
    d->cache_name[i] = hex64(hash64(shards[i].url.data(), shards[i].url.size())) + "-" + base;
    if (shards[i].bytes > largest) {
      second = largest;
      largest = shards[i].bytes;
    } else if (shards[i].bytes > second) {
      second = shards[i].bytes;
    }
  }
  if (any_remote) {
    if (options.cache_bytes < largest + second)
      return make_error("data.cache_bytes is " + std::to_string(options.cache_bytes) + "; it must hold the two largest remote shards (" +
                        std::to_string(largest) + " + " + std::to_string(second) + " = " + std::to_string(largest + second) +
                        " bytes: one being read while the next is fetched)");
    if (options.cache_dir.empty()) {
      const char* tmp = std::getenv("TMPDIR");
      options.cache_dir = std::string(tmp && *tmp ? tmp : "/tmp") + "/dtactor-data-cache";
    }
    options.cache_dir = absolute_location(options.cache_dir);
    while (options.cache_dir.size() > 1 && options.cache_dir.back() == '/') options.cache_dir.pop_back();
    if (auto st = ensure_writable_dir(options.cache_dir); !st) return make_error("data cache: " + st.message());
    d->locks_dir = options.cache_dir + "/" + locks_subdir;
    if (auto st = ensure_writable_dir(d->locks_dir); !st) return make_error("data cache: " + st.message());
  }
  d->shards = std::move(shards);
  d->opt = std::move(options);
  d->local_maps.resize(n);
  d->held.resize(n);
  d->busy.resize(n);
  d->verified.resize(n);
  if (any_remote) {
    auto space = cache_lock::take(d->locks_dir + "/" + space_lock_name, true);
    if (!space) return make_error("data cache: " + space.message());
    const uint64_t used = d->scan().second;
    d->st.cache_used_bytes = d->st.cache_peak_bytes = used;
    d->idle = false;
    d->thread = std::thread([p = d.get()] { p->run(); });
  }
  std::unique_ptr<shard_reader> r(new shard_reader());
  r->impl_ = std::move(d);
  {
    std::lock_guard<std::mutex> lock(registry().mu);
    registry().live.insert(r.get());
  }
  return r;
}

shard_reader::~shard_reader() {
  if (!impl_) return;
  {
    // Its counters stay in the process's sums; its gauges go.
    std::lock_guard<std::mutex> lock(registry().mu);
    registry().live.erase(this);
    add_counters(registry().gone, stats());
  }
  impl_->stopping = true;
  {
    std::lock_guard<std::mutex> lock(impl_->core->mu);
    impl_->stop = true;
    ++impl_->core->wake;
    impl_->core->cv.notify_all();
  }
  if (impl_->thread.joinable()) impl_->thread.join();
}

const std::vector<shard_info>& shard_reader::shards() const { return impl_->shards; }

result<std::shared_ptr<const shard_bytes>> shard_reader::get(size_t i) {
  impl& d = *impl_;
  if (i >= d.shards.size()) return make_error("shard " + std::to_string(i) + " asked for; there are " + std::to_string(d.shards.size()));
  std::unique_lock<std::mutex> lk(d.core->mu);
  if (!d.remote[i]) {
    if (!d.local_maps[i]) {
      auto m = mapped_file::open(d.shards[i].url);
      if (!m) return make_error("shard " + m.message() + " (changed since the shards were listed?)");
      if (m->size() != d.shards[i].bytes)
        return d.shard_error(i, std::to_string(m->size()) + " bytes, " + d.says(i) + std::to_string(d.shards[i].bytes));
      d.st.bytes_read_local += m->size();
      d.local_maps[i] = std::make_shared<mapped_shard>(std::move(m.value()), nullptr);
    }
    ++d.st.cache_hits;
    return d.local_maps[i];
  }
  bool waited = false;
  for (;;) {
    if (!d.held[i].expired())
      if (auto h = d.held[i].lock()) {
        ++d.st.cache_hits;
        lk.unlock();
        d.touch(i);
        return std::shared_ptr<const shard_bytes>(std::move(h));
      }
    if (!d.busy[i]) break;
    waited = true;
    d.core->cv.wait(lk);
  }
  d.busy[i] = true;
  lk.unlock();
  auto r = d.load(i, waited);
  lk.lock();
  d.busy[i] = false;
  ++d.core->wake;
  d.core->cv.notify_all();
  if (!r) return r.err();
  d.held[i] = r->first;
  if (r->second)
    ++d.st.cache_hits;
  else
    ++d.st.cache_misses;
  return r->first;
}

void shard_reader::read_ahead(std::vector<size_t> next) {
  impl& d = *impl_;
  next.erase(std::remove_if(next.begin(), next.end(), [&](size_t i) { return i >= d.shards.size(); }), next.end());
  std::lock_guard<std::mutex> lock(d.core->mu);
  uint64_t depth = 0;
  for (size_t i : next) depth += d.remote[i] ? 1 : 0;
  d.next = std::move(next);
  ++d.next_generation;
  d.done.clear();
  if (d.thread.joinable()) {
    d.idle = false;
    d.st.read_ahead_depth = depth;
  }
  ++d.core->wake;
  d.core->cv.notify_all();
}

bool shard_reader::wait_read_ahead(std::chrono::milliseconds timeout) {
  impl& d = *impl_;
  std::unique_lock<std::mutex> lk(d.core->mu);
  if (!d.thread.joinable()) return true;
  // Idle, and no event since it decided so (a release may have made room).
  return d.core->cv.wait_for(lk, timeout, [&] { return d.stop || (d.idle && d.idle_wake == d.core->wake); });
}

std::optional<shard_reader_stats> process_shard_reader_stats() {
  std::lock_guard<std::mutex> lock(registry().mu);
  if (registry().live.empty() && registry().gone.cache_hits + registry().gone.cache_misses == 0) return std::nullopt;
  shard_reader_stats sum = registry().gone;
  for (const shard_reader* r : registry().live) {
    const auto s = r->stats();
    add_counters(sum, s);
    sum.read_ahead_depth += s.read_ahead_depth;
    sum.cache_used_bytes = std::max(sum.cache_used_bytes, s.cache_used_bytes);  // readers of one process share one directory
  }
  return sum;
}

shard_reader_stats shard_reader::stats() const {
  std::lock_guard<std::mutex> lock(impl_->core->mu);
  return impl_->st;
}

}  // namespace dtactor
