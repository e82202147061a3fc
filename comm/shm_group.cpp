#include "comm/shm_group.hpp"

#include "base/process.hpp"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <new>
#include <optional>
#include <random>
#include <thread>
#include <vector>

namespace dtactor {

namespace {

constexpr uint64_t kMagic = 0x64746163746f7231ULL;  // "dtactor1"
static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<int64_t>::is_always_lock_free,
              "shared-memory counters need lock-free atomics");

struct segment_head {
  uint64_t magic;
  uint64_t nonce;
  int64_t world;
  int64_t capacity;
  char pad[32];
};
static_assert(sizeof(segment_head) == 64);

size_t round_up(size_t v, size_t m) { return (v + m - 1) / m * m; }

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }
std::string string_of(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }

std::string errno_text(const std::string& what) { return what + ": " + std::strerror(errno); }

}  // namespace

bool process_exited(int pid) {
  if (::kill(static_cast<pid_t>(pid), 0) != 0) return errno == ESRCH;
  // A process that exited but was not reaped yet (its parent died with it
  // and nobody reaps orphans, as in many containers) still answers kill(0):
  // its state in /proc says Z.
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", pid);
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT;
  char buf[512];
  const ssize_t n = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (n <= 0) return false;
  buf[n] = 0;
  const char* close_paren = std::strrchr(buf, ')');  // the name may hold anything; the state follows the last ')'
  return close_paren && close_paren[1] == ' ' && (close_paren[2] == 'Z' || close_paren[2] == 'X');
}

struct shm_group::rank_line {
  std::atomic<uint64_t> published;
  std::atomic<int64_t> pid;
  std::atomic<uint64_t> results;  // rank 0 of a host's group: results published (hierarchical exchange)
  std::atomic<uint64_t> failed;   // rank 0: 1 once its exchange across hosts failed
  std::atomic<uint64_t> consumed;  // regions up to this count read by this rank
  char pad[24];
};
static_assert(sizeof(std::atomic<uint64_t>) * 5 + 24 == 64, "one cache line per rank");
static_assert(sizeof(std::atomic<uint64_t>) == 8 && sizeof(std::atomic<int64_t>) == 8);

shm_group::rank_line* shm_group::line(int r) const {
  return reinterpret_cast<rank_line*>(static_cast<char*>(base_) + sizeof(segment_head) + 64 * static_cast<size_t>(r));
}

int64_t shm_slot_floats(int64_t step_floats, int64_t largest_floats, int64_t ring_floats, bool whole_step) {
  // Regions are rounded to 16 floats: a bucket of gradients wastes at most
  // 15 of its thousands; the constant covers ZeRO's rounds and the norm.
  const int64_t step = step_floats + step_floats / 1024 + 4096;
  if (ring_floats <= 0) return 2 * step;
  const int64_t ring = std::max(ring_floats, 2 * (largest_floats + 16));
  return std::min(2 * step, whole_step ? step + ring : ring);
}

float* shm_group::at(int r, const region& g) const {
  return reinterpret_cast<float*>(static_cast<char*>(base_) + header_bytes_) + static_cast<size_t>(r) * static_cast<size_t>(slot_stride_) +
         static_cast<size_t>(g.offset);
}

result<shm_group::region> shm_group::reserve(int64_t floats) {
  const int64_t n = static_cast<int64_t>(round_up(static_cast<size_t>(std::max<int64_t>(floats, 1)), 16));
  if (n > slot_stride_)
    return make_error("a shared-memory region of " + std::to_string(floats) + " floats does not fit the segment's slot of " +
                      std::to_string(capacity_));
  // The live regions lie in the ring in reservation order from ring_pos_
  // on (oldest first): the ones the new region covers are a prefix of
  // them. Wrapping skips the end of the ring: what lies there is older
  // than what the new region covers at the start, so it goes too. A region
  // leaves the list once anything covers part of it, but its rest is still
  // read until it is consumed: so a new region waits for the newest region
  // ever covered (popped_), not only for those it covers itself.
  region g;
  g.floats = floats;
  g.offset = ring_pos_;
  auto pop = [this] {
    popped_ = live_.front().count;
    live_.pop_front();
  };
  if (g.offset + n > slot_stride_) {
    while (!live_.empty() && live_.front().offset >= ring_pos_) pop();
    g.offset = 0;
  }
  while (!live_.empty() && live_.front().offset < g.offset + n && live_.front().offset >= g.offset) pop();
  g.free_after = popped_;
  g.count = ++reserved_;
  ring_pos_ = g.offset + n;
  live_.push_back(g);
  return g;
}

bool shm_group::is_free(const region& g) const {
  for (int r = 0; r < world_; ++r)
    if (consumed(r) < g.free_after) return false;
  return true;
}

status shm_group::wait_free(const region& g, std::chrono::steady_clock::time_point deadline, const std::function<bool()>& abandon,
                            std::chrono::microseconds spin, const std::string& what, const std::function<status()>& progress) const {
  status failed;
  return wait_until(
      [&] {
        if (is_free(g)) return true;
        if (progress && failed.ok()) failed = progress();
        return is_free(g);
      },
      [&] {
        if (!failed.ok()) return failed.message();
        for (int r = 0; r < world_; ++r)
          if (consumed(r) < g.free_after)
            if (auto gn = gone(r); !gn.empty()) return gn;
        return std::string();
      },
      deadline, abandon, spin, what);
}

void shm_group::publish(const region& g) { line(rank_)->published.store(g.count, std::memory_order_release); }

void shm_group::consume(uint64_t count) { line(rank_)->consumed.store(count, std::memory_order_release); }

uint64_t shm_group::consumed(int r) const { return line(r)->consumed.load(std::memory_order_acquire); }

uint64_t shm_group::published(int r) const { return line(r)->published.load(std::memory_order_acquire); }

std::string shm_group::gone(int r) const {
  if (!check_pids_ || r == rank_) return "";
  const auto pid = static_cast<pid_t>(line(r)->pid.load(std::memory_order_relaxed));
  if (pid <= 0 || !process_exited(pid)) return "";
  return "rank " + std::to_string(r) + " (pid " + std::to_string(pid) + ") on this host exited";
}

void shm_group::publish_result(uint64_t count) { line(0)->results.store(count, std::memory_order_release); }

void shm_group::fail() { line(0)->failed.store(1, std::memory_order_release); }

status shm_group::wait_until(const std::function<bool()>& ready, const std::function<std::string()>& problem,
                             std::chrono::steady_clock::time_point deadline, const std::function<bool()>& abandon,
                             std::chrono::microseconds spin, const std::string& what) const {
  using clock = std::chrono::steady_clock;
  if (ready()) return {};
  const auto spin_until = clock::now() + spin;
  auto next_check = clock::now();
  for (;;) {
    if (ready()) return {};
    const auto now = clock::now();
    if (now >= next_check) {
      next_check = now + std::chrono::milliseconds(1);
      if (abandon && abandon()) return make_error(what + " abandoned: a newer generation replaces this one");
      if (auto p = problem(); !p.empty()) return make_error(what + " failed: " + p);
      if (now >= deadline) return make_error(what + " timed out (cluster.collective_timeout_ms)");
    }
    if (now < spin_until)
      ::sched_yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

bool shm_group::all_published(uint64_t count) const {
  for (int r = 0; r < world_; ++r)
    if (published(r) < count) return false;
  return true;
}

status shm_group::wait_all(uint64_t count, std::chrono::steady_clock::time_point deadline, const std::function<bool()>& abandon,
                           std::chrono::microseconds spin, const std::string& what) const {
  return wait_until(
      [&] { return all_published(count); },
      [&] {
        for (int r = 0; r < world_; ++r)
          if (published(r) < count)
            if (auto g = gone(r); !g.empty()) return g;
        return std::string();
      },
      deadline, abandon, spin, what);
}

status shm_group::wait_result(uint64_t count, std::chrono::steady_clock::time_point deadline, const std::function<bool()>& abandon,
                              std::chrono::microseconds spin, const std::string& what) const {
  return wait_until([&] { return line(0)->results.load(std::memory_order_acquire) >= count; },
                    [&] {
                      if (line(0)->failed.load(std::memory_order_acquire) != 0)
                        return std::string("rank 0 of this host's group, which exchanges the host's sum with the other hosts, failed");
                      return gone(0);
                    },
                    deadline, abandon, spin, what);
}

namespace {

// What rank 0 publishes in the store: the segment's name, its nonce (also
// in the segment's head, so that a stale segment of the same name is told
// apart) and rank 0's network namespace.
struct segment_id {
  std::string name;
  uint64_t nonce = 0;
  std::string net;
};

std::string published_text(const segment_id& id) { return id.name + " " + std::to_string(id.nonce) + " " + id.net; }

// Parses published_text; nullopt for "" (rank 0 could not create it).
// Throws (std::stoull) on a nonce that is not a number.
std::optional<segment_id> parse_published(const std::string& v) {
  const auto sp = v.find(' ');
  if (v.empty() || sp == std::string::npos) return std::nullopt;
  segment_id id;
  id.name = v.substr(0, sp);
  const auto sp2 = v.find(' ', sp + 1);
  id.nonce = std::stoull(v.substr(sp + 1, sp2 == std::string::npos ? std::string::npos : sp2 - sp - 1));
  id.net = sp2 == std::string::npos ? std::string() : v.substr(sp2 + 1);
  return id;
}

// Maps `bytes` of `fd` shared and closes `fd`: the mapping, or null with
// the reason in `problem`.
void* map_segment(int fd, size_t bytes, std::string& problem) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p != MAP_FAILED) return p;
  problem = errno_text("mmap of " + std::to_string(bytes) + " bytes");
  return nullptr;
}

// Reserves [offset, offset + bytes) of the segment's pages now: a tmpfs
// too small would otherwise SIGBUS on first touch. The pages are charged to
// the caller's memory cgroup, so each rank reserves what it writes (rank 0
// the header and its slot, every other rank its own slot): under a memory
// cap a rank each, rank 0 does not carry every rank's slot (8 ranks of
// 64 MiB rings: 512 MiB on rank 0 alone).
std::string reserve_pages(int fd, size_t offset, size_t bytes) {
  if (int e = ::posix_fallocate(fd, static_cast<off_t>(offset), static_cast<off_t>(bytes)); e != 0)
    return "reserving " + std::to_string(bytes) + " bytes in /dev/shm: " + std::strerror(e);
  return {};
}

// Rank 0: creates a new segment of `bytes` under a fresh name (into `id`,
// set before anything can fail, so that the caller unlinks it), reserves
// its first `own_bytes` and maps it. Returns the mapping, or null with the
// reason in `problem`.
void* create_segment(size_t bytes, size_t own_bytes, segment_id& id, std::string& problem) {
  std::random_device rd;
  id.nonce = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  id.net = net_namespace();
  char buf[64];
  std::snprintf(buf, sizeof buf, "/dtactor-%d-%016llx", static_cast<int>(::getpid()), static_cast<unsigned long long>(id.nonce));
  id.name = buf;
  const int fd = ::shm_open(id.name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    problem = errno_text("shm_open " + id.name);
    return nullptr;
  }
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    problem = errno_text("sizing " + id.name + " to " + std::to_string(bytes) + " bytes");
    ::close(fd);
    return nullptr;
  }
  if (problem = reserve_pages(fd, 0, own_bytes); !problem.empty()) {
    ::close(fd);
    return nullptr;
  }
  return map_segment(fd, bytes, problem);
}

// Ranks other than 0: maps the segment rank 0 published, if it is of this
// host (network namespace), of `bytes` and of this group (`world`,
// `capacity`, the nonce). Returns the mapping (left to the caller even when
// the head does not match), or null; the reason in `problem`.
void* open_segment(const segment_id& id, size_t bytes, size_t own_offset, size_t own_bytes, int64_t world, int64_t capacity, std::string& problem) {
  // Processes in different network namespaces are different hosts as far
  // as the network goes (the project's test hosts share /dev/shm): their
  // gradients must cross the network, not this segment.
  if (id.net != net_namespace()) {
    problem = "another network namespace (" + id.net + " and " + net_namespace() + "): a separate host";
    return nullptr;
  }
  const int fd = ::shm_open(id.name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    problem = errno_text("shm_open " + id.name);  // another host or IPC namespace
    return nullptr;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
    problem = "segment " + id.name + " has another size";
    ::close(fd);
    return nullptr;
  }
  if (problem = reserve_pages(fd, own_offset, own_bytes); !problem.empty()) {
    ::close(fd);
    return nullptr;
  }
  void* base = map_segment(fd, bytes, problem);
  if (!base) return nullptr;
  const auto* head = static_cast<const segment_head*>(base);
  if (head->magic != kMagic || head->nonce != id.nonce || head->world != world || head->capacity != capacity)
    problem = "segment " + id.name + " belongs to another group";
  return base;
}

// Tells the others whether this rank mapped the segment (`problem` empty)
// and hears whether all did: returns this rank's problem, "peer" when only
// others failed; the first failing rank's reason goes to *why_not. Throws
// what the store throws.
std::string agree_on_segment(c10d::Store& store, int rank, int world, std::string problem, std::string* why_not) {
  store.set("shm_ok/" + std::to_string(rank), bytes_of(problem.empty() ? "1" : "0 rank " + std::to_string(rank) + ": " + problem));
  for (int r = 0; r < world; ++r) {
    const std::string ok = string_of(store.get("shm_ok/" + std::to_string(r)));
    if (ok != "1" && why_not && why_not->empty()) *why_not = ok.size() > 2 ? ok.substr(2) : "rank " + std::to_string(r) + " could not map it";
    if (ok != "1") problem = problem.empty() ? "peer" : problem;
  }
  return problem;
}

}  // namespace

result<std::shared_ptr<shm_group>> shm_group::join(c10d::Store& store, int rank, int world, int64_t capacity, std::string* why_not) {
  std::shared_ptr<shm_group> g(new shm_group());
  g->rank_ = rank;
  g->world_ = world;
  g->capacity_ = capacity;
  g->slot_stride_ = static_cast<int64_t>(round_up(static_cast<size_t>(std::max<int64_t>(capacity, 1)), 16));
  g->header_bytes_ = round_up(sizeof(segment_head) + 64 * static_cast<size_t>(world), 4096);
  g->total_bytes_ = g->header_bytes_ + static_cast<size_t>(world) * static_cast<size_t>(g->slot_stride_) * sizeof(float);
  const size_t slot_bytes = static_cast<size_t>(g->slot_stride_) * sizeof(float);

  segment_id id;
  std::string problem;
  try {
    if (rank == 0) {
      g->base_ = create_segment(g->total_bytes_, g->header_bytes_ + slot_bytes, id, problem);
      if (g->base_) {
        auto* head = new (g->base_) segment_head{};
        for (int r = 0; r < world; ++r) new (g->line(r)) rank_line{};
        head->nonce = id.nonce;
        head->world = world;
        head->capacity = capacity;
        std::atomic_thread_fence(std::memory_order_release);
        head->magic = kMagic;
      }
      store.set("shm_name", bytes_of(problem.empty() ? published_text(id) : std::string()));
    } else if (auto published = parse_published(string_of(store.get("shm_name")))) {
      id = *published;
      g->base_ = open_segment(id, g->total_bytes_, g->header_bytes_ + static_cast<size_t>(rank) * slot_bytes, slot_bytes, world, capacity, problem);
    } else {
      problem = "rank 0 could not create the segment";
    }
    if (problem.empty()) g->line(rank)->pid.store(static_cast<int64_t>(::getpid()), std::memory_order_release);
    problem = agree_on_segment(store, rank, world, problem, why_not);
  } catch (const std::exception& e) {
    if (rank == 0 && !id.name.empty()) ::shm_unlink(id.name.c_str());
    std::string what = e.what();
    return make_error("shared-memory rendezvous: " + what.substr(0, what.find('\n')));
  }
  // Everyone has mapped it (or given up): the name is no longer needed.
  if (rank == 0 && !id.name.empty()) ::shm_unlink(id.name.c_str());
  if (!problem.empty()) return std::shared_ptr<shm_group>();

  // Peers' pids are used to notice their death; only where they are visible
  // (same pid namespace).
  g->check_pids_ = true;
  for (int r = 0; r < world; ++r) {
    const auto pid = static_cast<pid_t>(g->line(r)->pid.load(std::memory_order_acquire));
    if (r != rank && (pid <= 0 || (::kill(pid, 0) != 0 && errno == ESRCH))) g->check_pids_ = false;
  }
  return g;
}

shm_group::~shm_group() {
  if (base_) ::munmap(base_, total_bytes_);
}

}  // namespace dtactor
