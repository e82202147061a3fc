#pragma once
// Shared-memory exchange of gradient buckets between the ranks of one
// generation when they all run on the same host (`dtactor local`, or several
// CPU ranks per node). Gloo moves a bucket through loopback TCP: ~1.2 ms of
// CPU per rank for 535 KB, mostly in the kernel, taken from the compute
// threads on a small machine; here a rank writes its gradients once into its
// own slot of a segment the others map, and each rank sums the slots itself.
//
// Layout: a header (per rank: published and consumed counters and pid,
// one cache line each), then one slot per rank, each `capacity` floats,
// used as a ring. Everything written to the segment goes into a region
// reserved in that ring (reserve): every rank reserves the same regions in
// the same order (same buckets, same rounds), so a region is at the same
// offset in every slot. A rank fills its own slot's region and publishes
// its count; readers read every slot's region and then say they consumed
// it. A region is written again only after every rank consumed what was
// there (wait_free): so a rank runs at most a ring ahead of the slowest
// reader, and the segment holds what is in flight, not the whole model
// (until 2026-11-27: two parities of whole-model slots, 8 bytes a
// parameter a rank). A ring that holds two steps never waits.
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
#include <deque>
#include <functional>
#include <memory>
#include <string>

#include "dtactor/result.hpp"

namespace dtactor {

// True when process `pid` is gone: no such process, or a zombie (exited,
// not reaped). False when it runs or cannot be checked.
bool process_exited(int pid);

// Floats of a rank's ring slot for gradients of `step_floats` (trained
// parameters and control words) whose largest bucket is at most
// `largest_floats`: two steps when they fit `ring_floats` or ring_floats
// is 0 (nothing ever waits, as with the whole-model slots of before), else
// `ring_floats` but at least room for two of the largest buckets; with
// `whole_step` (the hierarchical exchange) a step more.
int64_t shm_slot_floats(int64_t step_floats, int64_t largest_floats, int64_t ring_floats, bool whole_step);

class shm_group {
 public:
  // Joins through `store` (a per-generation prefix): rank 0 creates a
  // segment for `capacity` floats per slot (a ring: see shm_slot_floats), the others map it, and every
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
  // Floats of a slot (the ring), the size asked for rounded up to 64 bytes.
  int64_t capacity() const { return slot_stride_; }

  // A reserved region: `floats` floats at `offset` in every rank's slot,
  // the count its publication makes (the ranks' counters count regions
  // reserved, in order), and the count every rank must have consumed
  // before it may be written (what was there before).
  struct region {
    int64_t offset = 0, floats = 0;
    uint64_t count = 0, free_after = 0;
  };
  // Reserves the next region of `floats` (rounded up to 64 bytes; an error
  // when more than the slot holds). Never waits: every rank reserves alike.
  result<region> reserve(int64_t floats);
  // Rank r's copy of region g.
  float* at(int r, const region& g) const;
  // Every rank consumed what region g held before (never waits).
  bool is_free(const region& g) const;
  // Waits, as wait_all waits, until is_free(g); calls `progress` between
  // polls (a rank consumes what it can while it waits, so that ranks
  // waiting on each other move on).
  status wait_free(const region& g, std::chrono::steady_clock::time_point deadline, const std::function<bool()>& abandon,
                   std::chrono::microseconds spin, const std::string& what, const std::function<status()>& progress = {}) const;

  // Makes this rank's writes of region g visible to peers that read
  // published(rank) >= g.count (release). Regions are published in order.
  void publish(const region& g);
  uint64_t published(int r) const;
  // True when every rank has published at least `count` (never waits).
  bool all_published(uint64_t count) const;
  // This rank read every slot's copy of the regions up to `count`.
  void consume(uint64_t count);
  uint64_t consumed(int r) const;

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
  // The ring: where the next region goes, the regions reserved and not yet
  // written again (oldest first), and the last count reserved.
  int64_t ring_pos_ = 0;
  std::deque<region> live_;
  uint64_t reserved_ = 0;
  uint64_t popped_ = 0;  // the newest region covered by a later one
  size_t header_bytes_ = 0, total_bytes_ = 0;
  void* base_ = nullptr;
  bool check_pids_ = false;
};

}  // namespace dtactor
