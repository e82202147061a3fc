// comm/peer_moves: bulk moves between ranks, through a peer's memory where
// the ranks read each other (the threads of one test process always can)
// or over the group.
#include "comm/peer_moves.hpp"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <string>
#include <thread>

#include "rank_threads.hpp"

using namespace dtactor;
using dtactor::testing::run_ranks;

namespace {

p2p_waits waits_for(std::chrono::milliseconds timeout) {
  return {nullptr, [timeout](const c10::intrusive_ptr<c10d::Work>& w, const std::string& what) -> status {
            try {
              if (!w->wait(timeout)) return make_error(what + ": timed out");
            } catch (const std::exception& e) {
              return make_error(what + ": " + e.what());
            }
            return {};
          }};
}

torch::Tensor pattern(int from, int to, int64_t n) { return torch::arange(n, torch::kFloat).add_(1000.0 * from + 10.0 * to); }

void expect_no_errors(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

}  // namespace

TEST(PeerMoves, EveryRankSendsToEveryOtherThroughMemoryOrOverTheGroupAndTheBytesArrive) {
  const int world = 3;
  const int64_t n = 3 << 20;  // 12 MB a move
  for (bool memory : {true, false}) {
    SCOPED_TRACE(memory ? "through memory" : "over the group");
    expect_no_errors(run_ranks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
      auto agreed = local_peers::agree(*pg, std::chrono::steady_clock::now() + std::chrono::seconds(20), {});
      if (!agreed) return agreed.message();
      for (int r = 0; r < world; ++r)
        if ((r != rank) != agreed->reads(rank, r)) return "rank " + std::to_string(r) + ": threads of one process read each other, not themselves";
      const local_peers table = memory ? agreed.value() : local_peers::none(world);
      peer_moves mv(*pg, table, waits_for(std::chrono::seconds(20)));
      std::vector<torch::Tensor> out, in;
      for (int peer = 0; peer < world; ++peer) {
        if (peer == rank) continue;
        out.push_back(pattern(rank, peer, n));
        in.push_back(torch::zeros({n}));
        mv.send(out.back(), peer, 7 + peer);
        mv.recv(in.back(), peer, 7 + rank);
      }
      if (auto st = mv.finish(); !st) return st.message();
      size_t i = 0;
      for (int peer = 0; peer < world; ++peer) {
        if (peer == rank) continue;
        if (!torch::equal(in[i++], pattern(peer, rank, n))) return "wrong bytes from rank " + std::to_string(peer);
      }
      const uint64_t all = static_cast<uint64_t>(world - 1) * n * sizeof(float);
      if (mv.bytes_read() != (memory ? all : 0) || mv.bytes_over_group() != (memory ? 0 : all))
        return "read " + std::to_string(mv.bytes_read()) + " bytes, " + std::to_string(mv.bytes_over_group()) + " over the group";
      return "";
    }));
  }
}

// The sender changes its bytes after its offer, before the receiver reads
// them (a sender that gave up waiting and updated): the digest catches it,
// and both sides fail instead of the receiver taking torn bytes.
TEST(PeerMoves, BytesChangedBeforeTheReadAreRefusedOnBothSides) {
  std::atomic<bool> changed{false};
  std::vector<std::string> said(2);
  expect_no_errors(run_ranks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
    auto table = local_peers::agree(*pg, std::chrono::steady_clock::now() + std::chrono::seconds(20), {});
    if (!table) return table.message();
    peer_moves mv(*pg, table.value(), waits_for(std::chrono::seconds(20)));
    auto t = rank == 0 ? pattern(0, 1, 1 << 16) : torch::zeros({1 << 16});
    if (rank == 0) {
      mv.send(t, 1, 3);
      t[5] = -1.0f;
      changed = true;
    } else {
      mv.recv(t, 0, 3);
      while (!changed) std::this_thread::yield();
    }
    auto st = mv.finish();
    if (st) return "the move was taken";
    said[static_cast<size_t>(rank)] = st.message();
    return "";
  }));
  EXPECT_NE(said[0].find("changed while it read them"), std::string::npos) << said[0];
  EXPECT_NE(said[1].find("changed while it read them"), std::string::npos) << said[1];
}

TEST(PeerMoves, AnotherByteCountIsRefusedOnBothSides) {
  std::vector<std::string> said(2);
  expect_no_errors(run_ranks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
    auto table = local_peers::agree(*pg, std::chrono::steady_clock::now() + std::chrono::seconds(20), {});
    if (!table) return table.message();
    peer_moves mv(*pg, table.value(), waits_for(std::chrono::seconds(20)));
    auto t = torch::zeros({rank == 0 ? 100 : 200});
    if (rank == 0)
      mv.send(t, 1, 3);
    else
      mv.recv(t, 0, 3);
    auto st = mv.finish();
    if (st) return "the move was taken";
    said[static_cast<size_t>(rank)] = st.message();
    return "";
  }));
  EXPECT_NE(said[1].find("offers 400 bytes, this rank expects 800"), std::string::npos) << said[1];
  EXPECT_NE(said[0].find("expects another byte count"), std::string::npos) << said[0];
}

// Over the group the digest follows the bytes: bytes that do not match it
// (here a sender speaking the protocol by hand with a wrong digest) are
// refused, not taken.
TEST(PeerMoves, BytesOverTheGroupNotMatchingTheirDigestAreRefused) {
  std::string said;
  expect_no_errors(run_ranks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
    const int tag = 5;
    if (rank == 0) {
      std::vector<torch::Tensor> data{pattern(0, 1, 1000)}, digest{torch::tensor({int64_t{12345}}, torch::kInt64)};
      pg->send(data, 1, tag)->wait();
      pg->send(digest, 1, tag + (1 << 30))->wait();
      return "";
    }
    peer_moves mv(*pg, local_peers::none(2), waits_for(std::chrono::seconds(20)));
    auto t = torch::zeros({1000});
    mv.recv(t, 0, tag);
    auto st = mv.finish();
    if (st) return "bytes with a wrong digest were taken";
    said = st.message();
    return "";
  }));
  EXPECT_NE(said.find("4000 bytes from rank 0 do not match their digest"), std::string::npos) << said;
}
