#include "storage/checkpoint_store.hpp"

#include <gtest/gtest.h>

#include "checkpoint_store_test_util.hpp"

namespace dtactor {
namespace {

using namespace checkpoint_test;
namespace fs = std::filesystem;

TEST(checkpoint_store, parts_written_by_any_number_of_ranks_read_back_as_one_stream) {
  temp_dir dir;
  auto store = open_store(dir.path());
  for (int world : {1, 2, 3, 7}) {
    const int64_t step = 10 * world;
    const std::string stream = stream_for(step, 50000 + static_cast<size_t>(world));
    commit_ok(store, meta_at(step, 1, {{"accuracy", 0.5}}), world, stream);
    auto meta = store.read_manifest(manifest_name(step));
    ASSERT_TRUE(meta.ok()) << meta.message();
    EXPECT_EQ(meta->parts_size(), world);
    EXPECT_EQ(meta->world_size(), world);
    EXPECT_EQ(meta->format_version(), checkpoint_format_version);
    EXPECT_EQ(meta->metrics().at("accuracy"), 0.5);
    EXPECT_TRUE(store.verify(meta.value(), true).ok());
    EXPECT_EQ(read_all(store, meta.value()), stream) << "world " << world;
  }
}

// A large part is written back and dropped from the page cache as it is
// written: once committed, next to none of its pages are resident, and it
// reads back whole. (In the build tree, on disk: a tmpfs keeps its pages.)
TEST(checkpoint_store, a_large_part_leaves_the_page_cache_once_written) {
  const std::string dir = (fs::current_path() / ("dtactor-cache-" + std::to_string(::getpid()))).string();
  fs::create_directories(dir);
  struct cleanup {
    std::string d;
    ~cleanup() {
      std::error_code ec;
      fs::remove_all(d, ec);
    }
  } gone{dir};
  auto store = open_directory_store(dir);
  ASSERT_TRUE(store) << store.message();
  const uint64_t size = 96ull << 20;
  std::string bytes(size, '\0');
  std::mt19937_64 rng(7);
  for (uint64_t i = 0; i + 8 <= size; i += 8) {
    const uint64_t v = rng();
    std::memcpy(bytes.data() + i, &v, 8);
  }
  const std::string name = part_name(1, 1, 0, 1);
  auto part = write_part(*store.value(), name, 0, bytes.data(), size);
  ASSERT_TRUE(part) << part.message();
  const int fd = ::open((dir + "/" + name).c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  ASSERT_NE(map, MAP_FAILED);
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE)), pages = (size + page - 1) / page;
  std::vector<unsigned char> resident(pages);
  ASSERT_EQ(::mincore(map, size, resident.data()), 0) << std::strerror(errno);
  ::munmap(map, size);
  size_t in_cache = 0;
  for (unsigned char r : resident) in_cache += r & 1;
  EXPECT_LT(in_cache, pages / 10) << in_cache << " of " << pages << " pages still in the page cache";
  std::string back(size, '\0');
  auto n = store.value()->read(name, 0, back.data(), size);
  ASSERT_TRUE(n) << n.message();
  EXPECT_EQ(n.value(), size);
  EXPECT_TRUE(back == bytes);
}

TEST(checkpoint_store, part_ranges_cover_the_stream_exactly_and_are_aligned) {
  for (uint64_t n : {0ull, 1ull, 4095ull, 4096ull, 10000ull, 123456789ull})
    for (int world : {1, 2, 3, 5, 16}) {
      uint64_t at = 0;
      for (int r = 0; r < world; ++r) {
        auto [a, b] = part_range(n, r, world);
        EXPECT_EQ(a, at) << n << " " << world << " " << r;
        EXPECT_LE(a, b);
        if (r < world - 1 && b < n) {
          EXPECT_EQ((b - a) % 4096, 0u);
        }
        at = b;
      }
      EXPECT_EQ(at, n);
    }
  // Balanced: no part more than one alignment unit above an even share.
  auto [a, b] = part_range(100ull << 20, 0, 3);
  EXPECT_LE(b - a, (100ull << 20) / 3 + 4096);
}

TEST(checkpoint_store, names_are_as_documented) {
  EXPECT_EQ(manifest_name(1200), "ckpt-000001200.manifest");
  EXPECT_EQ(part_name(1200, 7, 0, 2), "ckpt-000001200.g7.r0-of-2.part");
  EXPECT_EQ(part_name(1200, 7, 0, 2, 0), "ckpt-000001200.g7.r0-of-2.part") << "a rank's first range keeps the old name";
  EXPECT_EQ(part_name(1200, 7, 0, 2, 1), "ckpt-000001200.g7.r0-of-2.1.part");
  EXPECT_EQ(part_name(1200, 7, 1, 2, 12), "ckpt-000001200.g7.r1-of-2.12.part");
}

// ZeRO: ranks own scattered ranges, each a part of its own (the k-th, k > 0,
// named with ".<k>"). Rank r of 2 writes quarters r and r + 2 of the stream.
pb::checkpoint_meta write_scattered_parts(checkpoint_store& store, pb::checkpoint_meta meta, const std::string& stream) {
  meta.set_state_bytes(stream.size());
  meta.set_world_size(2);
  auto* t = meta.add_tensors();
  t->set_name("blob");
  t->set_dtype("uint8");
  t->add_shape(static_cast<int64_t>(stream.size()));
  t->set_offset(0);
  t->set_size(stream.size());
  const uint64_t q = stream.size() / 4;
  for (int quarter = 0; quarter < 4; ++quarter) {
    const uint64_t a = q * static_cast<uint64_t>(quarter), b = quarter == 3 ? stream.size() : a + q;
    auto part = write_part(store.objects(), part_name(meta.step(), meta.generation(), quarter % 2, 2, quarter / 2), a, stream.data() + a, b - a);
    EXPECT_TRUE(part.ok()) << part.message();
    if (part.ok()) *meta.add_parts() = part.value();
  }
  return meta;
}

TEST(checkpoint_store, parts_of_several_ranges_per_rank_are_committed_read_rotated_and_swept) {
  temp_dir dir;
  auto store = open_store(dir.path(), {1, false, "", true});
  auto m10 = write_scattered_parts(store, meta_at(10), stream_for(10));
  ASSERT_EQ(m10.parts_size(), 4);
  EXPECT_EQ(m10.parts(2).name(), "ckpt-000000010.g1.r0-of-2.1.part");
  auto done = store.commit(m10);
  ASSERT_TRUE(done.ok()) << done.message();
  auto meta = newest(store);
  ASSERT_TRUE(meta);
  EXPECT_EQ(read_all(store, *meta), stream_for(10));

  // Never committed: step 12 of generation 1 (a rank's second ranges too),
  // an in-flight write of one, and step 30 that may still be written.
  write_scattered_parts(store, meta_at(12), stream_for(12));
  const std::string dead = part_name(12, 1, 1, 2, 1) + ".tmp.999999999.0";
  const std::string newer = part_name(30, 2, 1, 2, 1) + ".tmp.999999997.1";
  spit(dir / dead, "half");
  spit(dir / newer, "half");
  write_scattered_parts(store, meta_at(30, 2), stream_for(30));
  // Not a name part_name writes: never taken for a part.
  const std::vector<std::string> strangers{"ckpt-000000012.g1.r0-of-2.0.part", "ckpt-000000012.g1.r0-of-2.01.part",
                                           "ckpt-000000012.g1.r0-of-2.x.part", "ckpt-000000012.g1.r0-of-2..part"};
  for (const auto& n : strangers) spit(dir / n, "x");

  // The next commit (keep_last 1) rotates step 10 away, all four parts of
  // it, and sweeps step 12's leftovers; step 30's stay.
  ASSERT_TRUE(store.commit(write_scattered_parts(store, meta_at(20, 2), stream_for(20))).ok());
  auto names = file_names(dir.path());
  for (int quarter = 0; quarter < 4; ++quarter) {
    const int rank = quarter % 2, index = quarter / 2;
    EXPECT_EQ(names.count(part_name(10, 1, rank, 2, index)), 0u) << "rotated: " << part_name(10, 1, rank, 2, index);
    EXPECT_EQ(names.count(part_name(12, 1, rank, 2, index)), 0u) << "an orphan: " << part_name(12, 1, rank, 2, index);
    EXPECT_EQ(names.count(part_name(20, 2, rank, 2, index)), 1u) << "committed: " << part_name(20, 2, rank, 2, index);
    EXPECT_EQ(names.count(part_name(30, 2, rank, 2, index)), 1u) << "may be in flight: " << part_name(30, 2, rank, 2, index);
  }
  EXPECT_EQ(names.count(dead), 0u) << "a write of an older generation";
  EXPECT_EQ(names.count(newer), 1u) << "a newer step's write may be in flight";
  for (const auto& n : strangers) EXPECT_EQ(names.count(n), 1u) << n;

  // A coordinator starting over the directory sweeps the same way.
  write_scattered_parts(store, meta_at(15, 2), stream_for(15));
  auto reopened = open_store(dir.path(), {1, false, "", true});
  names = file_names(dir.path());
  EXPECT_EQ(names.count(part_name(15, 2, 0, 2, 1)), 0u);
  EXPECT_EQ(names.count(part_name(15, 2, 1, 2, 1)), 0u);
  EXPECT_EQ(names.count(part_name(30, 2, 0, 2, 1)), 1u);
  EXPECT_EQ(newest(reopened)->step(), 20);
}

TEST(checkpoint_store, no_manifest_no_checkpoint_and_orphans_are_swept) {
  temp_dir dir;
  auto store = open_store(dir.path());
  commit_ok(store, meta_at(10));
  // A generation that stored its parts of step 20 but never committed (a
  // node died), and one still writing step 30.
  write_parts(store, meta_at(20), stream_for(20), 2);
  EXPECT_EQ(newest(store)->step(), 10);
  EXPECT_EQ(store.list().size(), 1u);
  commit_ok(store, meta_at(25, 2));  // newer generation: the old generation's step 20 parts go
  write_parts(store, meta_at(30, 2), stream_for(30), 2);
  auto names = file_names(dir.path());
  EXPECT_EQ(names.count(part_name(20, 1, 0, 2)), 0u);
  EXPECT_EQ(names.count(part_name(30, 2, 0, 2)), 1u) << "a newer step's parts may be in flight";
  // A coordinator starting over the directory: parts no newer than its
  // newest checkpoint that no manifest references are leftovers.
  write_parts(store, meta_at(22, 2), stream_for(22), 2);
  auto reopened = open_store(dir.path());
  names = file_names(dir.path());
  EXPECT_EQ(names.count(part_name(22, 2, 0, 2)), 0u);
  EXPECT_EQ(names.count(part_name(30, 2, 1, 2)), 1u);
  EXPECT_EQ(names.count(part_name(25, 2, 1, 2)), 1u);
}

TEST(checkpoint_store, rotation_keeps_last_k_and_best_and_removes_their_parts) {
  temp_dir dir;
  auto store = open_store(dir.path(), {2, true, "accuracy", true});
  const std::vector<double> acc = {0.5, 0.9, 0.6, 0.7, 0.4};
  for (size_t i = 0; i < acc.size(); ++i) commit_ok(store, meta_at(static_cast<int64_t>(i + 1), 1, {{"accuracy", acc[i]}}));
  std::vector<int64_t> steps;
  for (const auto& e : store.list()) steps.push_back(e.step);
  EXPECT_EQ(steps, (std::vector<int64_t>{2, 4, 5}));
  auto names = file_names(dir.path());
  EXPECT_EQ(names.size(), 3u * 3u) << "a manifest and two parts each";
  EXPECT_EQ(names.count(part_name(1, 1, 0, 2)), 0u);

  temp_dir lower;
  auto lstore = open_store(lower.path(), {1, true, "val_loss", false});
  for (int64_t s = 1; s <= 3; ++s) commit_ok(lstore, meta_at(s, 1, {{"val_loss", s == 2 ? 0.1 : 1.0}}));
  steps.clear();
  for (const auto& e : lstore.list()) steps.push_back(e.step);
  EXPECT_EQ(steps, (std::vector<int64_t>{2, 3}));

  temp_dir plain;
  auto pstore = open_store(plain.path(), {1, false, "accuracy", true});
  for (int64_t s = 1; s <= 3; ++s) commit_ok(pstore, meta_at(s, 1, {{"accuracy", 1.0 / static_cast<double>(s)}}));
  ASSERT_EQ(pstore.list().size(), 1u);
  EXPECT_EQ(pstore.list()[0].step, 3);
}

TEST(checkpoint_store, commit_refuses_missing_or_short_parts_and_commits_nothing) {
  temp_dir dir;
  auto store = open_store(dir.path());
  commit_ok(store, meta_at(1));
  auto m = write_parts(store, meta_at(2), stream_for(2), 2);
  ASSERT_TRUE(store.objects().remove(m.parts(1).name()));
  auto missing = store.commit(m);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.message(), "checkpoint not saved: part '" + part_name(2, 1, 1, 2) + "' is missing in " + store.location() +
                                   " (every node and the coordinator must reach the same checkpoint store: a shared directory or s3://)");
  m = write_parts(store, meta_at(3), stream_for(3), 2);
  spit(dir / m.parts(0).name(), "short");
  auto short_part = store.commit(m);
  ASSERT_FALSE(short_part.ok());
  EXPECT_NE(short_part.message().find("is 5 bytes, the manifest says"), std::string::npos) << short_part.message();
  EXPECT_EQ(store.list().size(), 1u);
  EXPECT_EQ(newest(store)->step(), 1);
}

TEST(checkpoint_store, a_corrupt_or_truncated_part_is_skipped_reported_and_kept) {
  temp_dir dir;
  auto store = open_store(dir.path(), {5, false, "", true});
  commit_ok(store, meta_at(1));
  commit_ok(store, meta_at(2));
  commit_ok(store, meta_at(3));
  // Step 3: a flipped byte in the second part; step 2: the first part cut short.
  std::string bytes = slurp(dir / part_name(3, 1, 1, 2));
  bytes[bytes.size() / 2] ^= 0x20;
  spit(dir / part_name(3, 1, 1, 2), bytes);
  bytes = slurp(dir / part_name(2, 1, 0, 2));
  spit(dir / part_name(2, 1, 0, 2), bytes.substr(0, 100));
  std::vector<std::string> skipped;
  auto n = newest(store, &skipped);
  ASSERT_TRUE(n.has_value());
  EXPECT_EQ(n->step(), 1);
  ASSERT_EQ(skipped.size(), 2u);
  EXPECT_EQ(skipped[0], store.location() + "/" + manifest_name(3) + ": checksum mismatch in part '" + part_name(3, 1, 1, 2) + "'");
  EXPECT_EQ(skipped[1], store.location() + "/" + manifest_name(2) + ": part '" + part_name(2, 1, 0, 2) + "' is 100 bytes, the manifest says " +
                            std::to_string(part_range(10000, 0, 2).second));
  EXPECT_EQ(store.list().size(), 3u) << "nothing is deleted for being corrupt";
  // Without checksums (a commit's cheap check) the flipped byte is not seen;
  // reading the stream sees it.
  auto m3 = store.read_manifest(manifest_name(3));
  ASSERT_TRUE(m3.ok());
  EXPECT_TRUE(store.verify(m3.value(), false).ok());
  status st;
  read_all(store, m3.value(), &st);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.message(), "checksum mismatch in part '" + part_name(3, 1, 1, 2) + "'");
}

// A store that cannot be reached (a network mount gone, S3 down) while it
// is `down`: every read fails, and nobody can tell what is there.
class unreachable_store : public object_store {
 public:
  explicit unreachable_store(std::unique_ptr<object_store> inner) : inner_(std::move(inner)) {}
  bool down = false;
  const std::string& location() const override { return inner_->location(); }
  result<std::unique_ptr<object_writer>> create(const std::string& name) override { return inner_->create(name); }
  result<uint64_t> read(const std::string& name, uint64_t offset, void* dst, uint64_t size) override {
    if (down) return make_error("cannot read '" + name + "': Input/output error");
    return inner_->read(name, offset, dst, size);
  }
  result<std::optional<uint64_t>> size_of(const std::string& name) override {
    if (down) return make_error("cannot stat '" + name + "': Input/output error");
    return inner_->size_of(name);
  }
  result<std::vector<object_info>> list() override { return inner_->list(); }
  status remove(const std::string& name) override { return inner_->remove(name); }
  void sweep_stale_writes(const std::function<bool(const std::string&)>& stale) override { inner_->sweep_stale_writes(stale); }

 private:
  std::unique_ptr<object_store> inner_;
};

// A checkpoint's own bytes at fault (a checksum, a part missing or cut
// short, a manifest gone or undecodable) carry errc::corrupt_checkpoint: a
// rank refuses such a checkpoint for good. A store that cannot be reached
// is not the checkpoint's fault: no code, a new generation may get through.
TEST(checkpoint_store, errors_of_a_checkpoints_own_bytes_carry_their_code_and_those_of_the_store_do_not) {
  temp_dir dir;
  auto store = open_store(dir.path(), {5, false, "", true});
  for (int64_t s = 1; s <= 3; ++s) commit_ok(store, meta_at(s));
  auto m3 = store.read_manifest(manifest_name(3));
  ASSERT_TRUE(m3.ok());
  status st;
  std::string bytes = slurp(dir / part_name(3, 1, 1, 2));
  bytes[bytes.size() / 2] ^= 0x20;
  spit(dir / part_name(3, 1, 1, 2), bytes);
  read_all(store, m3.value(), &st);
  EXPECT_EQ(st.code(), errc::corrupt_checkpoint) << st.message();
  spit(dir / part_name(3, 1, 0, 2), "short");
  read_all(store, m3.value(), &st);
  EXPECT_NE(st.message().find("is truncated"), std::string::npos) << st.message();
  EXPECT_EQ(st.code(), errc::corrupt_checkpoint);
  EXPECT_EQ(store.verify(m3.value(), false).code(), errc::corrupt_checkpoint);
  ASSERT_TRUE(store.objects().remove(part_name(3, 1, 0, 2)));
  read_all(store, m3.value(), &st);
  EXPECT_EQ(st.message(), "part '" + part_name(3, 1, 0, 2) + "' is missing");
  EXPECT_EQ(st.code(), errc::corrupt_checkpoint);
  EXPECT_EQ(store.verify(m3.value(), false).code(), errc::corrupt_checkpoint);
  spit(dir / manifest_name(2), "garbage!garbage!");
  EXPECT_EQ(store.read_manifest(manifest_name(2)).code(), errc::corrupt_checkpoint);
  ASSERT_TRUE(store.objects().remove(manifest_name(2)));
  EXPECT_EQ(store.read_manifest(manifest_name(2)).code(), errc::corrupt_checkpoint);

  auto inner = open_directory_store(dir.path());
  ASSERT_TRUE(inner.ok()) << inner.message();
  auto flaky = std::make_shared<unreachable_store>(std::move(inner.value()));
  auto over = checkpoint_store::over(flaky, {5, false, "", true});
  auto m1 = over.read_manifest(manifest_name(1));
  ASSERT_TRUE(m1.ok()) << m1.message();
  flaky->down = true;
  auto gone = over.read_manifest(manifest_name(1));
  ASSERT_FALSE(gone.ok());
  EXPECT_EQ(gone.code(), errc::unspecified) << gone.message();
  read_all(over, m1.value(), &st);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), errc::unspecified) << st.message();
  EXPECT_EQ(over.verify(m1.value(), false).code(), errc::unspecified);
}

// A rank picking the newest checkpoint itself (shards lost with their
// holders) passes over those a rank of the job refused.
TEST(checkpoint_store, newest_valid_passes_over_excluded_steps_and_a_commit_says_what_rotation_kept) {
  temp_dir dir;
  auto store = open_store(dir.path(), {2, false, "", true});
  commit_ok(store, meta_at(1));
  commit_ok(store, meta_at(2));
  auto m = write_parts(store, meta_at(3), stream_for(3), 2);
  auto done = store.commit(m);
  ASSERT_TRUE(done.ok()) << done.message();
  EXPECT_EQ(done->kept, (std::vector<int64_t>{2, 3}));
  auto n = store.newest_valid({}, true, {3});
  ASSERT_TRUE(n.ok() && n->has_value());
  EXPECT_EQ((*n)->step(), 2);
  auto none = store.newest_valid({}, true, {2, 3});
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
}

TEST(checkpoint_store, bad_manifests_give_one_clear_reason) {
  temp_dir dir;
  auto store = open_store(dir.path());
  commit_ok(store, meta_at(4));
  const std::string good = slurp(dir / manifest_name(4));
  EXPECT_EQ(good.substr(0, 8), "DTACMAN2");
  auto reason = [&](const std::string& bytes) {
    spit(dir / manifest_name(4), bytes);
    auto m = store.read_manifest(manifest_name(4));
    EXPECT_FALSE(m.ok());
    return m.ok() ? std::string() : m.message();
  };
  std::string flipped = good;
  flipped[20] ^= 1;
  EXPECT_EQ(reason(flipped), "manifest checksum mismatch");
  EXPECT_EQ(reason("garbage!garbage!"), "not a dtactor checkpoint manifest (bad magic)");
  EXPECT_EQ(reason(""), "not a dtactor checkpoint manifest (bad magic)");
  EXPECT_NE(reason(good.substr(0, good.size() - 3)).find("manifest truncated"), std::string::npos);
  EXPECT_NE(reason(good + "x").find("trailing data"), std::string::npos);
  EXPECT_NE(reason("DTACKPT1" + std::string(40, '\0')).find("old single-file format"), std::string::npos);
  // A manifest under another step's name.
  spit(dir / manifest_name(4), good);
  spit(dir / manifest_name(5), good);
  auto renamed = store.read_manifest(manifest_name(5));
  ASSERT_FALSE(renamed.ok());
  EXPECT_EQ(renamed.message(), "name says step 5 but the manifest says step 4");
  // Random bytes never crash the reader.
  std::mt19937 rng(7);
  for (int i = 0; i < 2000; ++i) {
    std::string b = good;
    for (int k = 0; k < 3; ++k) b[rng() % b.size()] = static_cast<char>(rng());
    if (rng() % 4 == 0) b.resize(rng() % b.size());
    spit(dir / manifest_name(6), b);
    (void)store.read_manifest(manifest_name(6));
  }
}

TEST(checkpoint_store, manifest_structure_is_checked) {
  auto base = [] {
    pb::checkpoint_meta m = meta_at(1);
    m.set_format_version(checkpoint_format_version);
    m.set_state_bytes(100);
    auto* p = m.add_parts();
    p->set_name("a");
    p->set_size(60);
    p = m.add_parts();
    p->set_name("b");
    p->set_offset(60);
    p->set_size(40);
    auto* t = m.add_tensors();
    t->set_name("w");
    t->set_dtype("float32");
    t->add_shape(5);
    t->add_shape(5);
    t->set_size(100);
    return m;
  };
  EXPECT_TRUE(check_manifest(base()).ok());
  auto m = base();
  m.mutable_parts(1)->set_offset(61);
  EXPECT_EQ(check_manifest(m).message(), "part 'b' starts at byte 61, expected 60");
  m = base();
  m.set_state_bytes(101);
  EXPECT_EQ(check_manifest(m).message(), "parts cover 100 bytes of a 101-byte state");
  m = base();
  m.mutable_tensors(0)->set_dtype("complex32");
  EXPECT_EQ(check_manifest(m).message(), "tensor 'w' has unknown dtype 'complex32'");
  m = base();
  m.mutable_tensors(0)->set_shape(1, 6);
  EXPECT_EQ(check_manifest(m).message(), "tensor 'w' is 100 bytes, its shape and dtype say otherwise");
  m = base();
  m.mutable_tensors(0)->set_offset(4);
  EXPECT_EQ(check_manifest(m).message(), "tensor 'w' lies outside the state");
  m = base();
  m.mutable_parts(0)->set_name("../x");
  EXPECT_EQ(check_manifest(m).message(), "a part has a bad name '../x'");
  m = base();
  m.set_format_version(1);
  EXPECT_EQ(check_manifest(m).message(), "unsupported checkpoint format version 1 (this build reads 2)");
}

TEST(checkpoint_store, generation_fencing_refuses_an_older_generation) {
  temp_dir dir;
  auto store = open_store(dir.path());
  commit_ok(store, meta_at(10, 5));
  auto zombie = store.commit(write_parts(store, meta_at(11, 3), stream_for(11), 2));
  ASSERT_FALSE(zombie.ok());
  EXPECT_EQ(zombie.message(), "refusing checkpoint from generation 3: generation 5 already committed here");
  auto zombie_same_step = store.commit(write_parts(store, meta_at(10, 4), stream_for(99), 2));
  ASSERT_FALSE(zombie_same_step.ok());
  EXPECT_EQ(newest(store)->generation(), 5u);
  EXPECT_EQ(read_all(store, *newest(store)), stream_for(10));
  commit_ok(store, meta_at(12, 5));
  commit_ok(store, meta_at(13, 6));
  EXPECT_EQ(store.newest_generation(), 6u);
  // Another store (a restarted coordinator) sees the same fence.
  auto other = open_store(dir.path());
  EXPECT_FALSE(other.commit(write_parts(other, meta_at(14, 5), stream_for(14), 1)).ok());
}

TEST(checkpoint_store, old_single_file_checkpoints_are_reported_not_passed_over_silently) {
  temp_dir dir;
  spit(dir / "ckpt-000000100.dtc", "DTACKPT1 whatever");
  auto store = open_store(dir.path());
  std::vector<std::string> skipped;
  EXPECT_FALSE(newest(store, &skipped).has_value());
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_EQ(skipped[0], dir / "ckpt-000000100.dtc" + ": a checkpoint of the old single-file format (before format 2), which this dtactor does not read");
}

TEST(checkpoint_store, empty_directory_has_no_checkpoint) {
  temp_dir dir;
  auto store = open_store(dir.path());
  EXPECT_FALSE(newest(store).has_value());
  EXPECT_TRUE(store.list().empty());
  EXPECT_EQ(store.newest_generation(), 0u);
}

TEST(checkpoint_store, unwritable_directory_is_a_clear_error) {
  temp_dir dir;
  spit(dir / "plain-file", "x");

  auto under_file = checkpoint_store::open(dir / "plain-file/ckpts", {});
  ASSERT_FALSE(under_file.ok());
  EXPECT_EQ(under_file.message(), "checkpoint directory '" + (dir / "plain-file/ckpts") +
                                      "' is not writable: Not a directory (set checkpoint.dir to a writable directory)");

  auto file_as_dir = checkpoint_store::open(dir / "plain-file", {});
  ASSERT_FALSE(file_as_dir.ok());
  EXPECT_NE(file_as_dir.message().find("is not writable: it exists and is not a directory"), std::string::npos)
      << file_as_dir.message();

  auto dev_null = checkpoint_store::open("/dev/null/x", {});
  ASSERT_FALSE(dev_null.ok());
  EXPECT_NE(dev_null.message().find("checkpoint directory '/dev/null/x' is not writable"), std::string::npos)
      << dev_null.message();

  // Permission bits stop everyone but root (tests often run as root).
  const std::string locked = dir / "locked";
  fs::create_directory(locked);
  ::chmod(locked.c_str(), 0500);
  auto read_only = checkpoint_store::open(locked, {});
  if (::geteuid() != 0) {
    ASSERT_FALSE(read_only.ok());
    EXPECT_EQ(read_only.message(), "checkpoint directory '" + locked +
                                       "' is not writable: Permission denied (set checkpoint.dir to a writable directory)");
  }
  EXPECT_TRUE(file_names(locked).empty()) << "the probe file is removed";
}

TEST(checkpoint_store, keep_last_below_one_is_refused) {
  temp_dir dir;
  auto store = checkpoint_store::open(dir.path(), {0, true, "", true});
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.message(), "checkpoint.keep_last must be at least 1 (got 0)");
}

}  // namespace
}  // namespace dtactor
