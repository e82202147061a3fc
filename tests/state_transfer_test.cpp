// A state transfer (rank/state_io's broadcast_state) over a group of two
// streams, several chunks in flight: the receiver ends with the root's
// state, bit for bit, whatever the chunking. Ranks are threads over Gloo.
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <string>
#include <tuple>
#include <thread>
#include <vector>

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
};

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
      out[r].bytes = sent->bytes;
      out[r].step = states[r]->step();
      out[r].digest = states[r]->params_digest();
      if (tag != 7) out[r].error = "the header's tag did not arrive: " + std::to_string(tag);
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

}  // namespace
}  // namespace dtactor
