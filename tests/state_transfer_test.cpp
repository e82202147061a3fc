// A state transfer (rank/state_io's broadcast_state) over a group of two
// streams, several chunks in flight: the receiver ends with the root's
// state, bit for bit, whatever the chunking. Ranks are threads over Gloo.
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <atomic>
#include <string>
#include <tuple>
#include <thread>
#include <vector>

#include "comm/shm_group.hpp"
#include "rank/state_io.hpp"
#include "rank_threads.hpp"
#include "test_util.hpp"

namespace dtactor {
namespace {

using testing::make_states;
using testing::tiny_vit_config;
using testing::train_alone;

struct received {
  std::string error, digest;
  int64_t step = -1;
  uint64_t bytes = 0;
  uint64_t regions = 0;  // over shared memory: the ring's regions reserved by then
};

// A rank's side of a transfer that returned: its bytes, step and digest,
// and an error when root's tag (7) did not arrive with the header.
received what_arrived(const transfer_stats& sent, training_state& state, int64_t tag) {
  received r;
  r.bytes = sent.bytes;
  r.step = state.step();
  r.digest = state.params_digest();
  if (tag != 7) r.error = "the header's tag did not arrive: " + std::to_string(tag);
  return r;
}

// Rank 0 trained three steps, rank 1 none; rank 0 sends its state to rank 1
// over a group of `streams` streams with `in_flight` chunks of `chunk` bytes
// on their way at once.
std::vector<received> transfer(int streams, int in_flight, uint64_t chunk) {
  auto states = make_states(tiny_vit_config(), 2);
  for (int i = 0; i < 3; ++i) train_alone(*states[0]);
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::HashStore>();
  std::vector<received> out(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      communicator_options o;
      o.timeout = std::chrono::milliseconds(20000);
      o.streams = streams;
      o.name = "state";
      auto pg = make_process_group(store, r, 2, o);
      if (!pg) {
        out[r].error = pg.message();
        return;
      }
      int64_t tag = r == 0 ? 7 : 0;
      auto sent = broadcast_state(*pg.value(), 0, *states[r], o.timeout, {}, tag, in_flight, chunk);
      if (!sent) {
        out[r].error = sent.message();
        return;
      }
      out[r] = what_arrived(*sent, *states[r], tag);
    });
  for (auto& t : threads) t.join();
  return out;
}

TEST(StateTransfer, TwoStreamsWithChunksInFlightDeliverTheRootsStateBitForBit) {
  const auto one = transfer(1, 1, 64ull << 20);
  for (const auto& r : one) ASSERT_TRUE(r.error.empty()) << r.error;
  for (const auto& [streams, in_flight, chunk] : std::vector<std::tuple<int, int, uint64_t>>{{2, 2, 4096}, {2, 2, 64ull << 20}, {2, 5, 1000}}) {
    const auto got = transfer(streams, in_flight, chunk);
    for (const auto& r : got) ASSERT_TRUE(r.error.empty()) << r.error;
    EXPECT_EQ(got[1].step, 3) << "chunk " << chunk;
    EXPECT_EQ(got[1].digest, got[0].digest) << "chunk " << chunk << ", " << in_flight << " in flight";
    EXPECT_EQ(got[1].bytes, one[1].bytes);
    EXPECT_GT(got[1].bytes, 0u);
  }
}

// The ranks all on one host: the chunks go through the generation's
// shared-memory ring (a slot far smaller than the state, so the ring wraps
// many times), from a root that is not rank 0, to every other rank, bit for
// bit; the ring is left usable by the gradient exchange that follows (every
// rank reserved the same regions). A receiver whose root never sends gives
// up when abandoned, with its state reset.
TEST(StateTransfer, OverSharedMemoryEveryRankGetsTheRootsStateBitForBit) {
  const int world = 3, root = 1;
  auto states = make_states(tiny_vit_config(), world);
  for (int i = 0; i < 3; ++i) train_alone(*states[root]);
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::HashStore>();
  std::vector<received> out(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      communicator_options o;
      o.timeout = std::chrono::milliseconds(20000);
      o.name = "state";
      auto pg = make_process_group(store, r, world, o);
      std::string why;
      auto shm = shm_group::join(*c10::make_intrusive<c10d::PrefixStore>("shm", store), r, world, 1024, &why);
      if (!pg || !shm || !shm.value()) {
        out[r].error = !pg ? pg.message() : !shm ? shm.message() : why;
        return;
      }
      int64_t tag = r == root ? 7 : 0;
      auto sent = broadcast_state(*pg.value(), root, *states[r], o.timeout, {}, tag, 1, 64ull << 20, shm.value().get());
      if (!sent) {
        out[r].error = sent.message();
        return;
      }
      out[r] = what_arrived(*sent, *states[r], tag);
      // The ring after the transfer: a region every rank reserves alike.
      auto next = shm.value()->reserve(16);
      if (!next) {
        out[r].error = next.message();
        return;
      }
      out[r].regions = next.value().count;
      shm.value()->publish(next.value());
      if (auto st = shm.value()->wait_all(next.value().count, std::chrono::steady_clock::now() + o.timeout, {}, std::chrono::microseconds(100), "after");
          !st)
        out[r].error = "the ring after the transfer: " + st.message();
    });
  for (auto& t : threads) t.join();
  for (const auto& r : out) ASSERT_TRUE(r.error.empty()) << r.error;
  const auto tcp = transfer(1, 1, 64ull << 20);
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(out[r].step, 3) << "rank " << r;
    EXPECT_EQ(out[r].digest, out[root].digest) << "rank " << r;
  }
  EXPECT_EQ(out[0].bytes, tcp[1].bytes) << "the same bytes as over the group";
  EXPECT_GT(out[0].bytes, 4096u * 8) << "more than the ring holds";
  // Every chunk (at most half the 4 KB slot) went through the ring, on every rank alike.
  for (int r = 0; r < world; ++r) EXPECT_GT(out[r].regions, out[0].bytes / 2048) << "rank " << r;
  EXPECT_EQ(out[0].regions, out[2].regions);

  // A root that never sends: the receiver waits until abandoned, then its
  // state is the initial one again.
  auto lone = make_states(tiny_vit_config(), 2);
  for (int i = 0; i < 2; ++i) train_alone(*lone[1]);
  c10::intrusive_ptr<c10d::Store> store2 = c10::make_intrusive<c10d::HashStore>();
  std::string waited;
  int64_t step_after = -1;
  std::vector<std::thread> pair;
  std::atomic<bool> give_up{false};
  for (int r = 0; r < 2; ++r)
    pair.emplace_back([&, r] {
      communicator_options o;
      o.timeout = std::chrono::milliseconds(20000);
      o.name = "state";
      auto pg = make_process_group(store2, r, 2, o);
      std::string why;
      auto shm = shm_group::join(*c10::make_intrusive<c10d::PrefixStore>("shm", store2), r, 2, 1024, &why);
      if (!pg || !shm || !shm.value()) return;
      if (r == 0) {
        // Root sends the header only, as if it died after it.
        std::vector<torch::Tensor> head{torch::tensor({int64_t{5}, static_cast<int64_t>(layout_of(*lone[0]).replicated_bytes()), int64_t{0}}, torch::kInt64)};
        c10d::BroadcastOptions bo;
        bo.rootRank = 0;
        pg.value()->broadcast(head, bo)->wait();
        while (!give_up) std::this_thread::sleep_for(std::chrono::milliseconds(5));
        return;
      }
      int64_t tag = 0;
      auto t0 = std::chrono::steady_clock::now();
      auto sent = broadcast_state(*pg.value(), 0, *lone[1], o.timeout, [&] { return std::chrono::steady_clock::now() - t0 > std::chrono::milliseconds(300); },
                                  tag, 1, 64ull << 20, shm.value().get());
      waited = sent ? "" : sent.message();
      step_after = lone[1]->step();
      give_up = true;
    });
  for (auto& t : pair) t.join();
  EXPECT_FALSE(waited.empty()) << "the receiver returned without the root's chunks";
  EXPECT_EQ(step_after, 0) << "the receiver's state is reset after a failed transfer";
}

}  // namespace
}  // namespace dtactor
