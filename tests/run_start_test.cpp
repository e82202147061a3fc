// The code the coordinator and `dtactor train` share: committing a
// checkpoint (job/checkpoint_commit), finding the resume point and
// numbering generations (job/resume_point). Torch-free.
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <variant>
#include <vector>

#include "data/sample_log.hpp"
#include "job/checkpoint_commit.hpp"
#include "job/resume_point.hpp"
#include "storage/checkpoint_plan.hpp"
#include "test_util.hpp"

namespace dtactor {
namespace {

using testing::temp_dir;

checkpoint_store open_store(const std::string& dir) {
  auto store = checkpoint_store::open(dir, checkpoint_policy{});
  if (!store) {
    ADD_FAILURE() << store.message();
    std::abort();
  }
  return std::move(store).value();
}

// What the ranks of a generation report for `step`: each of `world` ranks
// stored its share of a `bytes`-byte state; rank 0's meta.
written_parts write_step(checkpoint_store& store, int64_t step, uint64_t generation, int world, uint64_t bytes = 10000) {
  const std::string stream = testing::random_bytes(bytes, static_cast<int>(step));
  pb::checkpoint_meta meta;
  meta.set_format_version(checkpoint_format_version);
  meta.set_model("vit");
  meta.set_step(step);
  meta.set_state_bytes(bytes);
  auto* t = meta.add_tensors();
  t->set_name("blob");
  t->set_dtype("uint8");
  t->add_shape(static_cast<int64_t>(bytes));
  t->set_size(bytes);
  written_parts w;
  w.generation = generation;
  w.world = world;
  w.meta = meta.SerializeAsString();
  for (int r = 0; r < world; ++r) {
    const auto [a, b] = part_range(bytes, r, world);
    auto part = write_part(store.objects(), part_name(step, generation, r, world), a, stream.data() + a, b - a);
    EXPECT_TRUE(part) << part.message();
    if (part) w.parts[r].push_back(part.value());
  }
  return w;
}

void commit_step(checkpoint_store& store, int64_t step, uint64_t generation) {
  auto done = commit_checkpoint(step, write_step(store, step, generation, 2), commit_to(store));
  ASSERT_TRUE(done) << done.message();
}

TEST(run_start, a_commit_plans_the_manifest_writes_it_and_says_what_it_saved) {
  temp_dir d;
  auto store = open_store(d.path());
  written_parts w = write_step(store, 6, 3, 2);
  w.stall_s = 0.25;
  w.write_s = 2.0;
  w.direct = 1;
  auto done = commit_checkpoint(6, w, commit_to(store));
  ASSERT_TRUE(done) << done.message();
  const ev::checkpoint_saved& e = done->saved;
  EXPECT_EQ(e.step, 6);
  EXPECT_EQ(e.path, store.location() + "/" + manifest_name(6));
  EXPECT_EQ(e.bytes, 10000);
  EXPECT_EQ(e.generation, std::optional<uint64_t>(3));
  EXPECT_EQ(e.parts, 2);
  EXPECT_EQ(e.stall_s, 0.25);
  EXPECT_EQ(e.write_s, 2.0);
  EXPECT_EQ(e.bytes_per_s, 5000.0);
  EXPECT_EQ(e.direct_ranks, 1);
  EXPECT_FALSE(e.due_step) << "taken when due";
  EXPECT_GE(e.duration_s, 0.0);
  EXPECT_EQ(done->kept, std::vector<int64_t>{6});
  // Deferred (checkpoint.defer_while_writing): it says the step it fell due at.
  written_parts later = write_step(store, 9, 3, 2);
  later.due_step = 8;
  auto deferred = commit_checkpoint(9, later, commit_to(store));
  ASSERT_TRUE(deferred) << deferred.message();
  EXPECT_EQ(deferred->saved.due_step, std::optional<int64_t>(8));
  auto meta = store.read_manifest(manifest_name(6));
  ASSERT_TRUE(meta) << meta.message();
  EXPECT_EQ(meta->generation(), 3u);
  EXPECT_EQ(meta->world_size(), 2);
}

TEST(run_start, a_torn_cover_or_a_stale_generation_is_not_committed_and_says_why) {
  temp_dir d;
  auto store = open_store(d.path());
  int commits = 0;
  const commit_fn counted = [&](pb::checkpoint_meta meta) {
    ++commits;
    return commit_to(store)(std::move(meta));
  };
  written_parts torn = write_step(store, 4, 2, 2);
  torn.parts.erase(1);
  auto refused = commit_checkpoint(4, torn, counted);
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.message(), "no rank stored bytes [" + std::to_string(part_range(10000, 1, 2).first) + ", 10000) of the state");
  EXPECT_EQ(commits, 0) << "a manifest that does not plan is never written";

  ASSERT_TRUE(commit_checkpoint(4, write_step(store, 4, 2, 2), counted));
  auto stale = commit_checkpoint(5, write_step(store, 5, 1, 2), counted);
  ASSERT_FALSE(stale) << "an older generation is fenced out";
  EXPECT_EQ(commits, 2);
  EXPECT_EQ(store.list().size(), 1u);
}

TEST(run_start, the_newest_valid_checkpoint_is_found_and_each_bad_one_is_logged_and_journaled) {
  temp_dir d;
  auto store = open_store(d.path());
  commit_step(store, 2, 1);
  commit_step(store, 4, 1);
  std::ofstream(d.path() + "/" + part_name(4, 1, 1, 2), std::ios::binary | std::ios::trunc) << "short";
  std::vector<std::string> lines;
  std::vector<ev::journal_event> journaled;
  resume_reports reports;
  reports.log = [&](const std::string& line) { lines.push_back(line); };
  reports.journal = [&](const ev::journal_event& e) { journaled.push_back(e); };

  auto found = find_resume_point(resume_request{}, store, reports);
  ASSERT_TRUE(found) << found.message();
  ASSERT_TRUE(found.value());
  EXPECT_EQ(found.value()->meta.step(), 2);
  EXPECT_EQ(found.value()->path, store.location() + "/" + manifest_name(2));
  EXPECT_EQ(found.value()->from->location(), store.location());
  const std::string skipped_path = store.location() + "/" + manifest_name(4);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0].rfind("skipping checkpoint " + skipped_path + ": ", 0), 0u) << lines[0];
  ASSERT_EQ(journaled.size(), 1u);
  const auto* skipped = std::get_if<ev::checkpoint_skipped>(&journaled[0]);
  ASSERT_NE(skipped, nullptr);
  EXPECT_EQ(skipped->path, skipped_path);
  EXPECT_EQ("skipping checkpoint " + skipped->path + ": " + skipped->reason, lines[0]);

  lines.clear();
  auto none = find_resume_point(resume_request{false, ""}, store, reports);
  ASSERT_TRUE(none) << none.message();
  EXPECT_FALSE(none.value()) << "--no-resume starts over";
  EXPECT_TRUE(lines.empty()) << "starting over reads no checkpoint";
}

TEST(run_start, a_checkpoint_named_wins_and_one_that_cannot_be_opened_is_one_line) {
  temp_dir d, other;
  auto store = open_store(d.path());
  auto named = open_store(other.path());
  commit_step(store, 8, 1);
  commit_step(named, 3, 1);
  const std::string manifest = other.path() + "/" + manifest_name(3);
  auto found = find_resume_point(resume_request{true, manifest}, store, {});
  ASSERT_TRUE(found) << found.message();
  ASSERT_TRUE(found.value());
  EXPECT_EQ(found.value()->meta.step(), 3);
  EXPECT_NE(found.value()->from->location(), store.location());

  auto missing = find_resume_point(resume_request{true, other.path() + "/nothing-here"}, store, {});
  ASSERT_FALSE(missing);
  EXPECT_EQ(missing.message().rfind("cannot resume from '" + other.path() + "/nothing-here': ", 0), 0u) << missing.message();
}

TEST(run_start, generations_are_numbered_above_the_stores_and_the_sample_logs) {
  temp_dir d, log;
  auto store = open_store(d.path());
  auto none = generations_before(store, "");
  ASSERT_TRUE(none) << none.message();
  EXPECT_EQ(none.value(), 0u);
  commit_step(store, 2, 5);
  EXPECT_EQ(generations_before(store, "").value(), 5u);
  EXPECT_EQ(generations_before(store, log.path()).value(), 5u);
  std::ofstream(log.path() + "/samples-a-1.tsv", std::ios::binary) << sample_log::format_line(3, 9, 0, 1, {1, 2});
  EXPECT_EQ(generations_before(store, log.path()).value(), 9u);
}

}  // namespace
}  // namespace dtactor
