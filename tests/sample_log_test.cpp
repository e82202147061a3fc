// data/sample_log: the audit record of data.sample_log (docs/data.md,
// "Auditing the order: data.sample_log").
#include "data/sample_log.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "test_util.hpp"

namespace dtactor {
namespace {

using testing::temp_dir;

std::string text_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(SampleLog, OneLinePerStepInAFileOfItsOwn) {
  temp_dir d;
  const std::string dir = d.path() + "/a/b";  // made when missing
  auto first = sample_log::open(dir, "node/1 r0");
  ASSERT_TRUE(first) << first.message();
  auto second = sample_log::open(dir, "node/1 r0");  // the same pid: another file
  ASSERT_TRUE(second) << second.message();
  const std::string pid = std::to_string(::getpid());
  EXPECT_EQ(first.value()->path(), dir + "/samples-node_1_r0-" + pid + ".tsv");
  EXPECT_EQ(second.value()->path(), dir + "/samples-node_1_r0-" + pid + ".1.tsv");
  ASSERT_TRUE(first.value()->append(7, 3, 1, 2, {5, 0, 42}));
  ASSERT_TRUE(first.value()->append(8, 3, 1, 2, {}));
  EXPECT_EQ(text_of(first.value()->path()), "7\t3\t1\t2\t5,0,42\n8\t3\t1\t2\t\n");
  EXPECT_EQ(text_of(second.value()->path()), "");
  // DiLoCo: an outer step that landed at step 10 (its lines before are in it).
  ASSERT_TRUE(second.value()->append_synced(10, 4, 0, 3));
  EXPECT_EQ(text_of(second.value()->path()), "10\t4\t0\t3\tsynced\n");
  EXPECT_EQ(newest_logged_generation(dir).value(), 4u);
}

TEST(SampleLog, NewestGenerationIsTheLastWholeLinesOfEachFile) {
  temp_dir d;
  const std::string dir = d.path();
  EXPECT_EQ(newest_logged_generation(dir + "/missing").value(), 0u);
  EXPECT_EQ(newest_logged_generation("").value(), 0u);
  EXPECT_EQ(newest_logged_generation(dir).value(), 0u);
  // A line longer than the first window read from the end (64 KiB).
  std::vector<int64_t> many(20000);
  for (size_t i = 0; i < many.size(); ++i) many[i] = static_cast<int64_t>(i);
  {
    std::ofstream a(dir + "/samples-a-1.tsv", std::ios::binary);
    a << sample_log::format_line(0, 2, 0, 1, {1}) << sample_log::format_line(1, 4, 0, 1, many);
    std::ofstream b(dir + "/samples-b-2.tsv", std::ios::binary);
    // Torn: the process died in its write of generation 9's line.
    b << sample_log::format_line(0, 3, 1, 2, {2}) << "1\t9\t1\t2\t3,4";
    std::ofstream other(dir + "/notes.tsv", std::ios::binary);
    other << sample_log::format_line(0, 99, 0, 1, {1});
  }
  EXPECT_EQ(newest_logged_generation(dir).value(), 4u);
  {
    std::ofstream c(dir + "/samples-c-3.tsv", std::ios::binary);
    c << sample_log::format_line(5, 6, 0, 1, {9});
  }
  EXPECT_EQ(newest_logged_generation(dir).value(), 6u);
}

TEST(SampleLog, ADirectoryThatCannotBeWrittenIsOneLine) {
  temp_dir d;
  EXPECT_TRUE(check_sample_log_dir(""));  // off
  std::ofstream(d.path() + "/file") << "x";
  auto st = check_sample_log_dir(d.path() + "/file/samples");
  ASSERT_FALSE(st);
  EXPECT_EQ(st.message().rfind("data.sample_log: directory '" + d.path() + "/file/samples' is not writable: ", 0), 0u) << st.message();
  EXPECT_NE(st.message().find("leave it empty"), std::string::npos) << st.message();
  EXPECT_FALSE(sample_log::open(d.path() + "/file/samples", "x"));
}

}  // namespace
}  // namespace dtactor
