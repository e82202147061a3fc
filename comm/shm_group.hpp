#pragma once
// Shared-memory exchange of gradient buckets between the ranks of one
// generation when they all run on the same host (`dtactor local`, or several
// CPU ranks per node). Gloo moves a bucket through loopback TCP: ~1.2 ms of
// CPU per rank for 535 KB, mostly in the kernel, taken from the compute
// threads on a small machine; here a rank writes its gradients once into its
// own slot of a segment the others map, and each rank sums the slots itself.
//
// Layout: a header (per rank: published counter and pid, one cache line
// each), then two sets ("parities") of one slot per rank, each slot
// `capacity` floats. Step k of a grad_sync writes parity k % 2: a rank can
// only be one step ahead of the slowest (it needs everyone's step k-1 to
// finish step k-1), so a slot is never overwritten while a peer reads it.
//
// Readers sum the slots in a fixed order (sum_slots: a pairwise tree over
// rank order), so every rank computes bit-identical results. A peer that
// dies is noticed by its pid (kill(pid, 0)), within a millisecond of
// polling, like Gloo notices a closed socket.
//
// Hierarchical exchange (ranks on several hosts, grad_sync): the group holds
// one host's ranks; rank 0 of it (the host's leader) sums the slots, takes
// the sum across hosts, writes the result back into its own slot and
// announces it with publish_result(); the others wait_result() and copy it.
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "dtactor/result.hpp"

namespace dtactor {

// True when process `pid` is gone: no such process, or a zombie (exited,
// not reaped). False when it runs or cannot be checked.
bool process_exited(int pid);

class shm_group {
 public:
  // Joins through `store` (a per-generation prefix): rank 0 creates a
  // segment for `capacity` floats per slot, the others map it, and every
  // rank learns whether all of them could. Returns null, with the reason in
  // *why_not, when one could not (another host, another IPC or network namespace,
  // /dev/shm too small): every rank gets the same answer. An error only when
  // the store fails (a member never came). The segment's name is unlinked
  // before join returns, so nothing is left in /dev/shm whatever happens.
  static result<std::shared_ptr<shm_group>> join(c10d::Store& store, int rank, int world, int64_t capacity, std::string* why_not);

  ~shm_group();
  shm_group(const shm_group&) = delete;
  shm_group& operator=(const shm_group&) = delete;

  int rank() const { return rank_; }
  int world() const { return world_; }
  int64_t capacity() const { return capacity_; }

  // Slot of rank r in parity p (0 or 1): capacity() floats, 64-byte aligned.
  float* slot(int parity, int r) const;

  // Makes this rank's slot writes so far visible to peers that read
  // published(rank) >= count (release).
  void publish(uint64_t count);
  uint64_t published(int r) const;
  // True when every rank has published at least `count` (never waits).
  bool all_published(uint64_t count) const;

  // Hierarchical exchange, on rank 0 (the host's leader): its slot now holds
  // results up to `count` (release); fail() tells the others that no more
  // results will come this generation (its exchange across hosts failed).
  void publish_result(uint64_t count);
  void fail();

  // On the other ranks: waits until rank 0 published results up to `count`,
  // as wait_all waits (spin, deadline, abandon, rank 0's exit), and also
  // fails when rank 0 called fail().
  status wait_result(uint64_t count, std::chrono::steady_clock::time_point deadline, const std::function<bool()>& abandon,
                     std::chrono::microseconds spin, const std::string& what) const;

  // Waits until every rank has published at least `count`: polls (yielding)
  // for `spin`, then sleeps 50 us between polls. Fails at `deadline`, when
  // `abandon()` says so (checked about every millisecond), or when a peer's
  // process exited. Errors are one line naming `what`.
  status wait_all(uint64_t count, std::chrono::steady_clock::time_point deadline, const std::function<bool()>& abandon,
                  std::chrono::microseconds spin, const std::string& what) const;

  // Where this rank stands in the segment's steps, shared by every exchange
  // over it (a DiLoCo job's per-step host reducer and its outer exchange
  // take turns on one segment): the parity step k writes (k % 2), the
  // buckets this rank published in all steps, and those before the current
  // step. Exchanges over one segment must not have steps in flight at once.
  struct cursor {
    int parity = 0;
    uint64_t published = 0, step_base = 0;
  };
  cursor& steps() { return cursor_; }

 private:
  struct rank_line;
  shm_group() = default;
  rank_line* line(int r) const;
  // "" while peer r's process is alive (or cannot be checked).
  std::string gone(int r) const;
  // Polls `ready` (spin, then 50 us sleeps); about every millisecond asks
  // `problem` ("" = none), abandon() and the deadline.
  status wait_until(const std::function<bool()>& ready, const std::function<std::string()>& problem, std::chrono::steady_clock::time_point deadline,
                    const std::function<bool()>& abandon, std::chrono::microseconds spin, const std::string& what) const;

  int rank_ = 0, world_ = 1;
  int64_t capacity_ = 0, slot_stride_ = 0;  // floats
  size_t header_bytes_ = 0, total_bytes_ = 0;
  void* base_ = nullptr;
  bool check_pids_ = false;
  cursor cursor_;
};

}  // namespace dtactor
