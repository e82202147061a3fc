#include "rank/part_writer.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>
#include <sstream>

#include "rank/state_io.hpp"
#include "storage/checkpoint_store.hpp"
#include "storage/object_store.hpp"

namespace dtactor {

namespace {
using clock_type = std::chrono::steady_clock;
double since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }
}  // namespace

memory_room read_memory_room() {
  memory_room r;
  auto field = [](const std::string& path, const std::string& key) -> int64_t {
    std::ifstream in(path);
    std::string k;
    double v = 0;
    std::string unit;
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream ls(line);
      if (ls >> k >> v && k == key) {
        ls >> unit;
        return static_cast<int64_t>(unit == "kB" ? v * 1024 : v);
      }
    }
    return -1;
  };
  r.available = field("/proc/meminfo", "MemAvailable:");
  r.total = std::max<int64_t>(0, field("/proc/meminfo", "MemTotal:"));
  const int64_t hwm = field("/proc/self/status", "VmHWM:"), rss = field("/proc/self/status", "VmRSS:");
  if (hwm > 0 && rss > 0) r.step_headroom = std::max<int64_t>(0, hwm - rss);
  // A container's memory limit (cgroup v2, or v1's memory controller):
  // what is left below it, the file cache it may drop not counted as used.
  // A cgroup namespace shows the process's own cgroup as the root.
  auto limit_left = [&](const std::string& limit_file, const std::string& usage_file, const std::string& stat_file, const char* inactive_key) {
    std::ifstream lf(limit_file), uf(usage_file);
    std::string limit_text;
    int64_t usage = -1;
    if (!(lf >> limit_text) || limit_text == "max" || !(uf >> usage)) return false;
    const int64_t limit = std::atoll(limit_text.c_str());
    if (limit <= 0 || limit >= (int64_t{1} << 60)) return true;  // no limit set
    const int64_t inactive = std::max<int64_t>(0, field(stat_file, inactive_key));
    const int64_t left = std::max<int64_t>(0, limit - std::max<int64_t>(0, usage - inactive));
    r.available = r.available < 0 ? left : std::min(r.available, left);
    r.total = r.total > 0 ? std::min(r.total, limit) : limit;
    return true;
  };
  std::ifstream cg("/proc/self/cgroup");
  std::string line;
  while (std::getline(cg, line)) {
    const auto c1 = line.find(':'), c2 = c1 == std::string::npos ? c1 : line.find(':', c1 + 1);
    if (c2 == std::string::npos) continue;
    const std::string controllers = "," + line.substr(c1 + 1, c2 - c1 - 1) + ",", path = line.substr(c2 + 1);
    for (const std::string& dir : {"/sys/fs/cgroup/memory" + path, std::string("/sys/fs/cgroup/memory")})
      if (controllers.find(",memory,") != std::string::npos &&
          limit_left(dir + "/memory.limit_in_bytes", dir + "/memory.usage_in_bytes", dir + "/memory.stat", "total_inactive_file"))
        break;
    if (controllers == ",,")
      for (const std::string& dir : {"/sys/fs/cgroup" + path, std::string("/sys/fs/cgroup")})
        if (limit_left(dir + "/memory.max", dir + "/memory.current", dir + "/memory.stat", "inactive_file")) break;
  }
  return r;
}

bool part_buffer_fits(uint64_t bytes, int ranks, const memory_room& room) {
  if (room.available < 0) return true;
  const double margin = std::max(512.0 * (1 << 20), 0.05 * static_cast<double>(room.total));
  const double need = std::max(1, ranks) * (static_cast<double>(bytes) + static_cast<double>(room.step_headroom));
  return static_cast<double>(room.available) - need >= margin;
}

uint64_t room_for_buffer(uint64_t bytes, int ranks, const memory_room& room) {
  if (room.available < 0) return bytes;
  const double margin = std::max(512.0 * (1 << 20), 0.05 * static_cast<double>(room.total));
  const double per = (static_cast<double>(room.available) - margin) / std::max(1, ranks) - static_cast<double>(room.step_headroom);
  return per <= 0 ? 0 : std::min<uint64_t>(bytes, static_cast<uint64_t>(per));
}

part_writer::part_writer(done_fn done, bool keep_buffer) : done_(std::move(done)), keep_buffer_(keep_buffer) {
  thread_ = std::thread([this] { run(); });
}

part_writer::~part_writer() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !busy_ && !pending_; });
    quit_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

namespace {

// Why `ranges` cannot be stored ("" when they can: ascending, disjoint,
// inside the state's `state_bytes`); `total`: their bytes, 0 when not.
std::string range_problem(const std::vector<std::pair<uint64_t, uint64_t>>& ranges, uint64_t state_bytes, uint64_t& total) {
  uint64_t end = 0;
  total = 0;
  for (const auto& [a, b] : ranges) {
    if (a < end || b < a || b > state_bytes) {
      total = 0;
      return "checkpoint range [" + std::to_string(a) + ", " + std::to_string(b) + ") is not ascending, disjoint and inside the " +
             std::to_string(state_bytes) + "-byte state";
    }
    end = b;
    total += b - a;
  }
  return "";
}

// What a direct write reads: `layout`, with the entries a forward may
// change before the write ends, and that `ranges` read, cloned now.
std::shared_ptr<const state_layout> keep_for_direct(const state_layout& layout, const std::vector<std::pair<uint64_t, uint64_t>>& ranges) {
  auto kept = std::make_shared<state_layout>(layout);
  torch::NoGradGuard no_grad;
  for (auto& e : kept->entries) {
    if (stable_until_update(e.name)) continue;
    bool read = false;
    for (const auto& [a, b] : ranges) read = read || (a < e.offset + e.size && e.offset < b);
    if (read) e.t = e.t.clone(at::MemoryFormat::Contiguous);
  }
  return kept;
}

}  // namespace

double part_writer::submit(const state_layout& layout, job j, bool direct) {
  const auto t0 = clock_type::now();
  if (j.ranges.empty()) j.ranges.push_back(part_range(layout.bytes, j.rank, j.world));
  uint64_t total = 0;
  std::string error = range_problem(j.ranges, layout.bytes, total);
  if (direct) return submit_direct(layout, std::move(j), std::move(error), t0);
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !busy_ && !pending_; });
    // Any prepare() still queued is met here, so the writer thread never
    // replaces the buffer while this copy fills it.
    want_capacity_ = std::max(want_capacity_, total);
    if (want_capacity_ > capacity_ || !buf_) {
      buf_.reset();  // the old buffer goes first: never two at once
      buf_.reset(new (std::nothrow) char[std::max<uint64_t>(1, want_capacity_)]);
      capacity_ = buf_ ? want_capacity_ : 0;
      if (!buf_ && error.empty())  // this checkpoint's part fails (the committer says so); training goes on
        error = "no memory for a " + std::to_string(want_capacity_) + "-byte part buffer (set checkpoint.direct = true or auto to write without one)";
      if (!buf_) want_capacity_ = 0;
    }
  }
  if (error.empty()) {
    uint64_t at = 0;
    for (const auto& [a, b] : j.ranges) {
      copy_range(layout, a, b, buf_.get() + at);
      at += b - a;
    }
  }
  const double stall = since(t0);
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_ = pending{std::move(j), stall, std::move(error)};
  }
  cv_.notify_all();
  return stall;
}

double part_writer::submit_direct(const state_layout& layout, job j, std::string error, std::chrono::steady_clock::time_point t0) {
  // One piece's buffer (or the part buffer an earlier checkpoint kept),
  // kept; the writer thread reads the state while training computes the
  // next step's gradients. What that may change is cloned now.
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !busy_ && !pending_; });
  if (!buf_ || capacity_ < direct_piece_bytes) {
    buf_.reset(new char[direct_piece_bytes]);
    capacity_ = direct_piece_bytes;
  }
  lock.unlock();
  auto kept = error.empty() ? keep_for_direct(layout, j.ranges) : std::make_shared<const state_layout>(layout);
  pending p{std::move(j), since(t0), std::move(error)};
  p.direct = std::move(kept);
  lock.lock();
  pending_ = std::move(p);
  direct_in_flight_ = true;
  lock.unlock();
  cv_.notify_all();
  return since(t0);
}

void part_writer::prepare(uint64_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    want_capacity_ = std::max(want_capacity_, bytes);
  }
  cv_.notify_all();
}

uint64_t part_writer::buffer_bytes() {
  std::lock_guard<std::mutex> lock(mu_);
  return buf_ ? capacity_ : 0;
}

bool part_writer::writing() {
  std::lock_guard<std::mutex> lock(mu_);
  return busy_ || pending_.has_value() || want_capacity_ > capacity_;  // prepare()'s buffer counts from the call on
}

double part_writer::fence() {
  std::unique_lock<std::mutex> lock(mu_);
  if (!busy_ && !pending_) return 0;
  const auto t0 = clock_type::now();
  fenced_since_ = t0;
  cv_.wait(lock, [&] { return (!busy_ && !pending_) || (!pending_ && set_aside_rest()); });
  fenced_since_.reset();
  const double waited = since(t0);
  if (progress_) progress_->fence_s += waited;  // set aside: the write reports it as its stall
  return waited;
}

void part_writer::wait_idle() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !busy_ && !pending_; });
}

void part_writer::wait_state_unread() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !direct_in_flight_; });
}

void part_writer::set_aside_bytes(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  set_aside_bytes_ = bytes;
}

uint64_t part_writer::last_set_aside() {
  std::lock_guard<std::mutex> lock(mu_);
  return last_set_aside_;
}

bool part_writer::set_aside_rest() {
  if (!progress_) return false;
  auto& pr = *progress_;
  if (pr.rest) return true;
  if (set_aside_bytes_ == 0 || pr.total - pr.read > set_aside_bytes_) return false;
  pr.rest.reset(new char[std::max<uint64_t>(1, pr.total - pr.read)]);
  uint64_t base = 0;  // each range's first byte in the ranges' order
  for (const auto& [a, b] : pr.ranges) {
    const uint64_t lo = std::max(pr.read, base), hi = base + (b - a);
    if (lo < hi) copy_range(*pr.layout, a + (lo - base), a + (hi - base), pr.rest.get() + (lo - pr.read));
    base = hi;
  }
  pr.rest_from = pr.read;
  return true;
}

void part_writer::read_direct(const state_layout& layout, uint64_t stream_at, uint64_t pos, uint64_t n, char* dst) {
  if (piece_hook_) piece_hook_(pos);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& pr = *progress_;
    if (pr.rest && pos >= pr.rest_from)
      std::memcpy(dst, pr.rest.get() + (pos - pr.rest_from), n);
    else
      copy_range(layout, stream_at, stream_at + n, dst);  // under the lock: fence() never sets aside mid-piece
    pr.read = pos + n;
  }
  cv_.notify_all();
}

void part_writer::run() {
  while (auto p = next_write()) {
    const auto t0 = clock_type::now();
    if (p->direct && p->error.empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      progress_.emplace();
      progress_->layout = p->direct;
      progress_->ranges = p->j.ranges;
      for (const auto& [a, b] : p->j.ranges) progress_->total += b - a;
    }
    pb::checkpoint_written w = store_parts(*p);
    w.set_write_s(since(t0));
    w.set_direct(p->direct != nullptr);
    if (p->direct) {
      // Direct: the stall is submit's, what a fence that set the rest aside
      // took, and, if the training thread is waiting in fence() for this
      // write, that wait so far (it ends now).
      std::lock_guard<std::mutex> lock(mu_);
      const double fenced = progress_ ? progress_->fence_s : 0.0;
      last_set_aside_ = progress_ && progress_->rest ? progress_->total - progress_->rest_from : 0;
      progress_.reset();
      direct_in_flight_ = false;
      w.set_stall_s(p->stall_s + fenced + (fenced_since_ ? since(*fenced_since_) : 0.0));
    }
    const bool was_direct = p->direct != nullptr;
    p->direct.reset();  // the layout's clones go before the write is reported
    if (done_) done_(p->j.generation, std::move(w));
    {
      std::lock_guard<std::mutex> lock(mu_);
      busy_ = false;
      if (!keep_buffer_ && !was_direct && !pending_) {
        // checkpoint.keep_buffer = false: nothing held between checkpoints.
        buf_.reset();
        capacity_ = want_capacity_ = 0;
      }
    }
    cv_.notify_all();
  }
}

std::optional<part_writer::pending> part_writer::next_write() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return quit_ || pending_ || (want_capacity_ > capacity_ && !busy_); });
    if (pending_ || quit_ || want_capacity_ <= capacity_) break;
    grow_buffer(lock);
  }
  if (!pending_) return std::nullopt;
  std::optional<pending> p = std::move(pending_);
  pending_.reset();
  busy_ = true;
  return p;
}

void part_writer::grow_buffer(std::unique_lock<std::mutex>& lock) {
  busy_ = true;
  const uint64_t n = want_capacity_;
  buf_.reset();
  capacity_ = 0;
  lock.unlock();
  std::unique_ptr<char[]> fresh(new (std::nothrow) char[n]);
  if (fresh) std::memset(fresh.get(), 0, n);  // the pages, faulted in here rather than at the step boundary
  lock.lock();
  if (fresh) {
    buf_ = std::move(fresh);
    capacity_ = n;
  } else {
    // No memory for it now: nothing made ahead (a checkpoint makes what it
    // needs when it is taken, or fails that one alone), and no more asked.
    want_capacity_ = 0;
    std::fprintf(stderr, "checkpoint part buffer of %llu bytes could not be made ahead (no memory for it): the next checkpoint makes its own\n",
                 static_cast<unsigned long long>(n));
  }
  busy_ = false;
  cv_.notify_all();
}

pb::checkpoint_written part_writer::store_parts(const pending& p) {
  pb::checkpoint_written w;
  w.set_step(p.j.step);
  w.set_global_rank(p.j.rank);
  w.set_world_size(p.j.world);
  w.set_meta(p.j.meta);
  w.set_stall_s(p.stall_s);
  w.set_due_step(p.j.due_step);
  auto& store = stores_[p.j.store];
  if (!p.error.empty()) {
    w.set_error(p.error);
    return w;
  }
  if (!store) {
    auto opened = open_object_store(p.j.store, default_fs_env(), p.j.s3_endpoint);
    if (!opened) {
      w.set_error("checkpoint store: " + opened.message());
      return w;
    }
    store = std::shared_ptr<object_store>(std::move(opened.value()));
  }
  uint64_t at = 0;  // in the buffer: the ranges back to back
  for (size_t k = 0; k < p.j.ranges.size(); ++k) {
    const auto [a, b] = p.j.ranges[k];
    const std::string name = part_name(p.j.step, p.j.generation, p.j.rank, p.j.world, static_cast<int>(k));
    const state_layout* layout = p.direct.get();
    // Direct: a piece at a time (at most direct_piece_bytes, so that a
    // fence can set the rest aside soon), from the state or its copy.
    auto fill = [this, layout, a = a, at](uint64_t x, uint64_t n, char* dst) { read_direct(*layout, a + x, at + x, n, dst); };
    auto part = layout ? write_part(*store, name, a, b - a, fill, buf_.get(), std::min(capacity_, direct_piece_bytes))
                       : write_part(*store, name, a, buf_.get() + at, b - a);
    if (!part) {
      // The parts stored so far are orphans the next sweep takes.
      w.clear_parts();
      w.set_error(part.message());
      break;
    }
    part->set_rank(p.j.rank);
    part->set_node_id(p.j.node_id);
    *w.add_parts() = std::move(part.value());
    at += b - a;
  }
  return w;
}

}  // namespace dtactor
