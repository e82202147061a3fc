#include "comm/peer_moves.hpp"

#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <system_error>
#include <thread>
#include <algorithm>

#include "base/hash.hpp"
#include "comm/communicator.hpp"

namespace dtactor {

namespace {

// The word a peer reads to prove it can: its value is this process's own.
std::atomic<uint64_t> proof_word{0};

uint64_t proof_value() {
  uint64_t v = proof_word.load();
  if (v != 0) return v;
  const auto now = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  v = hash64(&now, sizeof now, static_cast<uint64_t>(::getpid())) | 1;
  uint64_t expected = 0;
  return proof_word.compare_exchange_strong(expected, v) ? v : expected;
}

uint64_t ns_inode(const char* path) {
  struct stat st {};
  return ::stat(path, &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

// The kernel's boot id (a UUID) as two words; zeros when unreadable.
std::pair<uint64_t, uint64_t> boot_id() {
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string line, hex;
  std::getline(f, line);
  for (char c : line)
    if (std::isxdigit(static_cast<unsigned char>(c))) hex += c;
  if (hex.size() != 32) return {0, 0};
  return {std::stoull(hex.substr(0, 16), nullptr, 16), std::stoull(hex.substr(16), nullptr, 16)};
}

// Reads `n` bytes at `from` in process `pid` into `to`: 0, or the errno.
int read_peer(int64_t pid, uint64_t from, void* to, uint64_t n) {
  uint64_t done = 0;
  while (done < n) {
    iovec local{static_cast<char*>(to) + done, static_cast<size_t>(n - done)};
    iovec remote{reinterpret_cast<void*>(from + done), static_cast<size_t>(n - done)};
    const ssize_t got = ::process_vm_readv(static_cast<pid_t>(pid), &local, 1, &remote, 1, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return got < 0 ? errno : EIO;
    done += static_cast<uint64_t>(got);
  }
  return 0;
}

// A move's digest: XXH3 of the XXH3 digests of its 8 MiB parts, so that
// both sides compute it (and the receiver reads) on several threads at
// once: one thread's page faults and copies are what bound a read into
// fresh pages, and over loopback TCP the sender's and the receiver's
// threads shared that work.
constexpr uint64_t digest_part = 8ull << 20;

// fn(first, last) over the parts of `n` bytes, cut among up to as many
// threads as the machine has (8 at most); the calling thread takes one share.
void over_parts(uint64_t n, const std::function<void(uint64_t, uint64_t)>& fn) {
  const uint64_t parts = (n + digest_part - 1) / digest_part;
  const uint64_t threads = std::min<uint64_t>({parts, std::max(1u, std::thread::hardware_concurrency()), 8});
  if (threads <= 1) return fn(0, parts);
  std::vector<std::thread> others;
  std::vector<std::pair<uint64_t, uint64_t>> here;  // shares no thread could be started for
  for (uint64_t t = 1; t < threads; ++t) {
    try {
      others.emplace_back(fn, parts * t / threads, parts * (t + 1) / threads);
    } catch (const std::system_error&) {
      here.emplace_back(parts * t / threads, parts * (t + 1) / threads);
    }
  }
  fn(0, parts / threads);
  for (const auto& [a, b] : here) fn(a, b);
  for (auto& t : others) t.join();
}

uint64_t combined(const std::vector<uint64_t>& parts) { return hash64(parts.data(), parts.size() * sizeof(uint64_t)); }

uint64_t digest_of(const void* data, uint64_t n) {
  const auto* p = static_cast<const char*>(data);
  std::vector<uint64_t> d((n + digest_part - 1) / digest_part);
  over_parts(n, [&](uint64_t a, uint64_t b) {
    for (uint64_t i = a; i < b; ++i) d[i] = hash64(p + i * digest_part, std::min(digest_part, n - i * digest_part));
  });
  return combined(d);
}

// Makes the whole pages inside [p, p + n) resident and zero-filled in one
// call (MADV_POPULATE_WRITE, Linux 5.14), so that a read into fresh pages
// does not take a fault on each page inside the kernel's copy (faster into
// fresh pages: bench_peer_moves). A kernel that refuses it (EINVAL) leaves
// the read to fault them in.
void populate(char* p, uint64_t n) {
#ifdef MADV_POPULATE_WRITE
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t lo = (reinterpret_cast<uintptr_t>(p) + page - 1) & ~(page - 1), hi = reinterpret_cast<uintptr_t>(p + n) & ~(page - 1);
  if (hi > lo) ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_POPULATE_WRITE);
#else
  (void)p;
  (void)n;
#endif
}

// Reads `n` bytes at `from` in process `pid` into `to` on several threads,
// each part's digest taken as it lands: 0 and the digest, or the errno.
std::pair<int, uint64_t> read_peer_digest(int64_t pid, uint64_t from, void* to, uint64_t n) {
  auto* p = static_cast<char*>(to);
  std::vector<uint64_t> d((n + digest_part - 1) / digest_part);
  std::atomic<int> failed{0};
  over_parts(n, [&](uint64_t a, uint64_t b) {
    for (uint64_t i = a; i < b && failed.load() == 0; ++i) {
      const uint64_t at = i * digest_part, len = std::min(digest_part, n - at);
      populate(p + at, len);
      if (const int e = read_peer(pid, from + at, p + at, len); e != 0) {
        failed = e;
        return;
      }
      d[i] = hash64(p + at, len);
    }
  });
  return {failed.load(), combined(d)};
}

// Row of `columns` int64 from every rank of `pg`.
result<std::vector<torch::Tensor>> gather_rows(c10d::ProcessGroup& pg, const torch::Tensor& mine, std::chrono::steady_clock::time_point deadline,
                                                const std::function<bool()>& abandon, const std::string& what) {
  std::vector<std::vector<torch::Tensor>> rows(1);
  for (int r = 0; r < pg.getSize(); ++r) rows[0].push_back(torch::empty_like(mine));
  std::vector<torch::Tensor> ins{mine};
  try {
    if (auto st = wait_work(pg.allgather(rows, ins), deadline, abandon, what); !st) return st.err();
  } catch (const std::exception& e) {
    std::string m = e.what();
    return make_error(what + " could not start: " + m.substr(0, m.find('\n')));
  }
  return rows[0];
}

// A move's digest over the group goes under its tag plus this.
constexpr int digest_tag = 1 << 30;

enum class answer : int64_t { read = 0, changed = -1, wrong_size = -2 };

std::string answer_text(int64_t a) {
  if (a == static_cast<int64_t>(answer::changed)) return "the bytes changed while it read them";
  if (a == static_cast<int64_t>(answer::wrong_size)) return "it expects another byte count";
  return std::strerror(static_cast<int>(a));
}

}  // namespace

local_peers local_peers::none(int world) {
  local_peers t;
  t.pids_.assign(static_cast<size_t>(world), 0);
  t.readable_.assign(static_cast<size_t>(world), std::vector<uint64_t>(static_cast<size_t>((world + 63) / 64), 0));
  return t;
}

result<local_peers> local_peers::agree(c10d::ProcessGroup& pg, std::chrono::steady_clock::time_point deadline, const std::function<bool()>& abandon) {
  const int world = pg.getSize(), me = pg.getRank();
  local_peers t = none(world);
  // Every member's group has the same backend: all return here, or none.
  if (dynamic_cast<c10d::ProcessGroupGloo*>(&pg) == nullptr) return t;
  const auto [boot_hi, boot_lo] = boot_id();
  const uint64_t value = proof_value();
  // [known, boot id (2), pid namespace, network namespace, pid, the word's address, its value]
  const std::vector<uint64_t> place{boot_hi != 0 ? 1u : 0u, boot_hi, boot_lo, ns_inode("/proc/self/ns/pid"), ns_inode("/proc/self/ns/net"),
                                    static_cast<uint64_t>(::getpid()), reinterpret_cast<uint64_t>(&proof_word), value};
  auto row = torch::empty({static_cast<int64_t>(place.size())}, torch::kInt64);
  std::memcpy(row.data_ptr(), place.data(), place.size() * sizeof(uint64_t));
  auto places = gather_rows(pg, row, deadline, abandon, "who runs on this host (place)");
  if (!places) return places.err();
  auto bits = torch::zeros({static_cast<int64_t>(t.readable_[0].size())}, torch::kInt64);
  for (int r = 0; r < world; ++r) {
    const auto* p = reinterpret_cast<const uint64_t*>(places.value()[static_cast<size_t>(r)].data_ptr());
    t.pids_[static_cast<size_t>(r)] = static_cast<int64_t>(p[5]);
    const bool same_host = p[0] == 1 && place[0] == 1 && p[1] == boot_hi && p[2] == boot_lo && p[3] == place[3] && p[4] == place[4];
    uint64_t seen = 0;
    if (r != me && same_host && read_peer(static_cast<int64_t>(p[5]), p[6], &seen, sizeof seen) == 0 && seen == p[7])
      reinterpret_cast<uint64_t*>(bits.data_ptr())[r / 64] |= uint64_t{1} << (r % 64);
  }
  auto readable = gather_rows(pg, bits, deadline, abandon, "who runs on this host (reads)");
  if (!readable) return readable.err();
  for (int r = 0; r < world; ++r) {
    const auto* w = reinterpret_cast<const uint64_t*>(readable.value()[static_cast<size_t>(r)].data_ptr());
    t.readable_[static_cast<size_t>(r)].assign(w, w + t.readable_[0].size());
  }
  return t;
}

bool local_peers::reads(int receiver, int sender) const {
  if (receiver < 0 || sender < 0 || receiver >= world() || sender >= world() || receiver == sender) return false;
  return (readable_[static_cast<size_t>(receiver)][static_cast<size_t>(sender / 64)] >> (sender % 64)) & 1;
}

struct peer_moves::move {
  bool send = false, memory = false;
  int peer = -1, tag = 0;
  torch::Tensor t;
  // Over the group: the data's work and its digest's. Through memory: the
  // sender's offer and the receiver's answer, each a work and its tensor.
  std::vector<torch::Tensor> data, digest;
  c10::intrusive_ptr<c10d::Work> data_work, digest_work;
  std::vector<torch::Tensor> offer, reply;
  c10::intrusive_ptr<c10d::Work> offer_work, reply_work;
  uint64_t bytes() const { return static_cast<uint64_t>(t.numel()) * t.element_size(); }
};

namespace {
std::unique_ptr<peer_moves::move> make_move(bool send, bool memory, int peer, int tag, const torch::Tensor& t) {
  auto m = std::make_unique<peer_moves::move>();
  m->send = send;
  m->memory = memory;
  m->peer = peer;
  m->tag = tag;
  m->t = t;
  return m;
}
}  // namespace

peer_moves::peer_moves(c10d::ProcessGroup& pg, const local_peers& local, p2p_waits waits) : pg_(pg), local_(local), waits_(std::move(waits)) {}
peer_moves::~peer_moves() = default;  // each work keeps its own tensors while it runs (the caller aborts it)

c10::intrusive_ptr<c10d::Work> peer_moves::issue(c10::intrusive_ptr<c10d::Work> w) { return waits_.issued ? waits_.issued(std::move(w)) : w; }

void peer_moves::send(const torch::Tensor& t, int peer, int tag) {
  auto m = make_move(true, local_.reads(peer, pg_.getRank()), peer, tag, t);
  TORCH_CHECK(!m->memory || (t.device().is_cpu() && t.is_contiguous()), "peer_moves: a contiguous CPU tensor");
  if (m->memory) {
    const uint64_t digest = digest_of(t.data_ptr(), m->bytes());
    m->offer = {torch::tensor({static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr())), static_cast<int64_t>(m->bytes()),
                               static_cast<int64_t>(digest)},
                              torch::kInt64)};
    m->offer_work = issue(pg_.send(m->offer, peer, tag));
    m->reply = {torch::zeros({1}, torch::kInt64)};
    m->reply_work = issue(pg_.recv(m->reply, peer, tag));
  } else {
    m->data = {t};
    m->data_work = issue(pg_.send(m->data, peer, tag));
    m->digest = {torch::tensor({static_cast<int64_t>(digest_of(t.data_ptr(), m->bytes()))}, torch::kInt64)};
    m->digest_work = issue(pg_.send(m->digest, peer, tag + digest_tag));
  }
  open_.push_back(std::move(m));
}

void peer_moves::recv(const torch::Tensor& t, int peer, int tag) {
  auto m = make_move(false, local_.reads(pg_.getRank(), peer), peer, tag, t);
  TORCH_CHECK(!m->memory || (t.device().is_cpu() && t.is_contiguous()), "peer_moves: a contiguous CPU tensor");
  if (m->memory) {
    m->offer = {torch::zeros({3}, torch::kInt64)};
    m->offer_work = issue(pg_.recv(m->offer, peer, tag));
  } else {
    m->data = {t};
    m->data_work = issue(pg_.recv(m->data, peer, tag));
    m->digest = {torch::zeros({1}, torch::kInt64)};
    m->digest_work = issue(pg_.recv(m->digest, peer, tag + digest_tag));
  }
  open_.push_back(std::move(m));
}

// The receiving side of a move through memory: the offer, the read, the
// digest, and the answer (sent whatever became of the read, so that the
// sender never waits for nothing).
status peer_moves::complete_read(move& m) {
  const std::string from = "rank " + std::to_string(m.peer);
  if (auto st = waits_.wait(m.offer_work, "offer of " + from + "'s memory"); !st) return st;
  const auto* o = m.offer[0].data_ptr<int64_t>();
  int64_t outcome = static_cast<int64_t>(answer::read);
  if (static_cast<uint64_t>(o[1]) != m.bytes())
    outcome = static_cast<int64_t>(answer::wrong_size);
  else if (const auto [e, digest] = read_peer_digest(local_.pid_of(m.peer), static_cast<uint64_t>(o[0]), m.t.data_ptr(), m.bytes()); e != 0)
    outcome = e;
  else if (digest != static_cast<uint64_t>(o[2]))
    outcome = static_cast<int64_t>(answer::changed);
  m.reply = {torch::tensor({outcome}, torch::kInt64)};
  m.reply_work = issue(pg_.send(m.reply, m.peer, m.tag));
  if (outcome != static_cast<int64_t>(answer::read)) {
    if (outcome == static_cast<int64_t>(answer::wrong_size))
      return make_error(from + " offers " + std::to_string(o[1]) + " bytes, this rank expects " + std::to_string(m.bytes()));
    return make_error("reading " + std::to_string(m.bytes()) + " bytes of " + from + "'s memory failed: " + answer_text(outcome));
  }
  bytes_read_ += m.bytes();
  return {};
}

status peer_moves::complete(move& m) {
  const std::string with = "rank " + std::to_string(m.peer);
  if (!m.memory) {
    if (auto st = waits_.wait(m.data_work, m.send ? "sending to " + with : "receiving from " + with); !st) return st;
    if (auto st = waits_.wait(m.digest_work, m.send ? "sending a digest to " + with : "receiving a digest from " + with); !st) return st;
    if (m.send) return {};
    if (digest_of(m.t.data_ptr(), m.bytes()) != static_cast<uint64_t>(m.digest[0].data_ptr<int64_t>()[0]))
      return make_error(std::to_string(m.bytes()) + " bytes from " + with + " do not match their digest");
    bytes_over_group_ += m.bytes();
    return {};
  }
  if (!m.send) return complete_read(m);
  if (auto st = waits_.wait(m.offer_work, "offer to " + with); !st) return st;
  if (auto st = waits_.wait(m.reply_work, "answer of " + with); !st) return st;
  const int64_t a = m.reply[0].data_ptr<int64_t>()[0];
  if (a != static_cast<int64_t>(answer::read)) return make_error(with + " could not read " + std::to_string(m.bytes()) + " bytes of this rank's memory: " + answer_text(a));
  return {};
}

status peer_moves::complete_until(size_t left) {
  for (; open_.size() > left; open_.pop_front()) {
    auto st = complete(*open_.front());
    if (open_.front()->reply_work && !open_.front()->send) answering_.push_back(std::move(open_.front()));
    if (!st) return st;
  }
  return {};
}

status peer_moves::finish() {
  std::deque<std::unique_ptr<move>> sends;
  for (; !open_.empty(); open_.pop_front()) {
    if (open_.front()->send) {
      sends.push_back(std::move(open_.front()));
      continue;
    }
    auto st = complete(*open_.front());
    if (open_.front()->reply_work) answering_.push_back(std::move(open_.front()));
    if (!st) return st;
  }
  for (; !sends.empty(); sends.pop_front())
    if (auto st = complete(*sends.front()); !st) return st;
  for (auto& m : answering_)
    if (auto st = waits_.wait(m->reply_work, "answer to rank " + std::to_string(m->peer)); !st) return st;
  answering_.clear();
  return {};
}

}  // namespace dtactor
