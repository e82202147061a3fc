// Sharded data sets in S3 (data/data_shards.hpp, docs/data.md) against a
// real S3 server (tests/rgw_env.hpp: Ceph's radosgw, started once for this
// program; skipped, saying so, without Ceph's packages): resolving s3://
// specs, the index on S3, and the reader's cache: fetched once per node,
// verified, read ahead, never larger than data.cache_bytes.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>

#include "cluster_harness.hpp"
#include "rgw_env.hpp"
#include "data/data_shards.hpp"
#include "base/hash.hpp"
#include "base/process.hpp"
#include "test_util.hpp"

namespace dtactor {
namespace {

using testing::open_ok;
using testing::opts;
using testing::rgw;
using testing::temp_dir;

constexpr auto generous = std::chrono::seconds(120);

bool one_line(const std::string& s) { return !s.empty() && s.find('\n') == std::string::npos; }

std::string as_string(const shard_bytes& b) { return std::string(reinterpret_cast<const char*>(b.data()), b.size()); }

// A bucket holding PREFIX/train-000.bin.. of the given sizes (bytes from
// seed 100 + i), plus a few objects that are not shards of train-*.
struct s3_shards {
  std::unique_ptr<object_store> store;
  std::string base;  // s3://bucket/prefix
  std::vector<std::string> bytes;
  s3_shards(const std::string& bucket, const std::vector<size_t>& sizes) {
    store = open_ok(opts(bucket, "corpus"));
    base = "s3://" + bucket + "/corpus";
    for (size_t i = 0; i < sizes.size(); ++i) {
      bytes.push_back(testing::random_bytes(sizes[i], 100 + static_cast<int>(i)));
      EXPECT_TRUE(store->put(name(i), bytes.back()));
    }
    EXPECT_TRUE(store->put("val-0.bin", "validation"));
    auto sub = open_ok(opts(bucket, "corpus/sub"));
    EXPECT_TRUE(sub && sub->put("train-009.bin", "deeper: not listed"));
  }
  static std::string name(size_t i) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "train-%03zu.bin", i);
    return buf;
  }
  std::string url(size_t i) const { return base + "/" + name(i); }
  std::string glob() const { return base + "/train-*.bin"; }
  uint64_t total() const {
    uint64_t t = 0;
    for (const auto& b : bytes) t += b.size();
    return t;
  }
};

// The cache file of a shard, as docs/data.md names it.
std::string cache_file(const std::string& dir, const std::string& url) {
  return dir + "/" + hex64(hash64(url.data(), url.size())) + "-" + url.substr(url.rfind('/') + 1);
}

// What the cache directory holds (shards and fetches in flight), counted
// under its space lock as the readers count it (docs/data.md, "The cache").
uint64_t cache_dir_bytes(const std::string& dir) {
  const std::string lock = dir + "/.locks/space.lock";
  const int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(::flock(fd, LOCK_EX), 0);
  uint64_t used = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n[0] != '.' && e.is_regular_file()) used += e.file_size();
  }
  ::close(fd);
  return used;
}

std::unique_ptr<shard_reader> reader_over(const std::vector<shard_info>& shards, const std::string& dir, uint64_t cache_bytes) {
  auto r = shard_reader::open(shards, {dir, cache_bytes, rgw::endpoint});
  EXPECT_TRUE(r) << r.message();
  return r ? std::move(r.value()) : nullptr;
}

TEST(data_shards_s3, an_s3_glob_lists_the_objects_under_its_prefix_and_a_range_must_exist_whole) {
  NEED_RGW();
  s3_shards s("shards-glob", {1000, 2000, 3000, 4000});
  auto r = resolve_shards(s.glob(), rgw::endpoint);
  ASSERT_TRUE(r) << r.message();
  ASSERT_EQ(r->size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ((*r)[i].url, s.url(i));
    EXPECT_EQ((*r)[i].bytes, 1000u * (i + 1));
    EXPECT_EQ((*r)[i].digest, "");
  }
  auto range = resolve_shards(s.base + "/train-{001..003}.bin," + s.base + "/val-0.bin", rgw::endpoint);
  ASSERT_TRUE(range) << range.message();
  EXPECT_EQ(range->size(), 4u);
  EXPECT_EQ(range->back().url, s.base + "/val-0.bin");

  auto missing = resolve_shards(s.base + "/train-{000..005}.bin", rgw::endpoint);
  ASSERT_FALSE(missing);
  EXPECT_TRUE(one_line(missing.message())) << missing.message();
  EXPECT_NE(missing.message().find("'" + s.url(4) + "' of its range does not exist"), std::string::npos) << missing.message();
  auto none = resolve_shards(s.base + "/test-*.bin", rgw::endpoint);
  ASSERT_FALSE(none);
  EXPECT_NE(none.message().find("nothing matches '" + s.base + "/test-*.bin'"), std::string::npos) << none.message();
  auto prefix_glob = resolve_shards("s3://shards-glob/c*/train-*.bin", rgw::endpoint);
  ASSERT_FALSE(prefix_glob);
  EXPECT_NE(prefix_glob.message().find("a glob may only be in the file name"), std::string::npos) << prefix_glob.message();
}

TEST(data_shards_s3, the_index_written_on_s3_gives_digests_and_a_changed_size_is_refused) {
  NEED_RGW();
  s3_shards s("shards-index", {1000, 2000, 3000});
  std::vector<std::string> heard;
  auto n = write_shard_index(s.glob(), rgw::endpoint, [&](const std::string& where, size_t k, uint64_t b) {
    heard.push_back(where + " " + std::to_string(k) + " " + std::to_string(b));
  });
  ASSERT_TRUE(n) << n.message();
  EXPECT_EQ(n.value(), 3u);
  EXPECT_EQ(heard, std::vector<std::string>{s.base + "/dtactor-shards.json 3 6000"});
  auto r = resolve_shards(s.glob(), rgw::endpoint);
  ASSERT_TRUE(r) << r.message();
  ASSERT_EQ(r->size(), 3u) << "the index is not a shard";
  for (size_t i = 0; i < 3; ++i)
    EXPECT_EQ((*r)[i].digest, std::to_string(s.bytes[i].size()) + ":" + hex64(hash64(s.bytes[i].data(), s.bytes[i].size())));

  ASSERT_TRUE(s.store->put(s.name(1), testing::random_bytes(2001, 7)));
  auto changed = resolve_shards(s.glob(), rgw::endpoint);
  ASSERT_FALSE(changed);
  EXPECT_TRUE(one_line(changed.message()));
  EXPECT_NE(changed.message().find("shard " + s.url(1) + ": 2001 bytes, the index says 2000"), std::string::npos) << changed.message();
  ASSERT_TRUE(s.store->put("dtactor-shards.json", "{\"version\":1,\"shards\":[{\"name\":"));
  auto malformed = resolve_shards(s.glob(), rgw::endpoint);
  ASSERT_FALSE(malformed);
  EXPECT_NE(malformed.message().find("shard index " + s.base + "/dtactor-shards.json is malformed: not JSON"), std::string::npos)
      << malformed.message();
}

TEST(data_shards_s3, the_reader_fetches_verifies_and_then_serves_a_shard_from_its_cache) {
  NEED_RGW();
  s3_shards s("shards-read", {300000, 200000, 100000});
  ASSERT_TRUE(write_shard_index(s.glob(), rgw::endpoint));
  auto shards = resolve_shards(s.glob(), rgw::endpoint);
  ASSERT_TRUE(shards) << shards.message();
  temp_dir cache;
  auto reader = reader_over(shards.value(), cache.path(), 600000);
  ASSERT_TRUE(reader);
  {
    auto a = reader->get(0);
    ASSERT_TRUE(a) << a.message();
    EXPECT_EQ(as_string(*a.value()), s.bytes[0]);
    auto st = reader->stats();
    EXPECT_EQ(st.bytes_read_s3, 300000u);
    EXPECT_EQ(st.cache_misses, 1u);
    EXPECT_EQ(st.cache_hits, 0u);
    EXPECT_EQ(st.shards_verified, 1u);
    EXPECT_EQ(st.shards_failed, 0u);
    EXPECT_EQ(st.cache_used_bytes, 300000u);
    EXPECT_EQ(std::filesystem::file_size(cache_file(cache.path(), s.url(0))), 300000u);
    auto b = reader->get(0);
    ASSERT_TRUE(b);
    EXPECT_EQ(b.value().get(), a.value().get()) << "still held: the same mapping";
  }
  auto again = reader->get(0);
  ASSERT_TRUE(again);
  EXPECT_EQ(as_string(*again.value()), s.bytes[0]);
  const auto st = reader->stats();
  EXPECT_EQ(st.bytes_read_s3, 300000u) << "from the cache, not fetched again";
  EXPECT_EQ(st.cache_hits, 2u);
  EXPECT_EQ(st.cache_misses, 1u);

  // A reader of another process finds it in the cache: a hit, no fetch.
  auto other = reader_over(shards.value(), cache.path(), 600000);
  auto o = other->get(0);
  ASSERT_TRUE(o) << o.message();
  EXPECT_EQ(as_string(*o.value()), s.bytes[0]);
  EXPECT_EQ(other->stats().bytes_read_s3, 0u);
  EXPECT_EQ(other->stats().cache_hits, 1u);
  EXPECT_EQ(other->stats().cache_used_bytes, 300000u);
}

TEST(data_shards_s3, a_shard_overwritten_after_indexing_is_refused_in_one_line_and_never_served) {
  NEED_RGW();
  s3_shards s("shards-overwritten", {50000, 60000});
  ASSERT_TRUE(write_shard_index(s.glob(), rgw::endpoint));
  auto shards = resolve_shards(s.glob(), rgw::endpoint);
  ASSERT_TRUE(shards) << shards.message();
  ASSERT_TRUE(s.store->put(s.name(1), testing::random_bytes(60000, 666))) << "same size, other bytes";
  temp_dir cache;
  auto reader = reader_over(shards.value(), cache.path(), 200000);
  ASSERT_TRUE(reader);
  for (int attempt = 0; attempt < 2; ++attempt) {
    auto bad = reader->get(1);
    ASSERT_FALSE(bad) << "never served";
    EXPECT_TRUE(one_line(bad.message())) << bad.message();
    EXPECT_EQ(bad.message().rfind("shard " + s.url(1) + ": its bytes hash to 60000:", 0), 0u) << bad.message();
    EXPECT_NE(bad.message().find(", the index says " + shards.value()[1].digest), std::string::npos) << bad.message();
    EXPECT_EQ(reader->stats().shards_failed, attempt + 1u);
    EXPECT_FALSE(std::filesystem::exists(cache_file(cache.path(), s.url(1))));
    EXPECT_EQ(cache_dir_bytes(cache.path()), 0u) << "no temp file left either";
  }
  // A stale file in the cache (another version of shard 0, same size) is
  // found out by its digest, dropped and fetched again.
  std::filesystem::create_directories(cache.path());
  ASSERT_TRUE(std::filesystem::is_directory(cache.path()));
  {
    std::ofstream f(cache_file(cache.path(), s.url(0)), std::ios::binary);
    f << testing::random_bytes(50000, 5);
  }
  auto good = reader->get(0);
  ASSERT_TRUE(good) << good.message();
  EXPECT_EQ(as_string(*good.value()), s.bytes[0]);
  EXPECT_EQ(reader->stats().bytes_read_s3, 60000u * 2 + 50000u);
  EXPECT_EQ(reader->stats().shards_verified, 1u);
  // A shard removed from S3 since it was listed: one line naming it.
  ASSERT_TRUE(s.store->remove(s.name(1)));
  auto gone = reader->get(1);
  ASSERT_FALSE(gone);
  EXPECT_EQ(gone.message(), "shard " + s.url(1) + ": no such object (removed since the shards were listed?)");
}

TEST(data_shards_s3, two_readers_sharing_a_cache_fetch_each_shard_once_between_them) {
  NEED_RGW();
  s3_shards s("shards-two-readers", {400000, 300000, 500000, 200000});
  auto shards = resolve_shards(s.glob(), rgw::endpoint);
  ASSERT_TRUE(shards) << shards.message();
  temp_dir cache;
  auto a = reader_over(shards.value(), cache.path(), 2000000);
  auto b = reader_over(shards.value(), cache.path(), 2000000);
  ASSERT_TRUE(a && b);
  auto read_all = [&](shard_reader* r, std::vector<std::string>* got) {
    for (size_t i = 0; i < 4; ++i) {
      auto x = r->get(i);
      got->push_back(x ? as_string(*x.value()) : x.message());
    }
  };
  std::vector<std::string> got_a, got_b;
  std::thread ta(read_all, a.get(), &got_a), tb(read_all, b.get(), &got_b);
  ta.join();
  tb.join();
  EXPECT_EQ(got_a, s.bytes);
  EXPECT_EQ(got_b, s.bytes);
  EXPECT_EQ(a->stats().bytes_read_s3 + b->stats().bytes_read_s3, s.total()) << "each shard fetched once on this node";
  EXPECT_EQ(a->stats().cache_hits + a->stats().cache_misses + b->stats().cache_hits + b->stats().cache_misses, 8u);
}

// The child side of the next test: reads every shard of $DATA_SHARDS_SPEC
// through the cache $DATA_SHARDS_CACHE and writes what it fetched.
TEST(data_shards_s3_child, DISABLED_reads_every_shard) {
  const char* spec = std::getenv("DATA_SHARDS_SPEC");
  if (!spec) GTEST_SKIP() << "run by two_processes_sharing_a_cache_fetch_each_shard_once";
  auto shards = resolve_shards(spec, rgw::endpoint);
  ASSERT_TRUE(shards) << shards.message();
  auto reader = reader_over(shards.value(), std::getenv("DATA_SHARDS_CACHE"), 100u << 20);
  ASSERT_TRUE(reader);
  uint64_t digest = 0;
  for (size_t i = 0; i < shards->size(); ++i) {
    auto x = reader->get(i);
    ASSERT_TRUE(x) << x.message();
    digest ^= hash64(x.value()->data(), x.value()->size(), i);
  }
  std::ofstream(std::getenv("DATA_SHARDS_OUT")) << reader->stats().bytes_read_s3 << " " << hex64(digest) << "\n";
}

TEST(data_shards_s3, two_processes_sharing_a_cache_fetch_each_shard_once_between_them) {
  NEED_RGW();
  s3_shards s("shards-two-procs", {1u << 20, 700000, 1500000, 300000, 900000});
  ASSERT_TRUE(write_shard_index(s.glob(), rgw::endpoint));
  uint64_t want = 0;
  for (size_t i = 0; i < s.bytes.size(); ++i) want ^= hash64(s.bytes[i].data(), s.bytes[i].size(), i);
  temp_dir cache;
  ::setenv("DTACTOR_TEST_RGW_ENDPOINT", rgw::endpoint.c_str(), 1);
  ::setenv("DATA_SHARDS_SPEC", s.glob().c_str(), 1);
  ::setenv("DATA_SHARDS_CACHE", (cache.path() + "/cache").c_str(), 1);
  std::vector<child_process> children;
  for (int k = 0; k < 2; ++k) {
    ::setenv("DATA_SHARDS_OUT", (cache.path() + "/out" + std::to_string(k)).c_str(), 1);
    auto c =
        child_process::spawn({"/proc/self/exe", "--gtest_filter=data_shards_s3_child.DISABLED_reads_every_shard", "--gtest_also_run_disabled_tests"},
                             false, cache.path() + "/log" + std::to_string(k));
    ASSERT_TRUE(c) << c.message();
    children.push_back(std::move(c.value()));
  }
  for (const char* v : {"DTACTOR_TEST_RGW_ENDPOINT", "DATA_SHARDS_SPEC", "DATA_SHARDS_CACHE", "DATA_SHARDS_OUT"}) ::unsetenv(v);
  uint64_t fetched = 0;
  for (int k = 0; k < 2; ++k) {
    auto e = children[k].wait(static_cast<int>(std::chrono::milliseconds(generous).count()));
    ASSERT_TRUE(e) << "child " << k << " did not end";
    std::ifstream log(cache.path() + "/log" + std::to_string(k));
    ASSERT_EQ(e->exit_code, 0) << std::string(std::istreambuf_iterator<char>(log), {});
    std::ifstream out(cache.path() + "/out" + std::to_string(k));
    uint64_t bytes = 0;
    std::string digest;
    ASSERT_TRUE(out >> bytes >> digest) << "child " << k << " wrote nothing";
    EXPECT_EQ(digest, hex64(want)) << "child " << k << " read other bytes";
    fetched += bytes;
  }
  EXPECT_EQ(fetched, s.total()) << "each shard fetched once on this node";
}

TEST(data_shards_s3, read_ahead_makes_a_later_get_a_hit_and_a_shard_in_flight_is_fetched_once) {
  NEED_RGW();
  s3_shards s("shards-read-ahead", {100000, 200000, 300000, 4u << 20});
  ASSERT_TRUE(write_shard_index(s.glob(), rgw::endpoint));
  auto shards = resolve_shards(s.glob(), rgw::endpoint);
  ASSERT_TRUE(shards) << shards.message();
  temp_dir cache;
  auto reader = reader_over(shards.value(), cache.path(), 10u << 20);
  ASSERT_TRUE(reader);
  reader->read_ahead({2, 1});
  ASSERT_TRUE(reader->wait_read_ahead(generous));
  auto st = reader->stats();
  EXPECT_EQ(st.bytes_read_s3, 500000u);
  EXPECT_EQ(st.read_ahead_depth, 0u);
  EXPECT_EQ(st.shards_verified, 2u);
  EXPECT_EQ(st.cache_used_bytes, 500000u);
  EXPECT_EQ(st.cache_used_bytes, cache_dir_bytes(cache.path()));
  auto two = reader->get(2);
  ASSERT_TRUE(two) << two.message();
  EXPECT_EQ(as_string(*two.value()), s.bytes[2]);
  st = reader->stats();
  EXPECT_EQ(st.cache_hits, 1u);
  EXPECT_EQ(st.cache_misses, 0u);
  EXPECT_EQ(st.bytes_read_s3, 500000u);

  // Shard 3 asked for while the thread may be fetching it: whoever gets
  // there first fetches it, the other waits; once in all.
  reader->read_ahead({3});
  auto three = reader->get(3);
  ASSERT_TRUE(three) << three.message();
  EXPECT_EQ(as_string(*three.value()), s.bytes[3]);
  ASSERT_TRUE(reader->wait_read_ahead(generous));
  st = reader->stats();
  EXPECT_EQ(st.bytes_read_s3, 500000u + (4u << 20));
  EXPECT_EQ(st.cache_hits + st.cache_misses, 2u);
}

TEST(data_shards_s3, read_ahead_never_evicts_a_shard_still_held_or_in_the_hint_and_goes_on_once_one_is_released) {
  NEED_RGW();
  s3_shards s("shards-held", {100000, 100000, 100000});
  auto shards = resolve_shards(s.glob(), rgw::endpoint);
  ASSERT_TRUE(shards) << shards.message();
  temp_dir cache;
  auto reader = reader_over(shards.value(), cache.path(), 200000);
  ASSERT_TRUE(reader);
  auto cached = [&](size_t i) { return std::filesystem::exists(cache_file(cache.path(), s.url(i))); };
  auto zero = reader->get(0);
  ASSERT_TRUE(zero) << zero.message();
  reader->read_ahead({1});
  ASSERT_TRUE(reader->wait_read_ahead(generous));
  EXPECT_TRUE(cached(0) && cached(1));
  reader->read_ahead({1, 2});
  ASSERT_TRUE(reader->wait_read_ahead(generous));
  EXPECT_TRUE(cached(0)) << "held";
  EXPECT_TRUE(cached(1)) << "in the hint";
  EXPECT_FALSE(cached(2)) << "no room without evicting those";
  EXPECT_EQ(reader->stats().read_ahead_depth, 1u) << "shard 2 waits for room";
  EXPECT_EQ(reader->stats().cache_used_bytes, 200000u);
  zero = make_error("released");
  ASSERT_TRUE(reader->wait_read_ahead(generous));
  EXPECT_FALSE(cached(0)) << "released, not in the hint: evicted for shard 2";
  EXPECT_TRUE(cached(1));
  EXPECT_TRUE(cached(2));
  EXPECT_EQ(reader->stats().read_ahead_depth, 0u);
  auto two = reader->get(2);
  ASSERT_TRUE(two) << two.message();
  EXPECT_EQ(as_string(*two.value()), s.bytes[2]);
  EXPECT_EQ(reader->stats().cache_hits, 1u);
  EXPECT_EQ(reader->stats().bytes_read_s3, 300000u);
}

TEST(data_shards_s3, the_cache_never_holds_more_than_cache_bytes_while_reading_through_more_shards_than_fit) {
  NEED_RGW();
  const std::vector<size_t> sizes = {200000, 250000, 180000, 260000, 210000, 190000, 240000, 230000};
  s3_shards s("shards-bounded", sizes);
  ASSERT_TRUE(write_shard_index(s.glob(), rgw::endpoint));
  auto shards = resolve_shards(s.glob(), rgw::endpoint);
  ASSERT_TRUE(shards) << shards.message();
  temp_dir cache;
  const uint64_t cap = 260000 + 250000 + 100000;  // the two largest and a bit
  auto reader = reader_over(shards.value(), cache.path(), cap);
  ASSERT_TRUE(reader);
  for (int pass = 0; pass < 2; ++pass) {
    std::shared_ptr<const shard_bytes> previous;
    for (size_t k = 0; k < sizes.size(); ++k) {
      const size_t i = pass == 0 ? k : sizes.size() - 1 - k;
      auto cur = reader->get(i);
      ASSERT_TRUE(cur) << cur.message();
      EXPECT_EQ(as_string(*cur.value()), s.bytes[i]);
      EXPECT_LE(cache_dir_bytes(cache.path()), cap) << "after get(" << i << ")";
      previous = cur.value();  // held while the next one is got
      std::vector<size_t> next;
      for (size_t d = 1; d <= 2; ++d)
        if (pass == 0 ? i + d < sizes.size() : i >= d) next.push_back(pass == 0 ? i + d : i - d);
      reader->read_ahead(next);
      if (k % 2) {
        ASSERT_TRUE(reader->wait_read_ahead(generous));
        EXPECT_EQ(reader->stats().cache_used_bytes, cache_dir_bytes(cache.path()));
      }
      EXPECT_LE(cache_dir_bytes(cache.path()), cap) << "while reading ahead of " << i;
    }
  }
  ASSERT_TRUE(reader->wait_read_ahead(generous));
  const auto st = reader->stats();
  EXPECT_LE(st.cache_peak_bytes, cap);
  EXPECT_LE(st.cache_used_bytes, cap);
  EXPECT_GE(st.bytes_read_s3, s.total()) << "every shard fetched at least once";
  EXPECT_EQ(st.shards_failed, 0u);
  EXPECT_EQ(st.cache_hits + st.cache_misses, 2 * sizes.size());
  EXPECT_GT(st.cache_hits, 0u) << "read-ahead helped";
}

// A TorchScript job trains from s3:// token shards on nodes started by hand,
// each with an empty disk of its own (its own TMPDIR, so its own cache): a
// node is killed with its rank mid-run, the job waits (cluster.floor_nodes
// = 2: this tiny job would otherwise finish before a replacement starts), a
// third node joins with nothing cached, fetches the shards it reads and
// contributes; the job loses no step and learns the pattern.
TEST(data_shards_s3, a_torchscript_job_trains_from_s3_shards_through_a_kill_and_a_join_with_an_empty_disk) {
  NEED_RGW();
  temp_dir d;
  if (auto e = testing::write_torchscript_fixtures(d.path() + "/fx", DTACTOR_SOURCE_DIR); !e.empty()) SKIP_OR_FAIL_IN_CI(e);
  std::ifstream in(d.path() + "/fx/tokens.bin", std::ios::binary);
  const std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_EQ(all.size(), 40000u);
  ASSERT_TRUE(s3_create_bucket(opts("tokens")));
  auto store = open_ok(opts("tokens", "corpus"));
  ASSERT_TRUE(store);
  for (size_t k = 0; k < 10; ++k) ASSERT_TRUE(store->put(s3_shards::name(k), all.substr(k * 4000, 4000)));
  ASSERT_TRUE(write_shard_index("s3://tokens/corpus/train-*.bin", rgw::endpoint));

  const uint64_t cache_bytes = 5 * 4000;  // (1 + 1 read-ahead block) x 2 shards, and one more
  testing::cluster c(d.path(), testing::set_flags({"model.name=torchscript", "model.file=" + d.path() + "/fx/bigram.pt",
                                                   "data.train_tokens=s3://tokens/corpus/train-*.bin", "data.s3_endpoint=" + rgw::endpoint,
                                                   "model.context=16", "model.vocab_size=64", "data.val_fraction=0.1",
                                                   "data.shuffle_block_shards=2", "data.read_ahead_blocks=1",
                                                   "data.cache_bytes=" + std::to_string(cache_bytes), "train.global_batch_size=32",
                                                   "train.max_steps=90", "train.lr=0.05", "train.warmup_steps=10", "train.log_every_steps=5",
                                                   "eval.every_steps=0", "checkpoint.every_steps=30", "cluster.min_nodes=2",
                                                   "cluster.floor_nodes=2", "train.threads=1"}));
  for (const std::string id : {"a", "b", "c"}) {
    std::filesystem::create_directories(d.path() + "/tmp-" + id);
    c.node_prefix[id] = {"/usr/bin/env", "TMPDIR=" + d.path() + "/tmp-" + id};
  }
  // b dies (node and rank, as a spot machine) right after step 20: at
  // this model's pace the job would end before a kill the test sends once
  // it sees step 20 on a loaded machine.
  ASSERT_EQ(c.start_coordinator(), "");
  ASSERT_EQ(c.start_node("a"), "");
  ASSERT_EQ(c.start_node("b", {"--fail-at-step", "20", "--fail-mode", "crash"}), "");
  ASSERT_TRUE(c.wait_for([](const std::vector<testing::json>& j) { return !testing::journal_events<ev::job_waiting>(j).empty(); }, 180))
      << c.logs();
  ASSERT_EQ(c.start_node("c"), "");
  ASSERT_TRUE(c.coord->wait(240000)) << c.logs();
  auto j = c.journal();
  auto fin = testing::journal_events<ev::job_finished>(j);
  ASSERT_EQ(fin.size(), 1u) << c.logs();
  EXPECT_EQ(fin[0].at("step"), 90);
  EXPECT_EQ(fin[0].at("world_size"), 2);
  EXPECT_GT(fin[0].at("accuracy").get<double>(), 0.9) << fin[0].dump();
  for (const auto& r : testing::journal_events<ev::recovery_done>(j)) EXPECT_EQ(r.at("lost_steps"), 0) << r.dump();
  // The joiner fetched what it read into its own, empty, cache, and
  // verified it against the index; no shard failed anywhere.
  auto res = testing::journal_events<ev::resources>(j);
  ASSERT_FALSE(res.empty());
  bool joiner_read = false;
  for (const auto& row : res.back().at("ranks")) {
    ASSERT_TRUE(row.contains("data_bytes_s3")) << row.dump();
    EXPECT_EQ(row.at("data_shards_failed"), 0) << row.dump();
    EXPECT_LE(row.at("data_cache_peak_bytes").get<uint64_t>(), cache_bytes) << row.dump();
    if (row.at("node") == "c") {
      joiner_read = row.at("data_bytes_s3").get<uint64_t>() > 0 && row.at("data_shards_verified").get<uint64_t>() > 0;
    }
  }
  EXPECT_TRUE(joiner_read) << res.back().dump();
  // The log book shows the reading.
  auto rep = child_process::spawn({DTACTOR_BINARY, "report", d.path()}, false, d.path() + "/report.log");
  ASSERT_TRUE(rep);
  auto rep_end = rep->wait(60000);
  ASSERT_TRUE(rep_end && rep_end->exit_code == 0) << c.logs();
  std::ifstream report_in(d.path() + "/report.md");
  const std::string report((std::istreambuf_iterator<char>(report_in)), std::istreambuf_iterator<char>());
  EXPECT_NE(report.find("## Data\n"), std::string::npos) << report;
  EXPECT_NE(report.find("| c | 1 |"), std::string::npos) << report;
  for (const std::string id : {"a", "c"}) {
    const std::string dir = d.path() + "/tmp-" + id + "/dtactor-data-cache";
    ASSERT_TRUE(std::filesystem::exists(dir)) << dir;
    EXPECT_LE(cache_dir_bytes(dir), cache_bytes) << dir;
  }
}

// A shard that turns out bad during training (here: ids outside the
// vocabulary in a shard first read mid-epoch) is a data problem no new
// generation can fix: the rank reports it as such and the job ends with the
// rank's one line naming the shard, exit non-zero, no retrying forever.
TEST(data_shards_s3, a_bad_shard_met_in_training_ends_the_job_with_one_line_naming_it) {
  temp_dir d;
  if (auto e = testing::write_torchscript_fixtures(d.path() + "/fx", DTACTOR_SOURCE_DIR); !e.empty()) SKIP_OR_FAIL_IN_CI(e);
  std::ifstream in(d.path() + "/fx/tokens.bin", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_EQ(all.size(), 40000u);
  std::filesystem::create_directories(d.path() + "/data");
  for (int k = 0; k < 8; ++k) {
    std::string shard = all.substr(static_cast<size_t>(k) * 5000, 5000);
    if (k == 5) shard[2000] = 70;  // token 1000 of shard 5: id 70, outside a vocabulary of 64
    char name[32];
    std::snprintf(name, sizeof name, "/data/s-%d.bin", k);
    std::ofstream(d.path() + name, std::ios::binary) << shard;
  }
  testing::cluster c(d.path() + "/run", testing::set_flags({"model.name=torchscript", "model.file=" + d.path() + "/fx/bigram.pt",
                                                            "data.train_tokens=" + d.path() + "/data/s-*.bin", "model.context=16",
                                                            "model.vocab_size=64", "data.val_fraction=0.1", "train.global_batch_size=32",
                                                            "train.max_steps=2000", "train.log_every_steps=50", "eval.every_steps=0",
                                                            "checkpoint.every_steps=0", "train.threads=1", "cluster.min_nodes=2"}));
  std::filesystem::create_directories(c.run_dir);
  ASSERT_EQ(c.start({"a", "b"}), "");
  auto end = c.coord->wait(240000);
  ASSERT_TRUE(end) << c.logs();
  EXPECT_NE(end->exit_code, 0) << c.logs();
  auto failed = testing::journal_events<ev::job_failed>(c.journal());
  ASSERT_EQ(failed.size(), 1u) << c.logs();
  const std::string reason = failed[0].at("reason");
  EXPECT_NE(reason.find("shard " + d.path() + "/data/s-5.bin: token id 70 at position 1000"), std::string::npos) << reason;
  EXPECT_EQ(reason.find('\n'), std::string::npos) << reason;
  EXPECT_LT(failed[0].at("step").get<int64_t>(), 2000);
}

// The built-in ViT on image tar shards in S3 (docs/data.md "Tar shards"):
// Fashion-MNIST written as PNG tar shards by examples/shards/make_tar_shards.py,
// put in a bucket, indexed there (sample counts and digests), and trained by
// a coordinator and a node started by hand, the node with an empty cache.
// Without the index, a job is refused in one line before it trains.
TEST(data_shards_s3, the_built_in_vit_trains_from_png_tar_shards_in_s3) {
  NEED_RGW();
  temp_dir d;
  const std::string make = "/usr/bin/python3.11 " + std::string(DTACTOR_SOURCE_DIR) + "/examples/shards/make_tar_shards.py";
  if (auto e = testing::run_fixture("examples/shards/make_tar_shards.py (python3-pil, python3-numpy, dataset-fashion-mnist)",
                                    make + " --out " + d.path() + "/imgs --limit 2400 --per-shard 400");
      !e.empty())
    SKIP_OR_FAIL_IN_CI(e);
  ASSERT_TRUE(s3_create_bucket(opts("imgs")));
  auto store = open_ok(opts("imgs", "train"));
  ASSERT_TRUE(store);
  for (const auto& e : std::filesystem::directory_iterator(d.path() + "/imgs")) {
    std::ifstream in(e.path(), std::ios::binary);
    ASSERT_TRUE(store->put(e.path().filename().string(), std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>())));
  }
  const std::vector<std::string> job = {"model.name=vit", "data.train_shards=s3://imgs/train/train-*.tar", "data.s3_endpoint=" + rgw::endpoint,
                                        "data.shuffle_block_shards=2", "model.dim=16", "model.layers=1", "model.heads=2",
                                        "train.global_batch_size=32", "train.max_steps=120", "train.warmup_steps=5", "train.lr=0.003",
                                        "train.log_every_steps=10", "eval.every_steps=0", "eval.max_samples=400", "checkpoint.every_steps=0",
                                        "train.threads=1", "cluster.min_nodes=1"};
  {
    // The node cannot build its rank: the coordinator refuses it, and the
    // node ends with that one line (the coordinator goes on waiting for nodes).
    testing::cluster c(d.path() + "/unindexed", testing::set_flags(job));
    std::filesystem::create_directories(c.run_dir);
    ASSERT_EQ(c.start({"a"}), "");
    auto end = c.nodes.at("a").wait(240000);
    ASSERT_TRUE(end) << c.logs();
    EXPECT_NE(end->exit_code, 0) << c.logs();
    std::ifstream log_in(c.run_dir + "/node-a.log");
    const std::string log((std::istreambuf_iterator<char>(log_in)), std::istreambuf_iterator<char>());
    EXPECT_NE(log.find("dtactor: refused by the coordinator: node 'a' cannot start rank 0: data.train_shards: shard s3://imgs/train/train-000000.tar "
                       "has no sample count: run `dtactor data index 's3://imgs/train/train-*.tar'`"),
              std::string::npos)
        << c.logs();
  }
  ASSERT_TRUE(write_shard_index("s3://imgs/train/train-*.tar", rgw::endpoint));
  testing::cluster c(d.path() + "/run", testing::set_flags(job));
  std::filesystem::create_directories(c.run_dir);
  std::filesystem::create_directories(d.path() + "/tmp-a");
  c.node_prefix["a"] = {"/usr/bin/env", "TMPDIR=" + d.path() + "/tmp-a"};
  ASSERT_EQ(c.start({"a"}), "");
  auto end = c.coord->wait(240000);
  ASSERT_TRUE(end && end->exit_code == 0) << c.logs();
  auto j = c.journal();
  auto fin = testing::journal_events<ev::job_finished>(j);
  ASSERT_EQ(fin.size(), 1u) << c.logs();
  EXPECT_GT(fin[0].at("accuracy").get<double>(), 0.3) << "10 classes: chance is 0.1; " << fin[0].dump();
  auto res = testing::journal_events<ev::resources>(j);
  ASSERT_FALSE(res.empty());
  const auto& row = res.back().at("ranks").at(0);
  EXPECT_GT(row.at("data_bytes_s3").get<uint64_t>(), 0u) << row.dump();
  EXPECT_GT(row.at("data_shards_verified").get<uint64_t>(), 0u) << row.dump();
  EXPECT_EQ(row.at("data_shards_failed"), 0) << row.dump();
}

}  // namespace
}  // namespace dtactor

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  // The shard functions take credentials from the environment, as dtactor does.
  ::setenv("AWS_ACCESS_KEY_ID", dtactor::testing::kAccess.c_str(), 1);
  ::setenv("AWS_SECRET_ACCESS_KEY", dtactor::testing::kSecret.c_str(), 1);
  ::testing::AddGlobalTestEnvironment(new dtactor::testing::rgw);
  return dtactor::testing::exit_status_with_skips(RUN_ALL_TESTS());
}
