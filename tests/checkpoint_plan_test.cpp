// The checkpoint's save and load planners (storage/checkpoint_plan.hpp),
// torch-free: a stream laid out as a model's (parameters, two groups of
// AdamW moments, scalars), saved at one world size and ZeRO level and
// planned for loading at others.
#include "storage/checkpoint_plan.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "model/shard_plan.hpp"
#include "storage/checkpoint_store.hpp"
#include "storage/manifest_plan.hpp"

namespace dtactor {
namespace {

// Index space of the moments: group 0 holds elements [0, 7300), group 1 [7300, 7800).
constexpr int64_t total_elements = 7800;

pb::checkpoint_meta model_meta(int diloco_workers = 0) {
  pb::checkpoint_meta m;
  m.set_step(40);
  uint64_t at = 0;
  auto add = [&](const std::string& name, const std::string& dtype, int64_t n, int esize) {
    auto* t = m.add_tensors();
    t->set_name(name);
    t->set_dtype(dtype);
    t->add_shape(n);
    t->set_offset(at);
    t->set_size(static_cast<uint64_t>(n * esize));
    at += t->size();
  };
  add("model/a.weight", "float32", 300, 4);
  add("model/b.weight", "float32", 7000, 4);
  add("model/c.weight", "float32", 500, 4);
  add("optim/exp_avg.0", "float32", 7300, 4);
  add("optim/exp_avg_sq.0", "float32", 7300, 4);
  add("optim/exp_avg.1", "float32", 500, 4);
  add("optim/exp_avg_sq.1", "float32", 500, 4);
  add("optim/steps", "int64", 1, 8);
  add("train/rng", "uint8", 5000, 1);
  for (int w = 1; w < diloco_workers; ++w) {
    add("workers/" + std::to_string(w) + "/model/a.weight", "float32", 300, 4);
    add("workers/" + std::to_string(w) + "/optim/exp_avg.0", "float32", 7300, 4);
  }
  m.set_state_bytes(at);
  return m;
}

// What a rank at ZeRO `zero` knows and the manifest does not: the moments
// are sharded (ZeRO 1 and 2 shard the same tensors of the stream; 2's
// summed gradients are not in it).
std::map<std::string, int64_t> sharded_at(int zero) {
  if (zero == 0) return {};
  return {{"optim/exp_avg.0", 0}, {"optim/exp_avg_sq.0", 0}, {"optim/exp_avg.1", 7300}, {"optim/exp_avg_sq.1", 7300}};
}

// Rank r of `world`, each rank on a node of its own, `replicas` holders a shard.
rank_share share_of(int rank, int world, int zero, int replicas = 1) {
  rank_share s;
  s.rank = rank;
  s.world = world;
  if (zero == 0) return s;
  std::vector<std::string> nodes;
  for (int r = 0; r < world; ++r) nodes.push_back("n" + std::to_string(r));
  const auto plan = make_shard_plan(total_elements, nodes, replicas);
  const auto& mine = plan.shards[static_cast<size_t>(rank)];
  s.primary = {{mine.begin, mine.end}};
  s.held = plan.ranges_of(rank);
  return s;
}

uint64_t bytes_of(const std::vector<byte_range>& v) {
  uint64_t n = 0;
  for (const auto& [a, b] : v) n += b - a;
  return n;
}

// Expects the ranges, together, to cover [0, n) exactly once.
void expect_tiles(std::vector<byte_range> all, uint64_t n, const std::string& what) {
  std::sort(all.begin(), all.end());
  uint64_t at = 0;
  for (const auto& [a, b] : all) {
    if (a == b) continue;
    ASSERT_EQ(a, at) << what << ": a gap or an overlap at byte " << at;
    at = b;
  }
  EXPECT_EQ(at, n) << what;
}

// Every rank's local save plan at (world, zero), each range a part, merged
// by the global planner into the manifest.
result<pb::checkpoint_meta> save(const pb::checkpoint_meta& meta, int world, int zero, int replicas = 1, bool per_worker = false) {
  std::map<int32_t, std::vector<pb::checkpoint_part>> parts;
  const auto tensors = stream_of(meta, sharded_at(zero));
  for (int r = 0; r < world; ++r) {
    auto share = share_of(r, world, zero, replicas);
    share.per_worker = per_worker;
    int k = 0;
    for (const auto& [a, b] : local_save_plan(tensors, share)) {
      pb::checkpoint_part p;
      p.set_name(part_name(meta.step(), 1, r, world, k++));
      p.set_offset(a);
      p.set_size(b - a);
      p.set_rank(r);
      parts[r].push_back(p);
    }
  }
  return plan_manifest(meta.SerializeAsString(), 1, world, parts);
}

TEST(checkpoint_plan, every_worlds_save_plans_tile_the_stream_once_and_each_rank_writes_only_what_it_holds) {
  const auto meta = model_meta();
  for (int zero : {0, 1, 2})
    for (int replicas : {1, 2})
      for (int world = 1; world <= 7; ++world) {
        const std::string what = "zero " + std::to_string(zero) + ", world " + std::to_string(world) + ", replicas " + std::to_string(replicas);
        auto manifest = save(meta, world, zero, replicas);
        ASSERT_TRUE(manifest.ok()) << what << ": " << manifest.message();
        const auto tensors = stream_of(meta, sharded_at(zero));
        for (int r = 0; r < world; ++r) {
          const auto share = share_of(r, world, zero, replicas);
          const auto owned = rank_ranges(tensors, share, stream_scope::owned);
          const auto held = rank_ranges(tensors, share, stream_scope::whole);
          for (const auto& [a, b] : owned) {
            const bool inside = std::any_of(held.begin(), held.end(), [&](const byte_range& h) { return h.first <= a && b <= h.second; });
            EXPECT_TRUE(inside) << what << ": rank " << r << " writes [" << a << ", " << b << ") it does not hold";
          }
          // Unsharded: one balanced range, part_range's.
          if (zero == 0 && !owned.empty()) {
            EXPECT_EQ(owned, (std::vector<byte_range>{part_range(meta.state_bytes(), r, world)})) << what;
          }
        }
      }
}

// Saved at 4 ranks (at each ZeRO level), loaded at 1, 2, 3 and 5 (at each):
// unsharded, every rank reads the whole stream; sharded, global rank 0
// reads the replicated tensors and every rank its own shards, which over the
// ranks is every byte of the stream exactly once. Each read is a part the
// bytes are in, read whole, and no part holding none of them is read.
TEST(checkpoint_plan, a_checkpoint_of_four_ranks_loads_at_any_world_and_level_every_byte_once) {
  const auto meta = model_meta();
  for (int saved_zero : {0, 1, 2}) {
    auto manifest = save(meta, 4, saved_zero);
    ASSERT_TRUE(manifest.ok()) << manifest.message();
    for (int zero : {0, 1, 2})
      for (int world : {1, 2, 3, 5}) {
        const std::string what =
            "saved at zero " + std::to_string(saved_zero) + ", loaded at zero " + std::to_string(zero) + ", world " + std::to_string(world);
        const auto tensors = stream_of(*manifest, sharded_at(zero));
        std::vector<byte_range> landed;
        for (int r = 0; r < world; ++r) {
          const auto share = share_of(r, world, zero);
          std::vector<byte_range> needed =
              zero == 0 ? rank_ranges(tensors, share, stream_scope::whole) : rank_ranges(tensors, share, stream_scope::shards);
          if (zero > 0 && r == 0) {
            const auto rep = rank_ranges(tensors, share, stream_scope::replicated);
            needed.insert(needed.end(), rep.begin(), rep.end());
          }
          auto plan = plan_load(*manifest, needed);
          ASSERT_TRUE(plan.ok()) << what << ": " << plan.message();
          EXPECT_EQ(plan->kept_bytes, bytes_of(needed)) << what;
          uint64_t read = 0;
          for (const auto& rd : plan->reads) {
            const auto& p = manifest->parts(rd.part);
            ASSERT_FALSE(rd.keep.empty()) << what;
            read += p.size();
            for (const auto& [a, b] : rd.keep) {
              EXPECT_TRUE(p.offset() <= a && b <= p.offset() + p.size()) << what << ": [" << a << ", " << b << ") is not in " << p.name();
              if (zero > 0) landed.emplace_back(a, b);
            }
          }
          EXPECT_EQ(read, plan->read_bytes) << what;
          if (zero == 0) {
            EXPECT_EQ(plan->kept_bytes, manifest->state_bytes()) << what << ": unsharded, every rank loads all of it";
          }
          if (zero > 0 && r > 0 && world > 1) {
            EXPECT_LT(plan->read_bytes, manifest->state_bytes()) << what << ": rank " << r << " reads less";
          }
        }
        if (zero > 0) expect_tiles(landed, manifest->state_bytes(), what);
      }
  }
}

// With replicas every rank loads what it holds, primary or replica: its
// shards' bytes are twice the primaries'.
TEST(checkpoint_plan, a_rank_loads_its_replicas_too) {
  auto manifest = save(model_meta(), 3, 1);
  ASSERT_TRUE(manifest.ok()) << manifest.message();
  const auto tensors = stream_of(*manifest, sharded_at(1));
  uint64_t primaries = 0, held = 0;
  for (int r = 0; r < 4; ++r) {
    const auto share = share_of(r, 4, 1, 2);
    held += bytes_of(rank_ranges(tensors, share, stream_scope::shards));
    rank_share primary_only = share;
    primary_only.held = share.primary;
    primaries += bytes_of(rank_ranges(tensors, primary_only, stream_scope::shards));
  }
  EXPECT_EQ(primaries, 2 * (7800u * 4));
  EXPECT_EQ(held, 2 * primaries);
}

// DiLoCo: worker 0 writes the stream proper, worker r its own section; a
// worker without one (no sections written) stores an empty part at the end.
TEST(checkpoint_plan, diloco_workers_write_their_own_states_and_load_their_own_sections) {
  const auto meta = model_meta(3);
  auto manifest = save(meta, 3, 0, 1, true);
  ASSERT_TRUE(manifest.ok()) << manifest.message();
  const auto tensors = stream_of(*manifest);
  const uint64_t proper = model_meta().state_bytes();
  EXPECT_EQ(rank_ranges(tensors, share_of(0, 3, 0), stream_scope::whole), (std::vector<byte_range>{{0, proper}}));
  EXPECT_TRUE(rank_ranges(tensors, share_of(0, 3, 0), stream_scope::own_section).empty());
  const auto s2 = rank_ranges(tensors, share_of(2, 3, 0), stream_scope::own_section);
  ASSERT_EQ(s2.size(), 1u);
  EXPECT_EQ(s2[0].second, manifest->state_bytes());
  EXPECT_EQ(s2[0].second - s2[0].first, 300u * 4 + 7300u * 4);
  // Worker 3 of a world of 4 in a checkpoint of 3 workers: no section.
  EXPECT_TRUE(rank_ranges(tensors, share_of(3, 4, 0), stream_scope::own_section).empty());
  auto plan = plan_load(*manifest, s2);
  ASSERT_TRUE(plan.ok()) << plan.message();
  ASSERT_EQ(plan->reads.size(), 1u);
  EXPECT_EQ(manifest->parts(plan->reads[0].part).rank(), 2);
  // Without sections: the others own nothing and store an empty part at the end.
  rank_share w1 = share_of(1, 3, 0);
  w1.per_worker = true;
  EXPECT_EQ(local_save_plan(stream_of(model_meta()), w1), (std::vector<byte_range>{{proper, proper}}));
  EXPECT_TRUE(save(model_meta(), 3, 0, 1, true).ok());
}

TEST(checkpoint_plan, a_load_plan_names_bytes_no_part_holds) {
  auto manifest = save(model_meta(), 2, 0);
  ASSERT_TRUE(manifest.ok()) << manifest.message();
  const uint64_t n = manifest->state_bytes();
  auto outside = plan_load(*manifest, {{n - 4, n + 4}});
  ASSERT_FALSE(outside.ok());
  EXPECT_EQ(outside.message(),
            "bytes [" + std::to_string(n - 4) + ", " + std::to_string(n + 4) + ") are outside the checkpoint's " + std::to_string(n) + "-byte state");
  auto gap = *manifest;
  gap.mutable_parts()->RemoveLast();
  auto missing = plan_load(gap, {{0, n}});
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.message().find("do not tile the stream"), std::string::npos) << missing.message();
  auto nothing = plan_load(*manifest, {});
  ASSERT_TRUE(nothing.ok());
  EXPECT_TRUE(nothing->reads.empty());
}

// Through a store: saved by 4 ranks at ZeRO 1, loaded by 3. Each rank reads
// only the parts its plan names (a damaged part it does not need is never
// read) and gets exactly its bytes.
TEST(checkpoint_plan, ranks_read_their_planned_bytes_from_a_store_and_only_their_parts) {
  std::string dir = ::testing::TempDir() + "/dtactor-plan-XXXXXX";
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  auto store = checkpoint_store::open(dir, {});
  ASSERT_TRUE(store.ok()) << store.message();
  auto meta = model_meta();
  std::string stream(meta.state_bytes(), '\0');
  for (size_t i = 0; i < stream.size(); ++i) stream[i] = static_cast<char>((i * 131 + 7) & 0xff);
  std::map<int32_t, std::vector<pb::checkpoint_part>> parts;
  const auto saved_tensors = stream_of(meta, sharded_at(1));
  for (int r = 0; r < 4; ++r) {
    int k = 0;
    for (const auto& [a, b] : local_save_plan(saved_tensors, share_of(r, 4, 1))) {
      auto p = write_part(store->objects(), part_name(meta.step(), 1, r, 4, k++), a, stream.data() + a, b - a);
      ASSERT_TRUE(p.ok()) << p.message();
      p->set_rank(r);
      parts[r].push_back(p.value());
    }
  }
  auto manifest = plan_manifest(meta.SerializeAsString(), 1, 4, parts);
  ASSERT_TRUE(manifest.ok()) << manifest.message();
  const auto tensors = stream_of(*manifest, sharded_at(1));
  std::string got(stream.size(), '\0');
  std::vector<byte_range> all;
  for (int r = 0; r < 3; ++r) {
    auto needed = rank_ranges(tensors, share_of(r, 3, 1), stream_scope::shards);
    if (r == 0) needed = rank_ranges(tensors, share_of(r, 3, 1), stream_scope::whole);
    auto plan = plan_load(*manifest, needed);
    ASSERT_TRUE(plan.ok()) << plan.message();
    uint64_t landed = 0;
    auto st = store->read_planned(*manifest, *plan, [&](uint64_t at, const char* data, size_t n) {
      std::memcpy(got.data() + at, data, n);
      landed += n;
      all.emplace_back(at, at + n);
      return status{};
    });
    ASSERT_TRUE(st.ok()) << st.message();
    EXPECT_EQ(landed, bytes_of(needed)) << "rank " << r;
  }
  expect_tiles(all, stream.size(), "read at world 3");
  EXPECT_EQ(got, stream);
  // Damage the part holding the last byte of group 1's second moments
  // (rank 3's primary shard): the rank whose shards include it fails with a
  // corrupt checkpoint; the others, whose plans do not read it, read on.
  uint64_t shard_end = 0;
  for (const auto& t : tensors)
    if (t.name == "optim/exp_avg_sq.1") shard_end = t.offset + t.size;
  int damaged = -1;
  for (int i = 0; i < manifest->parts_size(); ++i)
    if (manifest->parts(i).offset() < shard_end && shard_end <= manifest->parts(i).offset() + manifest->parts(i).size()) damaged = i;
  ASSERT_GE(damaged, 0);
  const auto& part = manifest->parts(damaged);
  ASSERT_EQ(part.rank(), 3);
  ASSERT_TRUE(store->objects().put(part.name(), std::string(part.size(), 'x')).ok());
  int failed = 0;
  for (int r = 0; r < 3; ++r) {
    auto plan = plan_load(*manifest, rank_ranges(tensors, share_of(r, 3, 1), stream_scope::shards));
    ASSERT_TRUE(plan.ok());
    const bool reads_it = std::any_of(plan->reads.begin(), plan->reads.end(), [&](const load_plan::read& rd) { return rd.part == damaged; });
    auto st = store->read_planned(*manifest, *plan, [](uint64_t, const char*, size_t) { return status{}; });
    EXPECT_EQ(st.ok(), !reads_it) << "rank " << r;
    if (!st.ok()) {
      EXPECT_EQ(st.code(), errc::corrupt_checkpoint) << st.message();
    }
    failed += st.ok() ? 0 : 1;
  }
  EXPECT_EQ(failed, 1) << "only the holder of the last shard reads that part";
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

}  // namespace
}  // namespace dtactor
