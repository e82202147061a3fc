#pragma once
// A rank's share of a checkpoint, stored in the background. At a checkpoint
// step the training thread copies its byte ranges of the state (the save
// planner's, storage/checkpoint_plan.hpp: by default one balanced range of
// the stream; a ZeRO shard owns several) back to back into a host buffer
// and goes on training; a thread of its own writes each range to the
// checkpoint store as a part of its own and reports `checkpoint_written` (a
// few hundred bytes) when all are stored, or why not. The buffer is kept
// between checkpoints (unless made with keep_buffer = false: then it is
// freed once a write is stored, and allocated again at the next
// checkpoint); a checkpoint due while the previous one is still being
// written waits for it (counted in the stall it reports).
//
// Direct (checkpoint.direct = true, or auto where the host has no room for
// the buffer: part_buffer_fits): no part-sized buffer at all. The writer
// thread copies the ranges from the state itself, a piece of
// `direct_piece_bytes` at a time, into one piece's buffer and stores it,
// while training goes on with the next step's forward and backward, which
// change no parameter and no optimizer moment. What may change there (a
// module's buffers, such as BatchNorm's running statistics; the step
// counter and generator entries) is cloned at submit(): small. Whatever is
// about to change the parameters or moments (the update, a reshard, a load,
// DiLoCo's outer step) calls fence() first and waits for the write. The
// stall a checkpoint reports is submit()'s time plus that wait: the part of
// the write that the next forward and backward did not cover. 12 bytes a
// parameter / world less memory at every checkpoint.
//
// The middle way (set_aside_bytes > 0): fence() does not wait for the whole
// write. Once what the writer has not read yet fits in set_aside_bytes, the
// training thread copies it into a buffer of its own and goes on; the
// writer reads the rest from there. The stall is then the wait until it
// fits plus that copy; the buffer is freed when the write ends.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "wire.pb.h"

namespace dtactor {

struct state_layout;
class object_store;

// What checkpoint.direct = auto weighs: the memory this host can still
// give, and this rank's own step peak above what it holds now.
struct memory_room {
  int64_t available = -1;     // MemAvailable, or the cgroup's limit less its usage when lower; -1: unknown
  int64_t total = 0;          // MemTotal, or the cgroup's limit when lower
  int64_t step_headroom = 0;  // this process's peak RSS (VmHWM) less its RSS now: what its next step takes again
};
// Read from /proc/meminfo, /proc/self/status and the process's cgroup (v2).
memory_room read_memory_room();
// Whether `ranks` part buffers of `bytes` each (one per rank of this host)
// fit, each rank's step headroom with them, leaving the larger of 512 MiB
// and 5% of the total. Unknown memory: true (the buffered default).
bool part_buffer_fits(uint64_t bytes, int ranks, const memory_room& room);
// The largest buffer, at most `bytes`, that each of `ranks` ranks can take
// by the same rule (0 when none fits; `bytes` when the memory is unknown):
// what a direct write may set aside at its fence.
uint64_t room_for_buffer(uint64_t bytes, int ranks, const memory_room& room);

class part_writer {
 public:
  struct job {
    int64_t step = 0;
    uint64_t generation = 0;
    int rank = 0, world = 1;
    std::string node_id;
    std::string store;  // location (storage/object_store.hpp)
    std::string s3_endpoint;
    std::string meta;   // global rank 0: serialized checkpoint_meta without parts
    // Stream bytes [first, second) this rank writes, ascending and disjoint,
    // each its own part (part_name index k for the k-th). Empty: the
    // balanced share of an unsharded stream, part_range(layout.bytes, rank,
    // world) (the rank worker always passes the save planner's ranges).
    std::vector<std::pair<uint64_t, uint64_t>> ranges;
    int64_t due_step = 0;  // deferred (checkpoint.defer_while_writing): the step it fell due at
  };
  // Called on the writer thread when a part is stored (or failed).
  using done_fn = std::function<void(uint64_t generation, pb::checkpoint_written)>;

  explicit part_writer(done_fn done, bool keep_buffer = true);
  static constexpr uint64_t direct_piece_bytes = 8ull << 20;
  ~part_writer();  // finishes the write in flight
  part_writer(const part_writer&) = delete;
  part_writer& operator=(const part_writer&) = delete;

  // Waits for the previous write, copies this rank's ranges into the buffer
  // and returns the seconds training was held up (the stall); the write goes
  // on in the background. Direct: the write reads `layout`'s tensors
  // (a copy of the layout is kept, so the tensors stay alive) until fence();
  // only the entries that are not stable_until_update (rank/state_io) are
  // cloned here. Ranges that are not ascending, disjoint and inside the
  // stream are copied nowhere and reported as the write's error.
  double submit(const state_layout& layout, job j, bool direct = false);
  // Waits until no write reads the state any more and returns the seconds
  // waited. The training thread calls it before it changes the parameters
  // or optimizer moments (direct: the write reads them); the wait counts in
  // the stall the checkpoint reports. A direct write with set_aside_bytes
  // (see above) goes on after it returns, from its own copy of the rest.
  double fence();
  // Waits until no write is in flight at all.
  void wait_idle();
  // Waits until no direct write reads the state (a buffered write reads its
  // own copy and goes on storing): what a generation's end needs before
  // the next one reshards or loads the state.
  void wait_state_unread();
  // Direct writes from now on: the most fence() copies aside instead of
  // waiting for it to be written (0: it waits for the whole write).
  void set_aside_bytes(uint64_t bytes);
  // Bytes the last direct write had set aside (0: fence waited, or it was
  // not fenced before it ended).
  uint64_t last_set_aside();
  // Tests: called on the writer thread before each piece it reads of a
  // direct write, with the bytes read so far.
  void on_piece_for_test(std::function<void(uint64_t read)> f) { piece_hook_ = std::move(f); }
  // Has the writer thread allocate (and touch) a buffer of `bytes` now, in
  // the background, so that the first checkpoint's stall is a copy, not
  // page faults. Never blocks.
  void prepare(uint64_t bytes);
  // Bytes of host buffer held now.
  uint64_t buffer_bytes();
  // A part is queued or being stored (or the buffer grown): a submit now
  // would wait for it.
  bool writing();

 private:
  void run();
  struct pending {
    job j;  // j.ranges: never empty here
    double stall_s = 0;
    std::string error;  // bad ranges: nothing to store
    std::shared_ptr<const state_layout> direct = nullptr;  // direct: read the ranges from here (until fence)
  };
  // submit() of a direct write (`error`: its ranges' problem, or ""):
  // keeps one piece's buffer and the layout (what may change cloned), and
  // queues the write. Returns the stall since `t0`.
  double submit_direct(const state_layout& layout, job j, std::string error, std::chrono::steady_clock::time_point t0);
  // Waits for the next write, growing the buffer meanwhile when prepare()
  // asked for more; marks the writer busy. nullopt once quit with nothing
  // pending.
  std::optional<pending> next_write();
  // Allocates (and faults in) want_capacity_ bytes with `lock` released,
  // busy meanwhile.
  void grow_buffer(std::unique_lock<std::mutex>& lock);
  // Stores p's ranges as parts (opening the store once per location): the
  // report, with the parts or the error (no parts then).
  pb::checkpoint_written store_parts(const pending& p);
  // A direct write's piece: stream bytes [stream_at, +n), the bytes from
  // `pos` on in the order of its ranges, from the state or, once set
  // aside, from the copy.
  void read_direct(const state_layout& layout, uint64_t stream_at, uint64_t pos, uint64_t n, char* dst);
  // fence(), with mu_ held: whether the direct write in flight reads the
  // state no more (its rest set aside, or now copied aside because it fits).
  bool set_aside_rest();
  // What a direct write in flight has read of its ranges (in order, `read`
  // bytes so far), and the rest once fence() copied it aside.
  struct direct_progress {
    std::shared_ptr<const state_layout> layout;
    std::vector<std::pair<uint64_t, uint64_t>> ranges;
    uint64_t total = 0, read = 0;
    std::unique_ptr<char[]> rest;  // [rest_from, total) of the ranges' bytes
    uint64_t rest_from = 0;
    double fence_s = 0;  // what fence() took when it set the rest aside
  };
  std::optional<direct_progress> progress_;  // under mu_
  uint64_t set_aside_bytes_ = 0, last_set_aside_ = 0;
  std::function<void(uint64_t)> piece_hook_;
  done_fn done_;
  bool keep_buffer_ = true;
  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<pending> pending_;
  bool busy_ = false, quit_ = false;
  bool direct_in_flight_ = false;  // a direct write is queued or being stored
  // Set while the training thread waits in fence() for a direct write: the
  // wait, added to the stall that write reports.
  std::optional<std::chrono::steady_clock::time_point> fenced_since_;
  uint64_t want_capacity_ = 0;  // prepare()
  std::unique_ptr<char[]> buf_;
  uint64_t capacity_ = 0;
  std::map<std::string, std::shared_ptr<object_store>> stores_;  // by location; writer thread only
  std::thread thread_;
};

}  // namespace dtactor
