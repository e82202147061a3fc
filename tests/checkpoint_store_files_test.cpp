// The checkpoint store's files: failed writes, temp files of dead writers,
// eval and export targets, atomic writes, shipped files and the planner of
// scattered parts.
#include "storage/checkpoint_store.hpp"

#include <gtest/gtest.h>

#include "checkpoint_store_test_util.hpp"

namespace dtactor {
namespace {

using namespace checkpoint_test;
namespace fs = std::filesystem;

// Writes half of what it is asked to, then reports a full disk; or fails
// fsync / rename with EIO.
class faulty_env : public fs_env {
 public:
  enum class fault { disk_full, sync_fails, rename_fails };
  explicit faulty_env(fault f) : fault_(f) {}
  int write_all(int fd, const char* data, size_t size) override {
    if (fault_ != fault::disk_full) return fs_env::write_all(fd, data, size);
    fs_env::write_all(fd, data, size / 2);
    return ENOSPC;
  }
  int sync(int fd) override { return fault_ == fault::sync_fails ? EIO : fs_env::sync(fd); }
  int rename(const std::string& from, const std::string& to) override {
    return fault_ == fault::rename_fails ? EIO : fs_env::rename(from, to);
  }

 private:
  fault fault_;
};

TEST(checkpoint_store, a_failed_part_write_leaves_no_temp_file_and_the_old_checkpoint_whole) {
  temp_dir dir;
  auto store = open_store(dir.path());
  commit_ok(store, meta_at(1));
  const auto before = file_names(dir.path());
  const std::vector<std::pair<faulty_env::fault, std::string>> cases = {
      {faulty_env::fault::disk_full, "No space left on device"},
      {faulty_env::fault::sync_fails, "Input/output error"},
      {faulty_env::fault::rename_fails, "Input/output error"}};
  for (const auto& [fault, reason] : cases) {
    faulty_env env(fault);
    auto faulty = open_store(dir.path(), {}, env);
    const std::string data(20000, 'n');
    auto part = write_part(faulty.objects(), part_name(2, 1, 0, 1), 0, data.data(), data.size());
    ASSERT_FALSE(part.ok());
    EXPECT_NE(part.message().find(dir / part_name(2, 1, 0, 1)), std::string::npos) << part.message();
    EXPECT_NE(part.message().find(reason), std::string::npos) << part.message();
    EXPECT_EQ(file_names(dir.path()), before);
    // A manifest that cannot be written commits nothing either.
    auto m = write_parts(store, meta_at(3), stream_for(3), 1);
    auto done = faulty.commit(m);
    ASSERT_FALSE(done.ok());
    EXPECT_EQ(faulty.list().size(), 1u);
    ASSERT_TRUE(store.objects().remove(m.parts(0).name()));
  }
  EXPECT_EQ(read_all(store, *newest(store)), stream_for(1));
}

TEST(checkpoint_store, open_removes_temp_files_of_a_dead_writer) {
  temp_dir dir;
  spit(dir / "ckpt-000000003.g1.r0-of-2.part.tmp.999999999.0", "half");
  spit(dir / "notes.txt", "not ours");
  auto store = open_store(dir.path());
  EXPECT_EQ(file_names(dir.path()), std::set<std::string>{"notes.txt"});
}

// A rank killed mid-write leaves a temp file; a running coordinator's next
// commit sweeps it when its generation is over or its step is committed,
// and leaves writes of newer steps alone (they may be in flight).
TEST(checkpoint_store, a_commit_sweeps_temp_files_of_writes_that_are_over) {
  temp_dir dir;
  auto store = open_store(dir.path());
  const std::string dead = part_name(12, 1, 0, 2) + ".tmp.999999999.0";
  const std::string same_step = part_name(15, 2, 1, 2) + ".tmp.999999998.3";
  const std::string newer = part_name(30, 2, 1, 2) + ".tmp.999999997.1";
  spit(dir / dead, "half");
  spit(dir / same_step, "half");
  spit(dir / newer, "half");
  commit_ok(store, meta_at(15, 2));
  const auto names = file_names(dir.path());
  EXPECT_EQ(names.count(dead), 0u) << "a fenced generation's write";
  EXPECT_EQ(names.count(same_step), 0u) << "a write of a committed step";
  EXPECT_EQ(names.count(newer), 1u) << "a newer step's write may be in flight";
}

TEST(checkpoint_store, targets_of_eval_and_export) {
  temp_dir run;
  const std::string ckdir = run / "checkpoints";
  auto store = open_store(ckdir);
  commit_ok(store, meta_at(7));
  commit_ok(store, meta_at(9));
  auto by_run = open_checkpoint_target(run.path(), {});
  ASSERT_TRUE(by_run.ok()) << by_run.message();
  EXPECT_EQ(by_run->meta.step(), 9);
  auto by_dir = open_checkpoint_target(ckdir, {});
  ASSERT_TRUE(by_dir.ok()) << by_dir.message();
  EXPECT_EQ(by_dir->meta.step(), 9);
  auto by_file = open_checkpoint_target(ckdir + "/" + manifest_name(7), {});
  ASSERT_TRUE(by_file.ok()) << by_file.message();
  EXPECT_EQ(by_file->meta.step(), 7);
  EXPECT_EQ(read_all(*by_file->store, by_file->meta), stream_for(7));
  auto missing = open_checkpoint_target(run / "nope", {});
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.message(), "'" + (run / "nope") + "': no such checkpoint, checkpoint directory or run directory");
  temp_dir empty;
  auto none = open_checkpoint_target(empty.path(), {});
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.message().find("no valid checkpoint in"), std::string::npos) << none.message();
}

TEST(fs_atomic, temp_names_are_recognised) {
  EXPECT_TRUE(is_atomic_temp_name("ckpt-000000003.dtc.tmp.123.0"));
  EXPECT_FALSE(is_atomic_temp_name("ckpt-000000003.dtc"));
  EXPECT_FALSE(is_atomic_temp_name("ckpt.tmp.12x.0"));
  EXPECT_FALSE(is_atomic_temp_name(".tmp.1.2"));
}

TEST(fs_atomic, write_file_atomic_concatenates_pieces_and_replaces) {
  temp_dir dir;
  const std::string path = dir / "f";
  ASSERT_TRUE(write_file_atomic(path, {"ab", "", "cd"}).ok());
  EXPECT_EQ(slurp(path), "abcd");
  ASSERT_TRUE(write_file_atomic(path, {"x"}).ok());
  EXPECT_EQ(slurp(path), "x");
  EXPECT_EQ(file_names(dir.path()), std::set<std::string>{"f"});
  auto st = write_file_atomic(dir / "missing/f", {"x"});
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("No such file or directory"), std::string::npos) << st.message();
}

// A file the coordinator ships with a job (job/shipped_file).
TEST(shipped_file, put_once_fetched_checked_and_cached) {
  temp_dir d;
  const std::string src = d.path() + "/module.pt";
  std::string bytes(9u << 20, '\0');  // more than one 8 MiB chunk
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 7 + i / 4096);
  { std::ofstream(src, std::ios::binary) << bytes; }
  auto store = open_directory_store(d.path() + "/store");
  ASSERT_TRUE(store) << store.message();
  auto first = ship_file(*store.value(), src, "module-", ".pt");
  ASSERT_TRUE(first) << first.message();
  EXPECT_TRUE(first->uploaded);
  EXPECT_EQ(first->digest, file_digest(src).value());
  EXPECT_EQ(first->object.rfind("module-", 0), 0u);
  auto again = ship_file(*store.value(), src, "module-", ".pt");
  ASSERT_TRUE(again);
  EXPECT_FALSE(again->uploaded);  // already there
  EXPECT_EQ(again->object, first->object);

  // The preferred copy when it is the same file; else fetched into the cache.
  auto same = fetch_shipped_file(*store.value(), first->object, first->digest, src, d.path() + "/cache");
  ASSERT_TRUE(same) << same.message();
  EXPECT_EQ(same->path, src);
  EXPECT_FALSE(same->fetched);
  auto fetched = fetch_shipped_file(*store.value(), first->object, first->digest, d.path() + "/missing.pt", d.path() + "/cache");
  ASSERT_TRUE(fetched) << fetched.message();
  EXPECT_TRUE(fetched->fetched);
  EXPECT_EQ(fetched->path, d.path() + "/cache/" + first->object);
  EXPECT_EQ(file_digest(fetched->path).value(), first->digest);
  auto cached = fetch_shipped_file(*store.value(), first->object, first->digest, "", d.path() + "/cache");
  ASSERT_TRUE(cached);
  EXPECT_FALSE(cached->fetched);
  // A damaged cache copy is fetched again, never used.
  { std::ofstream(fetched->path, std::ios::binary | std::ios::in) << "XX"; }
  auto refetched = fetch_shipped_file(*store.value(), first->object, first->digest, "", d.path() + "/cache");
  ASSERT_TRUE(refetched);
  EXPECT_TRUE(refetched->fetched);
  // A damaged object in the store is an error naming it; nothing is left in the cache.
  { std::ofstream(d.path() + "/store/" + first->object, std::ios::binary | std::ios::in) << "XX"; }
  fs::remove(refetched->path);
  auto bad = fetch_shipped_file(*store.value(), first->object, first->digest, "", d.path() + "/cache");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.message().find("is not the file the coordinator shipped"), std::string::npos) << bad.message();
  EXPECT_FALSE(fs::exists(refetched->path));
  for (const auto& e : fs::directory_iterator(d.path() + "/cache")) ADD_FAILURE() << "left behind: " << e.path();
}

// The one planner: ranks' scattered ranges (ZeRO) come back in stream order
// with the generation and world size set, a manifest the store's checks
// accept; a short cover or an unreadable header is one line, no manifest.
TEST(checkpoint_store, the_planner_orders_scattered_parts_and_refuses_a_torn_cover) {
  pb::checkpoint_meta head = meta_at(3);
  head.set_format_version(checkpoint_format_version);
  head.set_state_bytes(100);
  auto part = [](const std::string& name, int rank, uint64_t off, uint64_t size) {
    pb::checkpoint_part p;
    p.set_name(name);
    p.set_rank(rank);
    p.set_offset(off);
    p.set_size(size);
    return p;
  };
  std::map<int32_t, std::vector<pb::checkpoint_part>> parts;
  parts[0] = {part("r0.b", 0, 50, 25), part("r0.a", 0, 0, 25)};
  parts[1] = {part("r1.a", 1, 25, 25), part("r1.b", 1, 75, 25)};
  auto m = plan_manifest(head.SerializeAsString(), 7, 2, parts);
  ASSERT_TRUE(m) << m.message();
  EXPECT_EQ(m->generation(), 7u);
  EXPECT_EQ(m->world_size(), 2);
  ASSERT_EQ(m->parts_size(), 4);
  EXPECT_EQ(m->parts(0).name(), "r0.a");
  EXPECT_EQ(m->parts(1).name(), "r1.a");
  EXPECT_EQ(m->parts(2).name(), "r0.b");
  EXPECT_EQ(m->parts(3).name(), "r1.b");
  EXPECT_TRUE(check_manifest(*m)) << check_manifest(*m).message();

  parts[1].pop_back();
  auto short_cover = plan_manifest(head.SerializeAsString(), 7, 2, parts);
  ASSERT_FALSE(short_cover);
  EXPECT_EQ(short_cover.message(), "no rank stored bytes [75, 100) of the state");
  auto garbage = plan_manifest(std::string("\xff\xff\xff", 3), 7, 2, parts);
  ASSERT_FALSE(garbage);
  EXPECT_EQ(garbage.message(), "rank 0's manifest does not parse");
}

}  // namespace
}  // namespace dtactor
