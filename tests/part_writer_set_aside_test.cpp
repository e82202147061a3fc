// A direct checkpoint write's middle way: at the fence, the rest of the
// write is copied aside once it fits in set_aside_bytes, the training
// thread goes on, and the writer reads the rest from the copy. The writer is
// held at a chosen piece (on_piece_for_test), so what is set aside is known.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>
#include <mutex>
#include <string>
#include <thread>

#include "rank/part_writer.hpp"
#include "rank/state_io.hpp"

using namespace dtactor;
using namespace std::chrono_literals;

namespace {

// A gate the writer thread waits at when it is about to read the piece at
// `hold_at` (or later), until the test opens it.
struct piece_gate {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t hold_at = 0;
  bool open = false, held = false;
  void wait(uint64_t read) {
    std::unique_lock<std::mutex> lock(mu);
    if (read < hold_at) return;
    held = true;
    cv.notify_all();
    cv.wait(lock, [&] { return open; });
  }
  void release() {
    std::lock_guard<std::mutex> lock(mu);
    open = true;
    cv.notify_all();
  }
  bool wait_held() {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, 30s, [&] { return held; });
  }
};

struct direct_run {
  std::string stored;  // the part's bytes as stored
  uint64_t set_aside = 0;
  pb::checkpoint_written report;
  bool fence_returned_while_held = false;
};

// Writes the whole stream of `l` directly with `set_aside` bytes allowed,
// the writer held before the piece at `hold_at`; fences, then scribbles on
// `live` (the update), then lets the writer go on.
direct_run write_with_fence(state_layout& l, torch::Tensor live, uint64_t set_aside, uint64_t hold_at, const std::string& dir) {
  direct_run out;
  piece_gate gate;
  gate.hold_at = hold_at;
  std::mutex mu;
  part_writer w(
      [&](uint64_t, pb::checkpoint_written r) {
        std::lock_guard<std::mutex> lock(mu);
        out.report = std::move(r);
      },
      true);
  w.set_aside_bytes(set_aside);
  w.on_piece_for_test([&gate](uint64_t read) { gate.wait(read); });
  part_writer::job j;
  j.step = 4;
  j.store = dir;
  j.ranges = {{0, l.bytes}};
  w.submit(l, j, true);
  EXPECT_TRUE(gate.wait_held()) << "the writer never reached the held piece";
  auto fenced = std::async(std::launch::async, [&w] { return w.fence(); });
  out.fence_returned_while_held = fenced.wait_for(30s) == std::future_status::ready;
  if (out.fence_returned_while_held) {
    torch::NoGradGuard ng;
    live.fill_(-1);  // the update: must not reach the stored part
  }
  gate.release();
  fenced.wait();
  w.wait_idle();
  out.set_aside = w.last_set_aside();
  std::ifstream f(dir + "/" + out.report.parts(0).name(), std::ios::binary);
  out.stored.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  return out;
}

struct two_entries {
  torch::Tensor a = torch::arange(0, 6 << 20, torch::kFloat);  // 24 MiB: three pieces
  torch::Tensor b = torch::arange(0, 1000, torch::kLong);
  state_layout l;
  std::string stream;
  two_entries() {
    const uint64_t abytes = uint64_t{6} << 22;
    l.entries.push_back({"model/a", a, 0, abytes});
    l.entries.push_back({"optim/exp_avg.0", b, abytes, 8000});
    l.bytes = abytes + 8000;
    stream.assign(l.bytes, '\0');
    copy_range(l, 0, l.bytes, stream.data());
  }
};

std::string fresh_dir(const char* name) {
  const std::string dir = ::testing::TempDir() + "/" + name + "-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  return dir;
}

}  // namespace

// Everything fits: the fence copies the whole unread write aside before the
// writer read a byte, returns while the writer is still held, and what the
// update writes afterwards never reaches the part.
TEST(part_writer_set_aside, a_rest_that_fits_is_copied_aside_and_the_fence_returns_at_once) {
  two_entries s;
  const auto dir = fresh_dir("set-aside-all");
  const auto r = write_with_fence(s.l, s.a, s.l.bytes, 0, dir);
  ASSERT_TRUE(r.fence_returned_while_held) << "the fence waited for the write";
  ASSERT_TRUE(r.report.error().empty()) << r.report.error();
  EXPECT_EQ(r.set_aside, s.l.bytes);
  EXPECT_TRUE(r.stored == s.stream) << "the part is not the state as it was at the checkpoint";
  EXPECT_TRUE(r.report.direct());
  EXPECT_GE(r.report.stall_s(), 0.0);
  std::filesystem::remove_all(dir);
}

// 10 MiB allowed of a 24 MiB write: the fence waits until the writer has
// read two 8 MiB pieces (the rest, 8 MiB and the moments, fits), sets only
// that aside and returns while the writer is held before the third.
TEST(part_writer_set_aside, the_fence_waits_until_the_rest_fits_and_sets_only_the_rest_aside) {
  two_entries s;
  const auto dir = fresh_dir("set-aside-rest");
  const uint64_t piece = part_writer::direct_piece_bytes;
  const auto r = write_with_fence(s.l, s.a, uint64_t{10} << 20, 2 * piece, dir);
  ASSERT_TRUE(r.fence_returned_while_held) << "the fence waited for the whole write";
  ASSERT_TRUE(r.report.error().empty()) << r.report.error();
  EXPECT_EQ(r.set_aside, s.l.bytes - 2 * piece);
  EXPECT_TRUE(r.stored == s.stream) << "the part is not the state as it was at the checkpoint";
  std::filesystem::remove_all(dir);
}

// Nothing allowed (0, as without a middle buffer): the fence returns only
// once the writer has read its last piece of the state.
TEST(part_writer_set_aside, with_nothing_allowed_the_fence_waits_for_the_whole_write) {
  two_entries s;
  const auto dir = fresh_dir("set-aside-none");
  part_writer w(nullptr, true);
  w.set_aside_bytes(0);
  std::atomic<bool> fence_returned{false};
  std::atomic<int> read_after{0};
  w.on_piece_for_test([&](uint64_t) {
    if (fence_returned) ++read_after;
    std::this_thread::sleep_for(1ms);  // a slow store: the fence comes before the last piece
  });
  part_writer::job j;
  j.store = dir;
  j.ranges = {{0, s.l.bytes}};
  w.submit(s.l, j, true);
  w.fence();
  fence_returned = true;
  w.wait_idle();
  EXPECT_EQ(read_after, 0) << "the writer read the state after the fence returned";
  EXPECT_EQ(w.last_set_aside(), 0u);
  std::filesystem::remove_all(dir);
}

// The room rule of checkpoint.direct = auto, sized: what each rank's buffer
// may take beside its step and the margin, never more than asked.
TEST(part_writer_set_aside, room_for_a_buffer_follows_the_rule_auto_uses) {
  const int64_t gib = int64_t{1} << 30;
  const memory_room r{6 * gib, 24 * gib, gib / 2};  // margin: 5% of 24 GiB = 1.2 GiB
  const uint64_t two = room_for_buffer(uint64_t(8 * gib), 2, r);
  EXPECT_TRUE(part_buffer_fits(two, 2, r));
  EXPECT_FALSE(part_buffer_fits(two + (uint64_t(64) << 20), 2, r));
  EXPECT_EQ(room_for_buffer(uint64_t(gib), 2, r), uint64_t(gib)) << "never more than the write";
  EXPECT_EQ(room_for_buffer(uint64_t(gib), 10, r), 0u) << "10 ranks' steps alone take the room";
  EXPECT_EQ(room_for_buffer(uint64_t(gib), 2, memory_room{-1, 0, 0}), uint64_t(gib)) << "unknown memory";
}
