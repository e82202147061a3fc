// The public shard reader (include/dtactor/shards.hpp, docs/cpp_api.md
// "Sharded data") over local shards: what a task of one's own lists, reads
// and counts, and the one-line errors of bad keys and specs. S3 from the
// API's side: the custom_task_s3 test (tests/custom_task_test.sh).
#include "dtactor/shards.hpp"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "data/data_shards.hpp"
#include "job/job_config.hpp"
#include "test_util.hpp"

namespace dtactor {
namespace {

using testing::temp_dir;

void write(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes; }

bool one_line(const std::string& s) { return !s.empty() && s.find('\n') == std::string::npos; }

// data/part-0..2.csv with 3, 1 and 2 lines (the last without a newline),
// and a file of a kind without records.
struct csv_dir {
  temp_dir tmp;
  std::string d = tmp.path();
  csv_dir() {
    write(path("part-0.csv"), "x,y\n1,2\n3,4\n");
    write(path("part-1.csv"), "5,6\n");
    write(path("part-2.csv"), "7,8\n9,10");
    write(path("blob-0.bin"), std::string(64, '\x01'));
  }
  std::string path(const std::string& name) const { return d + "/" + name; }
};

config with(const std::string& key, const std::string& value) {
  config cfg;
  EXPECT_TRUE(cfg.set(key, value)) << key << " = " << value;
  return cfg;
}

TEST(shard_set, lists_a_glob_sorted_with_sizes_and_counts_local_records_by_reading_them) {
  csv_dir c;
  auto s = shard_set::open(with("data.train_tokens", c.d + "/part-*.csv"), "data.train_tokens");
  ASSERT_TRUE(s) << s.message();
  shard_set& set = *s.value();
  EXPECT_TRUE(set.sharded());
  EXPECT_EQ(set.key(), "data.train_tokens");
  EXPECT_EQ(set.spec(), c.d + "/part-*.csv");
  ASSERT_EQ(set.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(set.shards()[i].url, c.path("part-" + std::to_string(i) + ".csv"));
  EXPECT_EQ(set.shards()[0].bytes, 12u);
  EXPECT_EQ(set.shards()[2].bytes, 8u);
  // No index: unknown until counted, then kept.
  EXPECT_EQ(set.shards()[1].records, -1);
  auto all = set.all_records();
  ASSERT_TRUE(all) << all.message();
  EXPECT_EQ(all.value(), (std::vector<int64_t>{3, 1, 2}));
  EXPECT_EQ(set.shards()[1].records, 1);
  auto b = set.get(2);
  ASSERT_TRUE(b) << b.message();
  EXPECT_EQ(b->text(), "7,8\n9,10");
  // Local shards need no read-ahead; indices outside the set are passed over.
  set.read_ahead({2, 0, 7, -1});
}

TEST(shard_set, records_come_from_the_index_and_a_shard_changed_since_is_refused_in_one_line) {
  csv_dir c;
  auto n = write_shard_index(c.d + "/part-*.csv");
  ASSERT_TRUE(n) << n.message();
  write(c.path("part-1.csv"), "5,6\n7,8\n");  // 8 bytes, indexed at 4
  auto changed = shard_set::open(with("data.eval_tokens", c.d + "/part-*.csv"), "data.eval_tokens");
  ASSERT_FALSE(changed);
  EXPECT_TRUE(one_line(changed.message())) << changed.message();
  EXPECT_EQ(changed.message().rfind("data.eval_tokens: ", 0), 0u) << changed.message();
  EXPECT_NE(changed.message().find("part-1.csv: 8 bytes, the index says 4"), std::string::npos) << changed.message();
  write(c.path("part-1.csv"), "5,6\n");
  // The index's counts, known before any shard is read.
  auto s = shard_set::open(with("data.eval_tokens", c.d + "/part-*.csv"), "data.eval_tokens", shard_use::eval);
  ASSERT_TRUE(s) << s.message();
  std::vector<int64_t> listed;
  for (const auto& e : s.value()->shards()) listed.push_back(e.records);
  EXPECT_EQ(listed, (std::vector<int64_t>{3, 1, 2}));
  auto r = s.value()->records(0);
  ASSERT_TRUE(r);
  EXPECT_EQ(r.value(), 3);
}

TEST(shard_set, one_plain_file_is_a_set_of_one_that_is_not_sharded_and_its_bytes_outlive_the_set) {
  csv_dir c;
  shard_data held;
  {
    auto s = shard_set::open(with("data.train_tokens", c.path("part-0.csv")), "data.train_tokens");
    ASSERT_TRUE(s) << s.message();
    EXPECT_FALSE(s.value()->sharded());
    ASSERT_EQ(s.value()->size(), 1u);
    auto b = s.value()->get(0);
    ASSERT_TRUE(b) << b.message();
    held = b.value();
  }
  ASSERT_TRUE(held);
  EXPECT_EQ(held.text(), "x,y\n1,2\n3,4\n");
  // A list and a range are shards too, whatever they match.
  auto list = shard_set::open(with("data.train_tokens", c.path("part-0.csv") + ", " + c.path("part-2.csv")), "data.train_tokens");
  ASSERT_TRUE(list) << list.message();
  EXPECT_TRUE(list.value()->sharded());
  EXPECT_EQ(list.value()->size(), 2u);
  auto range = shard_set::open(with("data.train_tokens", c.d + "/part-{0..1}.csv"), "data.train_tokens");
  ASSERT_TRUE(range) << range.message();
  EXPECT_EQ(range.value()->size(), 2u);
  // One file beside an index of other shards (eval.csv beside train-*.csv):
  // not refused for missing from it; its records are counted.
  ASSERT_TRUE(write_shard_index(c.d + "/part-{1..2}.csv"));
  auto beside = shard_set::open(with("data.eval_tokens", c.path("part-0.csv")), "data.eval_tokens", shard_use::eval);
  ASSERT_TRUE(beside) << beside.message();
  EXPECT_EQ(beside.value()->shards()[0].records, -1);
  auto lines = beside.value()->records(0);
  ASSERT_TRUE(lines) << lines.message();
  EXPECT_EQ(lines.value(), 3);
}

TEST(shard_set, bad_keys_specs_and_indices_are_one_line_naming_the_key) {
  csv_dir c;
  auto refused = [](const result<std::unique_ptr<shard_set>>& r, const std::string& why) {
    ASSERT_FALSE(r) << why;
    EXPECT_TRUE(one_line(r.message())) << r.message();
    EXPECT_NE(r.message().find(why), std::string::npos) << r.message();
  };
  config cfg;
  refused(shard_set::open(cfg, "data.no_such_key"), "'data.no_such_key' is not a config key");
  refused(shard_set::open(cfg, "train.max_steps"), "'train.max_steps' is not a string key");
  refused(shard_set::open(cfg, "data.train_tokens"), "data.train_tokens is empty");
  refused(shard_set::open(with("data.train_tokens", c.d + "/test-*.csv"), "data.train_tokens"), "data.train_tokens: data '" + c.d +
                                                                                                      "/test-*.csv': nothing matches");
  refused(shard_set::open(with("data.train_tokens", c.d + "/part-{0..3}.csv"), "data.train_tokens"), "part-3.csv' of its range does not exist");
  refused(shard_set::open(with("data.train_tokens", c.path("gone.csv")), "data.train_tokens"), "gone.csv");

  auto s = shard_set::open(with("data.train_tokens", c.d + "/blob-*.bin"), "data.train_tokens");
  ASSERT_TRUE(s) << s.message();
  auto kind = s.value()->records(0);
  ASSERT_FALSE(kind);
  EXPECT_TRUE(one_line(kind.message()));
  EXPECT_NE(kind.message().find("data.train_tokens: shard " + c.path("blob-0.bin") + " is of a kind without a record count"), std::string::npos)
      << kind.message();
  auto outside = s.value()->get(1);
  ASSERT_FALSE(outside);
  EXPECT_NE(outside.message().find("shard 1 asked for, the set has 1"), std::string::npos) << outside.message();
  EXPECT_FALSE(s.value()->records(5));
  // A shard deleted after the listing (before this set mapped it): get and
  // records say which.
  auto csv = shard_set::open(with("data.train_tokens", c.d + "/part-*.csv"), "data.train_tokens");
  ASSERT_TRUE(csv) << csv.message();
  std::filesystem::remove(c.path("part-2.csv"));
  auto gone = csv.value()->get(2);
  ASSERT_FALSE(gone);
  EXPECT_TRUE(one_line(gone.message())) << gone.message();
  EXPECT_EQ(gone.message().rfind("data.train_tokens: ", 0), 0u) << gone.message();
  EXPECT_NE(gone.message().find(c.path("part-2.csv")), std::string::npos) << gone.message();
  auto counted = csv.value()->all_records();
  ASSERT_FALSE(counted);
  EXPECT_NE(counted.message().find(c.path("part-2.csv")), std::string::npos) << counted.message();
}

// The check shard_set::open(.., shard_use::train) and the built-in sources
// make: the cache holds (1 + read_ahead_blocks) x shuffle_block_shards of
// the largest S3 shards; local shards need no room.
TEST(shard_set, training_needs_a_cache_for_the_blocks_read_and_read_ahead) {
  config cfg;
  ASSERT_TRUE(cfg.set("data.cache_bytes", "1000"));
  ASSERT_TRUE(cfg.set("data.shuffle_block_shards", "2"));
  ASSERT_TRUE(cfg.set("data.read_ahead_blocks", "1"));
  EXPECT_TRUE(check_training_cache(cfg, std::vector<uint64_t>(10, 0)));
  EXPECT_TRUE(check_training_cache(cfg, {250, 250, 250, 250, 0}));
  auto st = check_training_cache(cfg, {100, 300, 250, 200, 260, 0});
  ASSERT_FALSE(st);
  EXPECT_TRUE(one_line(st.message()));
  EXPECT_NE(st.message().find("data.cache_bytes (1000) cannot hold 4 of the largest shards (1010 bytes)"), std::string::npos) << st.message();
  ASSERT_TRUE(cfg.set("data.read_ahead_blocks", "0"));
  EXPECT_TRUE(check_training_cache(cfg, {100, 300, 250, 200, 260, 0}));
}

}  // namespace
}  // namespace dtactor
