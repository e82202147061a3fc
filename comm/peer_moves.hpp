#pragma once
// Point-to-point moves of bulk bytes between the ranks of a group: a
// peer's state sent to a joining rank while the step trains, the optimizer's
// moments when a reshard moves them. Over the group itself (Gloo: TCP, on
// one host through loopback, where 2.4 GB took 7.7 s), or, between two
// ranks of one host, by the receiver reading the sender's memory in one
// copy (process_vm_readv, Linux's cross-memory attach, the single-copy path
// Open MPI's and MPICH's shared-memory transports take for large messages).
//
// Who can read whom is agreed once (local_peers::agree, a collective):
// every rank tells where it runs (the kernel's boot id, its pid and network
// namespaces, its pid) and the address and value of a word of its own; each
// rank reads that word from every rank of its host, and a second round
// tells every rank which reads worked. A read needs the kernel's
// permission (the same user; Yama's ptrace_scope at 0, since the ranks of
// a node are siblings; no seccomp filter refusing it): a pair where it
// fails moves over the group, decided before anything moves, so both sides
// always agree on the way.
//
// A move through memory: the sender sends the bytes' address, length and
// digest (24 bytes; XXH3 of the XXH3 digests of their 8 MiB parts, so that
// both sides take it on several threads) over the group; the receiver
// reads them into its tensor on as many threads as the machine has (one
// thread's page faults bound a read into fresh pages), checks the digest (a sender that gave up and changed them is
// caught) and answers one word. The sender's bytes stay as they are until
// that answer (finish / complete_until). A move over the group sends the
// digest after the bytes (under the tag plus 2^30), and the receiver
// checks it the same way: every move is checksummed as it arrives.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtactor/result.hpp"

namespace dtactor {

class local_peers {
 public:
  // Every rank of `pg` calls it. A group of another backend than Gloo
  // (NCCL's tensors are on the device; its own transports already use
  // NVLink and shared memory) gets a table where nobody reads anybody.
  static result<local_peers> agree(c10d::ProcessGroup& pg, std::chrono::steady_clock::time_point deadline, const std::function<bool()>& abandon);
  // A table where nobody reads anybody (every move over the group).
  static local_peers none(int world);
  // `receiver` reads what `sender` sends from its memory.
  bool reads(int receiver, int sender) const;
  int64_t pid_of(int rank) const { return pids_[static_cast<size_t>(rank)]; }
  int world() const { return static_cast<int>(pids_.size()); }

 private:
  std::vector<int64_t> pids_;
  std::vector<std::vector<uint64_t>> readable_;  // [receiver] bits of the senders it reads
};

// How the caller issues and waits for the group's work: `issued` sees every
// piece of work as it starts (to abort it when the caller's generation
// ends; may be empty), `wait` waits for one up to the caller's limit.
struct p2p_waits {
  std::function<c10::intrusive_ptr<c10d::Work>(c10::intrusive_ptr<c10d::Work>)> issued;
  std::function<status(const c10::intrusive_ptr<c10d::Work>&, const std::string& what)> wait;
};

class peer_moves {
 public:
  peer_moves(c10d::ProcessGroup& pg, const local_peers& local, p2p_waits waits);
  ~peer_moves();
  peer_moves(const peer_moves&) = delete;
  peer_moves& operator=(const peer_moves&) = delete;

  // Starts moving `t` (the same byte count on both sides; through memory
  // a contiguous CPU tensor) to or from `peer` under `tag`. A sent tensor's bytes must
  // not change until the move completes; a received one holds them then.
  // Tags of one direction between two ranks must be distinct and below 2^30.
  void send(const torch::Tensor& t, int peer, int tag);
  void recv(const torch::Tensor& t, int peer, int tag);
  // Completes the oldest moves, in order, until at most `left` are open.
  // Only for moves all of one direction: a rank that both sends and
  // receives uses finish.
  status complete_until(size_t left);
  // Completes every move: the receives first (every sender's offer went
  // out when it started), then the sends, so ranks moving to each other
  // never wait for one another.
  status finish();
  // Bytes received by reading a peer's memory, and over the group.
  uint64_t bytes_read() const { return bytes_read_; }
  uint64_t bytes_over_group() const { return bytes_over_group_; }

 struct move;  // one move's tensors and work (peer_moves.cpp)

 private:
  status complete(move& m);
  status complete_read(move& m);
  c10::intrusive_ptr<c10d::Work> issue(c10::intrusive_ptr<c10d::Work> w);

  c10d::ProcessGroup& pg_;
  const local_peers& local_;
  p2p_waits waits_;
  std::deque<std::unique_ptr<move>> open_;
  std::vector<std::unique_ptr<move>> answering_;  // receives through memory whose answer is on its way
  uint64_t bytes_read_ = 0, bytes_over_group_ = 0;
};

}  // namespace dtactor
