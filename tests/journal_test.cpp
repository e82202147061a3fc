// The journal writes through an injected file-system environment: a full
// disk costs whole lines (counted, reported once), never half a line.
#include "monitoring/journal.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <fstream>
#include <sstream>

#include "test_util.hpp"

using namespace dtactor;

namespace {

// Writes half of a line and reports a full disk while `full` is set.
class filling_env : public fs_env {
 public:
  std::atomic<bool> full{false};
  int write_all(int fd, const char* data, size_t size) override {
    if (!full) return fs_env::write_all(fd, data, size);
    fs_env::write_all(fd, data, size / 2);
    return ENOSPC;
  }
};

std::vector<nlohmann::json> lines_of(const std::string& path) {
  std::ifstream in(path);
  std::vector<nlohmann::json> out;
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));  // throws on half a line
  return out;
}

}  // namespace

TEST(journal, a_full_disk_costs_whole_lines_never_half_of_one) {
  dtactor::testing::temp_dir dir;
  filling_env env;
  journal jn;
  const std::string path = dir.path() + "/journal.jsonl";
  ASSERT_TRUE(jn.open(path, env));
  jn.write(ev::checkpoint_found{1, "a"});
  env.full = true;
  jn.write(ev::checkpoint_found{2, "b"});
  jn.write(ev::checkpoint_found{3, "c"});
  env.full = false;
  jn.write(ev::checkpoint_found{4, "d"});
  EXPECT_EQ(jn.failed_writes(), 2u);
  auto lines = lines_of(path);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0].at("step"), 1);
  EXPECT_EQ(lines[1].at("step"), 4);
  EXPECT_EQ(lines[1].at("event").get<std::string>(), ev::checkpoint_found::name);
}

TEST(journal, opening_appends_to_what_is_there) {
  dtactor::testing::temp_dir dir;
  const std::string path = dir.path() + "/journal.jsonl";
  {
    journal a;
    ASSERT_TRUE(a.open(path));
    a.write(ev::coordinator_started{});
  }
  journal b;
  ASSERT_TRUE(b.open(path));
  b.write(ev::coordinator_started{});
  EXPECT_EQ(lines_of(path).size(), 2u);
  EXPECT_EQ(b.failed_writes(), 0u);
}

TEST(journal, an_unwritable_path_is_one_clear_error) {
  journal jn;
  auto st = jn.open("/nonexistent-dir/journal.jsonl");
  ASSERT_FALSE(st);
  EXPECT_NE(st.message().find("cannot open journal '/nonexistent-dir/journal.jsonl'"), std::string::npos) << st.message();
}
