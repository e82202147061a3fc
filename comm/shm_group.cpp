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

result<std::shared_ptr<shm_group>> shm_group::join(c10d::Store& store, int rank, int world, int64_t capacity, std::string* why_not) {
  std::shared_ptr<shm_group> g(new shm_group());
  g->rank_ = rank;
  g->world_ = world;
  g->capacity_ = capacity;
  g->slot_stride_ = static_cast<int64_t>(round_up(static_cast<size_t>(std::max<int64_t>(capacity, 1)), 16));
  g->header_bytes_ = round_up(sizeof(segment_head) + 64 * static_cast<size_t>(world), 4096);
  g->total_bytes_ = g->header_bytes_ + static_cast<size_t>(world) * static_cast<size_t>(g->slot_stride_) * sizeof(float);

  std::string name, problem;
  uint64_t nonce = 0;
  auto map_fd = [&](int fd) {
    void* p = ::mmap(nullptr, g->total_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) {
      problem = errno_text("mmap of " + std::to_string(g->total_bytes_) + " bytes");
      return false;
    }
    g->base_ = p;
    return true;
  };
  try {
    if (rank == 0) {
      std::random_device rd;
      nonce = (static_cast<uint64_t>(rd()) << 32) ^ rd();
      char buf[64];
      std::snprintf(buf, sizeof buf, "/dtactor-%d-%016llx", static_cast<int>(::getpid()), static_cast<unsigned long long>(nonce));
      name = buf;
      const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd < 0) {
        problem = errno_text("shm_open " + name);
      } else if (int e = ::posix_fallocate(fd, 0, static_cast<off_t>(g->total_bytes_)); e != 0) {
        // Reserve the pages now: a tmpfs too small would otherwise SIGBUS on first touch.
        problem = "reserving " + std::to_string(g->total_bytes_) + " bytes in /dev/shm: " + std::strerror(e);
        ::close(fd);
      } else if (map_fd(fd)) {
        auto* head = new (g->base_) segment_head{};
        for (int r = 0; r < world; ++r) new (g->line(r)) rank_line{};
        head->nonce = nonce;
        head->world = world;
        head->capacity = capacity;
        std::atomic_thread_fence(std::memory_order_release);
        head->magic = kMagic;
      }
      store.set("shm_name", bytes_of(problem.empty() ? name + " " + std::to_string(nonce) + " " + net_namespace() : std::string()));
    } else {
      const std::string v = string_of(store.get("shm_name"));
      const auto sp = v.find(' ');
      if (v.empty() || sp == std::string::npos) {
        problem = "rank 0 could not create the segment";
      } else {
        name = v.substr(0, sp);
        const auto sp2 = v.find(' ', sp + 1);
        nonce = std::stoull(v.substr(sp + 1, sp2 == std::string::npos ? std::string::npos : sp2 - sp - 1));
        const std::string their_net = sp2 == std::string::npos ? std::string() : v.substr(sp2 + 1);
        // Processes in different network namespaces are different hosts as
        // far as the network goes (the project's test hosts share /dev/shm):
        // their gradients must cross the network, not this segment.
        const int fd = their_net != net_namespace() ? -1 : ::shm_open(name.c_str(), O_RDWR, 0);
        struct stat st {};
        if (their_net != net_namespace()) {
          problem = "another network namespace (" + their_net + " and " + net_namespace() + "): a separate host";
        } else if (fd < 0) {
          problem = errno_text("shm_open " + name);  // another host or IPC namespace
        } else if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != g->total_bytes_) {
          problem = "segment " + name + " has another size";
          ::close(fd);
        } else if (map_fd(fd)) {
          const auto* head = static_cast<const segment_head*>(g->base_);
          if (head->magic != kMagic || head->nonce != nonce || head->world != world || head->capacity != capacity)
            problem = "segment " + name + " belongs to another group";
        }
      }
    }
    if (problem.empty()) g->line(rank)->pid.store(static_cast<int64_t>(::getpid()), std::memory_order_release);
    store.set("shm_ok/" + std::to_string(rank), bytes_of(problem.empty() ? "1" : "0 rank " + std::to_string(rank) + ": " + problem));
    for (int r = 0; r < world; ++r) {
      const std::string ok = string_of(store.get("shm_ok/" + std::to_string(r)));
      if (ok != "1" && why_not && why_not->empty()) *why_not = ok.size() > 2 ? ok.substr(2) : "rank " + std::to_string(r) + " could not map it";
      if (ok != "1") problem = problem.empty() ? "peer" : problem;
    }
  } catch (const std::exception& e) {
    if (rank == 0 && !name.empty()) ::shm_unlink(name.c_str());
    std::string what = e.what();
    return make_error("shared-memory rendezvous: " + what.substr(0, what.find('\n')));
  }
  // Everyone has mapped it (or given up): the name is no longer needed.
  if (rank == 0 && !name.empty()) ::shm_unlink(name.c_str());
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
