// Sharded data sets on local disks (data/data_shards.hpp, docs/data.md):
// specs, the shard index, and the reader over local shards. The S3 side
// (the cache, read-ahead, several readers on one cache) is in
// tests/data_shards_s3_test.cpp, against a real S3 server.
#include "data/data_shards.hpp"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "base/hash.hpp"
#include "test_util.hpp"

namespace dtactor {

result<std::string> file_digest(const std::string& path);  // job/job_config.cpp

namespace {

using testing::temp_dir;

std::string bytes_of(size_t n, int seed) { return testing::random_bytes(n, seed); }

void write(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << bytes;
}

std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

std::vector<std::string> urls(const std::vector<shard_info>& s) {
  std::vector<std::string> out;
  for (const auto& x : s) out.push_back(x.url);
  return out;
}

bool one_line(const std::string& s) { return !s.empty() && s.find('\n') == std::string::npos; }

// A directory of shards: train-000..004.bin (1000 + 100 i bytes), val-0.bin,
// a hidden file and a file of another kind.
struct shard_dir {
  temp_dir tmp;
  std::string d = tmp.path();
  shard_dir() {
    for (int i = 0; i < 5; ++i) write(path("train-00" + std::to_string(i) + ".bin"), bytes_of(1000 + 100 * i, i));
    write(path("val-0.bin"), bytes_of(300, 42));
    write(path(".train-009.bin"), "hidden");
    write(path("notes.txt"), "not a shard");
  }
  std::string path(const std::string& name) const { return d + "/" + name; }
};

TEST(data_shards, names_shards_tells_a_spec_of_shards_from_one_file) {
  EXPECT_FALSE(names_shards("data/train.npy"));
  EXPECT_FALSE(names_shards("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"));
  EXPECT_TRUE(names_shards("data/train-*.bin"));
  EXPECT_TRUE(names_shards("data/train-0?.bin"));
  EXPECT_TRUE(names_shards("data/train-[01].bin"));
  EXPECT_TRUE(names_shards("data/train-{000..127}.bin"));
  EXPECT_TRUE(names_shards("a.bin,b.bin"));
  EXPECT_TRUE(names_shards("s3://bucket/corpus/train.bin"));
}

TEST(data_shards, a_glob_names_the_matching_files_sorted_with_sizes_and_nothing_else) {
  shard_dir s;
  auto r = resolve_shards(s.d + "/train-*.bin");
  ASSERT_TRUE(r) << r.message();
  ASSERT_EQ(r->size(), 5u);
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ((*r)[i].url, s.path("train-00" + std::to_string(i) + ".bin"));
    EXPECT_EQ((*r)[i].bytes, 1000u + 100u * i);
    EXPECT_EQ((*r)[i].digest, "") << "no index yet";
  }
  auto all = resolve_shards(s.d + "/*");
  ASSERT_TRUE(all) << all.message();
  EXPECT_EQ(all->size(), 7u) << "train, val and notes.txt; not the hidden file";
  auto q = resolve_shards(s.d + "/train-00[13].bin");
  ASSERT_TRUE(q) << q.message();
  EXPECT_EQ(urls(q.value()), (std::vector<std::string>{s.path("train-001.bin"), s.path("train-003.bin")}));
}

TEST(data_shards, relative_paths_are_taken_from_the_working_directory) {
  shard_dir s;
  const auto before = std::filesystem::current_path();
  std::filesystem::current_path(std::filesystem::path(s.d).parent_path());
  auto r = resolve_shards(std::filesystem::path(s.d).filename().string() + "/val-*.bin");
  std::filesystem::current_path(before);
  ASSERT_TRUE(r) << r.message();
  EXPECT_EQ(urls(r.value()), std::vector<std::string>{s.path("val-0.bin")});
}

TEST(data_shards, a_range_expands_zero_padded_and_every_file_of_it_must_exist) {
  shard_dir s;
  auto r = resolve_shards(s.d + "/train-{000..004}.bin");
  ASSERT_TRUE(r) << r.message();
  EXPECT_EQ(r->size(), 5u);
  EXPECT_EQ(r->back().url, s.path("train-004.bin"));
  auto down = resolve_shards(s.d + "/train-{003..001}.bin");
  ASSERT_TRUE(down) << down.message();
  EXPECT_EQ(urls(down.value()), (std::vector<std::string>{s.path("train-001.bin"), s.path("train-002.bin"), s.path("train-003.bin")}));
  write(s.path("x-7.bin"), "7");
  write(s.path("x-8.bin"), "8");
  auto plain = resolve_shards(s.d + "/x-{7..8}.bin");
  ASSERT_TRUE(plain) << plain.message();
  EXPECT_EQ(plain->size(), 2u) << "no padding without a leading zero";

  auto missing = resolve_shards(s.d + "/train-{000..007}.bin");
  ASSERT_FALSE(missing);
  EXPECT_TRUE(one_line(missing.message())) << missing.message();
  EXPECT_NE(missing.message().find("'" + s.path("train-005.bin") + "' of its range does not exist"), std::string::npos) << missing.message();
  EXPECT_EQ(missing.message().find("train-006"), std::string::npos) << "the first missing one only: " << missing.message();

  auto bad = resolve_shards(s.d + "/train-{a..c}.bin");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.message().find("is not a range of numbers like {000..127}"), std::string::npos) << bad.message();
  auto huge = resolve_shards(s.d + "/t-{0..99999999}.bin");
  ASSERT_FALSE(huge);
  EXPECT_NE(huge.message().find("names more than 1000000 files"), std::string::npos) << huge.message();
}

TEST(data_shards, a_list_joins_its_items_sorted_without_duplicates) {
  shard_dir s;
  auto r = resolve_shards(s.path("val-0.bin") + ", " + s.d + "/train-00[34].bin," + s.path("train-003.bin") + "," + s.d + "/train-{000..001}.bin");
  ASSERT_TRUE(r) << r.message();
  EXPECT_EQ(urls(r.value()), (std::vector<std::string>{s.path("train-000.bin"), s.path("train-001.bin"), s.path("train-003.bin"),
                                                       s.path("train-004.bin"), s.path("val-0.bin")}));
}

TEST(data_shards, specs_that_name_nothing_are_one_line_naming_the_spec) {
  shard_dir s;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {s.d + "/test-*.bin", "nothing matches '" + s.path("test-*.bin") + "'"},
      {s.path("nope.bin"), "'" + s.path("nope.bin") + "' does not exist"},
      {s.d + "/no-such-dir/train-*.bin", "is not a directory"},
      {s.d + "/*/train-*.bin", "a glob may only be in the file name"},
      {s.d + "/", "names a directory or prefix, not shards"},
      {" , ", "names no shards"},
      {"s3://bucket", "names a bucket, not shards"},
  };
  for (const auto& [spec, want] : cases) {
    auto r = resolve_shards(spec);
    ASSERT_FALSE(r) << spec;
    EXPECT_TRUE(one_line(r.message())) << r.message();
    EXPECT_EQ(r.message().rfind("data '", 0), 0u) << r.message();
    EXPECT_NE(r.message().find(want), std::string::npos) << spec << " -> " << r.message();
  }
}

TEST(data_shards, the_index_gives_each_shard_its_digest_in_the_form_of_file_digest) {
  shard_dir s;
  std::vector<std::tuple<std::string, size_t, uint64_t>> heard;
  auto n = write_shard_index(s.d + "/train-*.bin", "", [&](const std::string& where, size_t k, uint64_t b) { heard.emplace_back(where, k, b); });
  ASSERT_TRUE(n) << n.message();
  EXPECT_EQ(n.value(), 5u);
  ASSERT_EQ(heard.size(), 1u);
  EXPECT_EQ(std::get<0>(heard[0]), s.path(shard_index_name));
  EXPECT_EQ(std::get<1>(heard[0]), 5u);
  EXPECT_EQ(std::get<2>(heard[0]), 1000u + 1100 + 1200 + 1300 + 1400);
  auto parsed = parse_shard_index(read_all(s.path(shard_index_name)), "x");
  ASSERT_TRUE(parsed) << parsed.message();
  EXPECT_EQ(parsed->size(), 5u);

  auto r = resolve_shards(s.d + "/train-*.bin");
  ASSERT_TRUE(r) << r.message();
  ASSERT_EQ(r->size(), 5u) << "the index itself is never a shard";
  for (const auto& x : r.value()) {
    auto want = file_digest(x.url);
    ASSERT_TRUE(want);
    EXPECT_EQ(x.digest, want.value()) << x.url;
  }
  // Indexing val-* afterwards keeps train-*'s entries.
  ASSERT_TRUE(write_shard_index(s.path("val-0.bin")));
  auto both = resolve_shards(s.d + "/train-*.bin," + s.d + "/val-*.bin");
  ASSERT_TRUE(both) << both.message();
  EXPECT_EQ(both->size(), 6u);
  for (const auto& x : both.value()) EXPECT_FALSE(x.digest.empty()) << x.url;
}

TEST(data_shards, a_shard_whose_size_differs_from_the_index_or_missing_from_it_is_refused) {
  shard_dir s;
  ASSERT_TRUE(write_shard_index(s.d + "/train-*.bin"));
  write(s.path("train-002.bin"), bytes_of(1201, 2));
  auto r = resolve_shards(s.d + "/train-*.bin");
  ASSERT_FALSE(r);
  EXPECT_TRUE(one_line(r.message()));
  EXPECT_NE(r.message().find("shard " + s.path("train-002.bin") + ": 1201 bytes, the index says 1200"), std::string::npos) << r.message();

  ASSERT_TRUE(write_shard_index(s.d + "/train-*.bin")) << "indexing again fixes it";
  ASSERT_TRUE(resolve_shards(s.d + "/train-*.bin"));
  write(s.path("train-005.bin"), "new");
  auto added = resolve_shards(s.d + "/train-*.bin");
  ASSERT_FALSE(added);
  EXPECT_NE(added.message().find("shard " + s.path("train-005.bin") + " is not in " + s.path(shard_index_name)), std::string::npos)
      << added.message();
}

TEST(data_shards, a_malformed_index_is_one_line_naming_it) {
  shard_dir s;
  const std::string idx = s.path(shard_index_name);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"garbage{", "not JSON"},
      {"[1,2]", "not a JSON object"},
      {R"({"version":2,"shards":[]})", "\"version\" is not 1"},
      {R"({"version":1})", "no \"shards\" array"},
      {R"({"version":1,"shards":[7]})", "entry 0 is not an object"},
      {R"({"version":1,"shards":[{"bytes":1,"xxh3":"0123456789abcdef"}]})", "entry 0 has no \"name\""},
      {R"({"version":1,"shards":[{"name":"../x","bytes":1,"xxh3":"0123456789abcdef"}]})", "is not a file name"},
      {R"({"version":1,"shards":[{"name":"a","bytes":-1,"xxh3":"0123456789abcdef"}]})", "has no \"bytes\" count"},
      {R"({"version":1,"shards":[{"name":"a","bytes":1,"xxh3":"0123456789ABCDEF"}]})", "is not 16 lower-case hex digits"},
      {R"({"version":1,"shards":[{"name":"a\n","bytes":1}]})", "(a\\x0a) has no \"xxh3\""},
      {R"({"version":1,"shards":[{"name":"a","bytes":1,"xxh3":"0123456789abcdef"},{"name":"a","bytes":1,"xxh3":"0123456789abcdef"}]})",
       "\"a\" is listed twice"},
      {std::string(100000, '[') + std::string(100000, ']'), "nested deeper than an index is"},
  };
  for (const auto& [text, want] : cases) {
    write(idx, text);
    auto r = resolve_shards(s.d + "/train-*.bin");
    ASSERT_FALSE(r) << text;
    EXPECT_TRUE(one_line(r.message())) << r.message();
    EXPECT_NE(r.message().find("shard index " + idx + " is malformed: "), std::string::npos) << r.message();
    EXPECT_NE(r.message().find(want), std::string::npos) << r.message();
    EXPECT_NE(r.message().find("rewrite it with `dtactor data index`"), std::string::npos) << r.message();
  }
  // An index larger than any real one is refused before it is read.
  ASSERT_EQ(::truncate(idx.c_str(), (64ll << 20) + 1), 0);
  auto big = resolve_shards(s.d + "/train-*.bin");
  ASSERT_FALSE(big);
  EXPECT_TRUE(one_line(big.message()));
  EXPECT_NE(big.message().find("more than the 67108864"), std::string::npos) << big.message();
  // `dtactor data index` replaces a malformed index.
  ASSERT_TRUE(write_shard_index(s.d + "/train-*.bin"));
  EXPECT_TRUE(resolve_shards(s.d + "/train-*.bin"));
}

TEST(data_shards, the_set_digest_changes_when_one_byte_of_an_indexed_shard_changes) {
  shard_dir s;
  ASSERT_TRUE(write_shard_index(s.d + "/train-*.bin"));
  auto a = resolve_shards(s.d + "/train-*.bin");
  ASSERT_TRUE(a);
  const std::string d1 = shard_set_digest(a.value());
  EXPECT_EQ(d1.rfind("5x6000:", 0), 0u) << d1;
  EXPECT_EQ(d1.size(), std::string("5x6000:").size() + 16);
  EXPECT_EQ(shard_set_digest(resolve_shards(s.d + "/train-*.bin").value()), d1) << "a pure function of the set";

  std::string b2 = read_all(s.path("train-002.bin"));
  b2[600] = static_cast<char>(b2[600] ^ 1);
  write(s.path("train-002.bin"), b2);
  ASSERT_TRUE(write_shard_index(s.d + "/train-*.bin"));
  auto b = resolve_shards(s.d + "/train-*.bin");
  ASSERT_TRUE(b);
  EXPECT_NE(shard_set_digest(b.value()), d1);
  EXPECT_EQ(shard_set_digest(b.value()).rfind("5x6000:", 0), 0u);
  EXPECT_NE(shard_set_digest(std::vector<shard_info>(a->begin(), a->begin() + 4)), d1);
}

TEST(data_shards, the_reader_maps_local_shards_in_place_once_and_counts_them) {
  shard_dir s;
  temp_dir cache;
  auto shards = resolve_shards(s.d + "/train-*.bin," + s.path("val-0.bin"));
  ASSERT_TRUE(shards);
  auto r = shard_reader::open(shards.value(), {cache.path() + "/cache", 0, ""});
  ASSERT_TRUE(r) << r.message() << ": local shards need no cache";
  EXPECT_FALSE(std::filesystem::exists(cache.path() + "/cache")) << "no cache directory for local shards";
  shard_reader& reader = *r.value();
  ASSERT_EQ(reader.shards().size(), 6u);
  auto a = reader.get(1);
  ASSERT_TRUE(a) << a.message();
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(a.value()->data()), a.value()->size()), read_all(s.path("train-001.bin")));
  auto again = reader.get(1);
  ASSERT_TRUE(again);
  EXPECT_EQ(again.value().get(), a.value().get()) << "one mapping per shard";
  auto v = reader.get(5);
  ASSERT_TRUE(v);
  EXPECT_EQ(v.value()->size(), 300u);
  reader.read_ahead({2, 3});
  EXPECT_TRUE(reader.wait_read_ahead(std::chrono::seconds(10)));
  const auto st = reader.stats();
  EXPECT_EQ(st.bytes_read_local, 1100u + 300u);
  EXPECT_EQ(st.cache_hits, 3u);
  EXPECT_EQ(st.cache_misses, 0u);
  EXPECT_EQ(st.bytes_read_s3, 0u);
  EXPECT_EQ(st.cache_used_bytes, 0u);

  auto out = reader.get(6);
  ASSERT_FALSE(out);
  EXPECT_TRUE(one_line(out.message()));
  // A shard that changed after it was listed is refused, naming it.
  write(s.path("train-004.bin"), "short");
  auto changed = reader.get(4);
  ASSERT_FALSE(changed);
  EXPECT_EQ(changed.message(), "shard " + s.path("train-004.bin") + ": 5 bytes, the listing said 1400");
  ::unlink(s.path("train-003.bin").c_str());
  auto gone = reader.get(3);
  ASSERT_FALSE(gone);
  EXPECT_TRUE(one_line(gone.message()));
  EXPECT_NE(gone.message().find(s.path("train-003.bin")), std::string::npos) << gone.message();
}

TEST(data_shards, the_reader_refuses_a_cache_smaller_than_the_two_largest_remote_shards) {
  temp_dir cache;
  std::vector<shard_info> shards = {{"s3://b/p/a.bin", 100, ""}, {"s3://b/p/b.bin", 300, ""}, {"s3://b/p/c.bin", 200, ""}, {"/local/big", 10000, ""}};
  auto small = shard_reader::open(shards, {cache.path(), 499, ""});
  ASSERT_FALSE(small);
  EXPECT_EQ(small.message(),
            "data.cache_bytes is 499; it must hold the two largest remote shards (300 + 200 = 500 bytes: one being read while the next is fetched)");
  auto fits = shard_reader::open(shards, {cache.path() + "/c", 500, ""});
  ASSERT_TRUE(fits) << fits.message();
  EXPECT_TRUE(std::filesystem::is_directory(cache.path() + "/c")) << "made for remote shards";
  EXPECT_EQ(fits.value()->stats().cache_used_bytes, 0u);
  temp_dir blocker;
  write(blocker.path() + "/file", "x");
  auto unwritable = shard_reader::open(shards, {blocker.path() + "/file/cache", 500, ""});
  ASSERT_FALSE(unwritable);
  EXPECT_TRUE(one_line(unwritable.message()));
  EXPECT_EQ(unwritable.message().rfind("data cache: ", 0), 0u) << unwritable.message();
}

// No S3 server at the endpoint: one line, no hang (the store's retries end).
TEST(data_shards, an_unreachable_endpoint_is_one_line_from_resolve_and_from_get) {
  temp_dir cache;
  ::setenv("AWS_ACCESS_KEY_ID", "TESTACCESSKEY0000001", 1);
  ::setenv("AWS_SECRET_ACCESS_KEY", "testsecret", 1);
  const std::string endpoint = "http://127.0.0.1:1";
  auto r = resolve_shards("s3://bucket/corpus/train-*.bin", endpoint);
  ASSERT_FALSE(r);
  EXPECT_TRUE(one_line(r.message())) << r.message();
  EXPECT_EQ(r.message().rfind("data 's3://bucket/corpus/train-*.bin': S3 ", 0), 0u) << r.message();
  auto reader = shard_reader::open({{"s3://bucket/corpus/train-000.bin", 10, ""}}, {cache.path(), 100, endpoint});
  ASSERT_TRUE(reader) << reader.message();
  auto g = reader.value()->get(0);
  ASSERT_FALSE(g);
  EXPECT_TRUE(one_line(g.message())) << g.message();
  EXPECT_EQ(g.message().rfind("shard s3://bucket/corpus/train-000.bin: S3 ", 0), 0u) << g.message();
  EXPECT_EQ(reader.value()->stats().shards_failed, 1u);
  ::unsetenv("AWS_ACCESS_KEY_ID");
  ::unsetenv("AWS_SECRET_ACCESS_KEY");
}

}  // namespace
}  // namespace dtactor
