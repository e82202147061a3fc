// The part writer alone (rank/part_writer): a rank's byte ranges of the
// checkpoint stream stored in the background, buffered or direct, and what
// it reports.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "rank/part_writer.hpp"
#include "rank/state_io.hpp"
#include "storage/checkpoint_store.hpp"

using namespace dtactor;

namespace {

// A stream of two tensors (12,000 float bytes, then 4,000 int64 bytes), and
// its bytes as one string.
struct two_tensors {
  state_layout l;
  std::string stream;
  torch::Tensor a = torch::arange(0, 3000, torch::kFloat), b = torch::arange(0, 500, torch::kLong);
  two_tensors() {
    l.entries.push_back({"a", a, 0, 12000});
    l.entries.push_back({"b", b, 12000, 4000});
    l.bytes = 16000;
    stream.assign(16000, '\0');
    copy_range(l, 0, 16000, stream.data());
  }
};

// A job for rank `rank` of 2 on node "n", into `store`.
part_writer::job job_of(int64_t step, uint64_t generation, int rank, const std::string& store) {
  part_writer::job j;
  j.step = step;
  j.generation = generation;
  j.rank = rank;
  j.world = 2;
  j.node_id = "n";
  j.store = store;
  return j;
}

std::string file_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

}  // namespace

// The part writer alone: rank 1 of 2 stores exactly its byte range of the
// stream, in the background, and says so; a store it cannot open is the
// part's error (the committer then reports the checkpoint as not saved).
TEST(part_writer, stores_its_byte_range_and_reports_a_store_it_cannot_use) {
  two_tensors t;
  const auto& l = t.l;
  const auto& stream = t.stream;
  EXPECT_EQ(0, std::memcmp(stream.data(), t.a.data_ptr(), 12000));
  EXPECT_EQ(0, std::memcmp(stream.data() + 12000, t.b.data_ptr(), 4000));

  const std::string dir = ::testing::TempDir() + "/part-writer-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  std::mutex mu;
  std::condition_variable cv;
  std::vector<pb::checkpoint_written> got;
  {
    part_writer w([&](uint64_t, pb::checkpoint_written r) {
      std::lock_guard<std::mutex> lock(mu);
      got.push_back(std::move(r));
      cv.notify_all();
    });
    w.prepare(8192);
    auto j = job_of(7, 3, 1, dir);
    w.submit(l, j);
    j.store = "/proc/dtactor-cannot-be-here";
    w.submit(l, j);
    w.wait_idle();
  }
  ASSERT_EQ(got.size(), 2u);
  ASSERT_TRUE(got[0].error().empty()) << got[0].error();
  const auto [from, to] = part_range(16000, 1, 2);
  ASSERT_EQ(got[0].parts_size(), 1);
  EXPECT_EQ(got[0].parts(0).name(), "ckpt-000000007.g3.r1-of-2.part");
  EXPECT_EQ(got[0].parts(0).offset(), from);
  EXPECT_EQ(got[0].parts(0).size(), to - from);
  EXPECT_EQ(got[0].parts(0).node_id(), "n");
  EXPECT_EQ(file_text(dir + "/ckpt-000000007.g3.r1-of-2.part"), stream.substr(from, to - from));
  EXPECT_EQ(got[1].parts_size(), 0);
  EXPECT_NE(got[1].error().find("checkpoint store: directory '/proc/dtactor-cannot-be-here' is not writable"), std::string::npos) << got[1].error();
  std::filesystem::remove_all(dir);
}

// checkpoint.keep_buffer: kept, the part's host buffer stays between
// checkpoints; not kept, it is freed once a part is stored, and the next
// checkpoint allocates it again and stores the same bytes.
TEST(part_writer, a_buffer_not_kept_is_freed_after_each_write_and_made_again) {
  state_layout l;
  auto a = torch::arange(0, 3000, torch::kFloat);
  l.entries.push_back({"a", a, 0, 12000});
  l.bytes = 12000;
  std::string stream(12000, '\0');
  copy_range(l, 0, 12000, stream.data());
  const std::string dir = ::testing::TempDir() + "/part-writer-keep-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  for (bool keep : {true, false}) {
    std::vector<pb::checkpoint_written> got;
    std::mutex mu;
    part_writer w(
        [&](uint64_t, pb::checkpoint_written r) {
          std::lock_guard<std::mutex> lock(mu);
          got.push_back(std::move(r));
        },
        keep);
    for (int64_t step : {4, 8}) {
      part_writer::job j;
      j.step = step;
      j.store = dir;
      w.submit(l, j);
      w.wait_idle();
      EXPECT_EQ(w.buffer_bytes(), keep ? 12000u : 0u) << "keep " << keep << " step " << step;
    }
    ASSERT_EQ(got.size(), 2u);
    for (const auto& r : got) {
      ASSERT_TRUE(r.error().empty()) << r.error();
      ASSERT_EQ(r.parts_size(), 1);
      std::ifstream f(dir + "/" + r.parts(0).name(), std::ios::binary);
      std::string stored((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      EXPECT_EQ(stored, stream);
    }
    std::filesystem::remove_all(dir);
  }
}

// A buffer that cannot be had (far more than any machine holds) is no
// crash. Asked for ahead: the writer says so, asks no more, and is not left
// "writing" (which would defer every checkpoint). Needed by a part: that
// part fails with one line. The next part is stored as usual.
TEST(part_writer, a_buffer_that_cannot_be_made_fails_no_more_than_its_part) {
  two_tensors t;
  const std::string dir = ::testing::TempDir() + "/part-writer-nomem-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  std::vector<pb::checkpoint_written> got;
  std::mutex mu;
  part_writer w([&](uint64_t, pb::checkpoint_written r) {
    std::lock_guard<std::mutex> lock(mu);
    got.push_back(std::move(r));
  });
  w.prepare(uint64_t{1} << 62);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(1);
  while (w.writing() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_FALSE(w.writing()) << "a buffer that cannot be made is not owed forever";
  EXPECT_EQ(w.buffer_bytes(), 0u);
  // A part whose buffer cannot be had at all: that part fails with one
  // line, and the next one is stored.
  state_layout huge = t.l;
  huge.bytes = uint64_t{1} << 62;
  auto big = job_of(1, 1, 0, dir);
  big.ranges = {{0, huge.bytes}};
  w.submit(huge, big);
  w.submit(t.l, job_of(2, 1, 0, dir));
  w.wait_idle();
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].parts_size(), 0);
  EXPECT_NE(got[0].error().find("no memory for a 4611686018427387904-byte part buffer"), std::string::npos) << got[0].error();
  ASSERT_TRUE(got[1].error().empty()) << got[1].error();
  EXPECT_EQ(got[1].parts_size(), 1);
  EXPECT_EQ(file_text(dir + "/" + got[1].parts(0).name()), t.stream.substr(got[1].parts(0).offset(), got[1].parts(0).size()));
  std::filesystem::remove_all(dir);
}

// checkpoint.direct: no part-sized buffer; the writer reads the state
// itself a piece at a time (a 12 MB parameter: two pieces and a half) while
// the training thread goes on until fence(). What a forward may change (a
// module buffer) is cloned at submit, so changing it right after submit
// returns changes nothing stored; the parameter is read live, and once
// fence() returns the write is reported and the parameter may change. The
// parts and their checksums are the buffered writer's.
TEST(part_writer, direct_reads_the_state_until_fence_and_clones_what_a_forward_may_change) {
  state_layout l;
  auto a = torch::arange(0, 3 << 20, torch::kFloat);
  auto b = torch::arange(0, 1000, torch::kLong);
  const uint64_t abytes = uint64_t{3} << 22;
  l.entries.push_back({"model/a", a, 0, abytes});
  l.entries.push_back({"buffer/b", b, abytes, 8000});
  l.bytes = abytes + 8000;
  std::string stream(l.bytes, '\0');
  copy_range(l, 0, l.bytes, stream.data());
  const std::string dir = ::testing::TempDir() + "/part-writer-direct-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  // Two ranges (a ZeRO rank's): most of `a`, and the end of `a` with `b`.
  const std::vector<std::pair<uint64_t, uint64_t>> ranges = {{4096, abytes - 4000}, {abytes - 1000, l.bytes}};
  std::map<bool, pb::checkpoint_written> got;
  for (bool direct : {false, true}) {
    std::mutex mu;
    part_writer w(
        [&](uint64_t, pb::checkpoint_written r) {
          std::lock_guard<std::mutex> lock(mu);
          got[direct] = std::move(r);
        },
        true);
    part_writer::job j;
    j.step = direct ? 2 : 1;
    j.store = dir;
    j.ranges = ranges;
    w.submit(l, j, direct);
    if (direct) {
      torch::NoGradGuard ng;
      b.fill_(-1);  // a buffer, after submit: cloned, so not stored
      w.fence();
      {
        std::lock_guard<std::mutex> lock(mu);
        ASSERT_EQ(got.count(true), 1u) << "fence returned before the write was reported";
      }
      EXPECT_EQ(w.buffer_bytes(), part_writer::direct_piece_bytes);
      EXPECT_LT(w.buffer_bytes(), ranges[0].second - ranges[0].first);
      a.fill_(-1);  // after fence: must not reach the stored parts
      EXPECT_EQ(w.fence(), 0.0) << "nothing in flight";
    }
    w.wait_idle();
    EXPECT_EQ(got.at(direct).direct(), direct);
  }
  for (bool direct : {false, true}) {
    const auto& r = got.at(direct);
    ASSERT_TRUE(r.error().empty()) << r.error();
    ASSERT_EQ(r.parts_size(), 2);
    for (int k = 0; k < 2; ++k) {
      const auto [x, y] = ranges[static_cast<size_t>(k)];
      EXPECT_EQ(r.parts(k).offset(), x);
      EXPECT_EQ(r.parts(k).size(), y - x);
      EXPECT_EQ(r.parts(k).xxh3(), got.at(false).parts(k).xxh3()) << "part " << k;
      std::ifstream f(dir + "/" + r.parts(k).name(), std::ios::binary);
      std::string stored((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      EXPECT_TRUE(stored == stream.substr(x, y - x)) << (direct ? "direct" : "buffered") << " part " << k;
    }
  }
  std::filesystem::remove_all(dir);
}

// checkpoint.direct = auto: a part buffer per rank of the host, each rank's
// step headroom with it, and a margin (512 MiB, or 5% of the memory when
// more) must fit in what the host still has; unknown memory keeps the
// buffer. What this machine reports is read, and is sane.
TEST(part_writer, auto_takes_the_buffer_only_where_every_ranks_buffer_and_step_fit) {
  const int64_t gib = int64_t{1} << 30;
  memory_room r;
  r.total = 24 * gib;
  r.available = 6 * gib;
  r.step_headroom = gib / 2;
  EXPECT_TRUE(part_buffer_fits(uint64_t(gib), 2, r)) << "2 x (1 + 0.5) GiB + 1.2 GiB margin <= 6 GiB";
  EXPECT_FALSE(part_buffer_fits(uint64_t(gib), 4, r)) << "4 x 1.5 GiB leaves no margin";
  EXPECT_FALSE(part_buffer_fits(uint64_t(3 * gib), 1, memory_room{4 * gib, 24 * gib, gib / 2})) << "3.5 GiB leaves 0.5 GiB, under 5% of 24";
  EXPECT_TRUE(part_buffer_fits(uint64_t(3 * gib), 1, memory_room{4 * gib, 4 * gib, 0})) << "the margin is 512 MiB on a 4 GiB host";
  EXPECT_TRUE(part_buffer_fits(uint64_t(100) * gib, 8, memory_room{-1, 0, 0})) << "unknown: the buffered default";
  EXPECT_FALSE(part_buffer_fits(0, 1, memory_room{100 << 20, gib, 0})) << "below the margin already";
  {
    // A peak this process reached and left (mmapped, so returned at once):
    // what its next step would take again.
    std::vector<char> peak(size_t(64) << 20, 1);
    EXPECT_EQ(peak[peak.size() / 2], 1);
  }
  const memory_room here = read_memory_room();
  EXPECT_GT(here.available, 0);
  EXPECT_GT(here.total, 0);
  EXPECT_LE(here.available, here.total);
  EXPECT_GE(here.step_headroom, int64_t(48) << 20) << "VmHWM - VmRSS after a 64 MiB peak";
}

// What checkpoint.direct reads live (it changes only after the before-update
// hook) and what it clones at submit.
TEST(part_writer, only_parameters_moments_and_outer_state_are_read_live) {
  for (const char* live : {"model/fc.weight", "optim/exp_avg.0", "optim/exp_avg_sq.1", "outer/global.0", "outer/momentum.2", "workers/3/model/fc.bias",
                           "workers/12/optim/exp_avg.0"})
    EXPECT_TRUE(stable_until_update(live)) << live;
  for (const char* cloned : {"buffer/bn.running_mean", "optim/steps", "train/rng", "outer/anchor", "outer/fragment_anchors", "workers/2/buffer/bn.running_var",
                             "workers/", "modelx/a", ""})
    EXPECT_FALSE(stable_until_update(cloned)) << cloned;
}

// ZeRO: a rank that owns scattered ranges of the stream stores each as a
// part of its own (the first under the usual name, the k-th with ".<k>"),
// all in one report, in order, each with its own checksum; ranges that are
// not ascending and disjoint are refused, not stored.
TEST(part_writer, stores_several_ranges_as_parts_of_their_own) {
  two_tensors t;
  const auto& l = t.l;
  const auto& stream = t.stream;

  const std::string dir = ::testing::TempDir() + "/part-writer-ranges-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  std::mutex mu;
  std::vector<pb::checkpoint_written> got;
  const std::vector<std::pair<uint64_t, uint64_t>> ranges{{100, 4196}, {11000, 14000}};  // the second spans both tensors
  {
    part_writer w([&](uint64_t, pb::checkpoint_written r) {
      std::lock_guard<std::mutex> lock(mu);
      got.push_back(std::move(r));
    });
    auto j = job_of(1200, 7, 0, dir);
    j.ranges = ranges;
    w.submit(l, j);
    j.step = 1201;
    j.ranges = {{0, 100}, {50, 200}};  // overlapping
    w.submit(l, j);
    w.wait_idle();
  }
  ASSERT_EQ(got.size(), 2u);
  ASSERT_TRUE(got[0].error().empty()) << got[0].error();
  EXPECT_EQ(got[0].step(), 1200);
  ASSERT_EQ(got[0].parts_size(), 2);
  const std::vector<std::string> names{"ckpt-000001200.g7.r0-of-2.part", "ckpt-000001200.g7.r0-of-2.1.part"};
  for (int k = 0; k < 2; ++k) {
    const auto& p = got[0].parts(k);
    const auto [from, to] = ranges[static_cast<size_t>(k)];
    EXPECT_EQ(p.name(), names[static_cast<size_t>(k)]);
    EXPECT_EQ(p.name(), part_name(1200, 7, 0, 2, k));
    EXPECT_EQ(p.offset(), from);
    EXPECT_EQ(p.size(), to - from);
    EXPECT_EQ(p.rank(), 0);
    EXPECT_EQ(p.node_id(), "n");
    EXPECT_EQ(file_text(dir + "/" + p.name()), stream.substr(from, to - from)) << p.name();
  }
  EXPECT_NE(got[0].parts(0).xxh3(), got[0].parts(1).xxh3());
  EXPECT_EQ(got[1].parts_size(), 0);
  EXPECT_EQ(got[1].error(), "checkpoint range [50, 200) is not ascending, disjoint and inside the 16000-byte state");
  EXPECT_FALSE(std::filesystem::exists(dir + "/" + part_name(1201, 7, 0, 2))) << "nothing stored";
  std::filesystem::remove_all(dir);
}
