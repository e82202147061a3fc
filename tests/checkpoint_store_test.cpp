#include "runtime/checkpoint_store.hpp"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "runtime/fs.hpp"

namespace dtactor {
namespace {

namespace fs = std::filesystem;

// A fresh directory per test, removed afterwards.
class temp_dir {
 public:
  temp_dir() {
    std::string tmpl = ::testing::TempDir() + "/dtactor-ckpt-XXXXXX";
    if (!::mkdtemp(tmpl.data())) std::abort();
    path_ = tmpl;
  }
  ~temp_dir() {
    std::error_code ec;
    fs::permissions(path_, fs::perms::owner_all, fs::perm_options::add, ec);
    fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

std::string slurp(const std::string& path) {
  auto data = read_file(path);
  EXPECT_TRUE(data.ok()) << data.message();
  return data.ok() ? *data : std::string();
}

void spit(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << data;
}

std::set<std::string> file_names(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

pb::checkpoint_meta meta_at(int64_t step, uint64_t generation = 1, std::map<std::string, double> metrics = {}) {
  pb::checkpoint_meta m;
  m.set_model("vit");
  m.set_step(step);
  m.set_generation(generation);
  for (const auto& [k, v] : metrics) (*m.mutable_metrics())[k] = v;
  return m;
}

std::vector<std::pair<std::string, std::string>> sections_for(int64_t step) {
  return {{"model", "weights@" + std::to_string(step)}, {"optimizer", "adam@" + std::to_string(step)}};
}

checkpoint_store open_store(const std::string& dir, checkpoint_policy policy = {}) {
  auto store = checkpoint_store::open(dir, policy);
  if (!store.ok()) {
    ADD_FAILURE() << store.message();
    std::abort();
  }
  return std::move(store).value();
}

std::vector<int64_t> steps(const checkpoint_store& store) {
  std::vector<int64_t> out;
  for (const auto& e : store.list()) out.push_back(e.step);
  return out;
}

std::string save_ok(checkpoint_store& store, const pb::checkpoint_meta& meta) {
  auto path = store.save(meta, sections_for(meta.step()));
  EXPECT_TRUE(path.ok()) << path.message();
  return path.ok() ? *path : std::string();
}

TEST(checkpoint_store, round_trip_of_meta_and_sections) {
  temp_dir dir;
  auto store = open_store(dir.path());
  auto meta = meta_at(1200, 4, {{"accuracy", 0.875}});
  meta.set_seed(42);
  meta.set_samples_seen(1200 * 256);
  meta.set_config_toml("[model]\nname = \"vit\"\n");
  const std::string binary("\0\x01\xff\n\r", 5);
  auto path = store.save(meta, {{"model", binary}, {"optimizer", std::string(100000, 'x')}, {"empty", ""}});
  ASSERT_TRUE(path.ok()) << path.message();
  EXPECT_EQ(*path, dir / "ckpt-000001200.dtc");

  auto loaded = checkpoint_store::load(*path);
  ASSERT_TRUE(loaded.ok()) << loaded.message();
  EXPECT_EQ(loaded->path, *path);
  EXPECT_EQ(loaded->meta.format_version(), checkpoint_format_version);
  EXPECT_EQ(loaded->meta.model(), "vit");
  EXPECT_EQ(loaded->meta.step(), 1200);
  EXPECT_EQ(loaded->meta.generation(), 4u);
  EXPECT_EQ(loaded->meta.seed(), 42u);
  EXPECT_EQ(loaded->meta.samples_seen(), 1200 * 256);
  EXPECT_EQ(loaded->meta.config_toml(), meta.config_toml());
  EXPECT_EQ(loaded->meta.metrics().at("accuracy"), 0.875);
  ASSERT_EQ(loaded->meta.sections_size(), 3);
  EXPECT_EQ(loaded->meta.sections(0).name(), "model");
  EXPECT_EQ(loaded->meta.sections(0).size(), binary.size());
  EXPECT_EQ(loaded->sections.at("model"), binary);
  EXPECT_EQ(loaded->sections.at("optimizer"), std::string(100000, 'x'));
  EXPECT_EQ(loaded->sections.at("empty"), "");

  auto newest = store.load_newest_valid(nullptr);
  ASSERT_TRUE(newest.ok()) << newest.message();
  ASSERT_TRUE(newest->has_value());
  EXPECT_EQ((*newest)->meta.step(), 1200);

  auto listed = store.list();
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].path, *path);
  EXPECT_EQ(listed[0].step, 1200);
  EXPECT_EQ(listed[0].metrics.at("accuracy"), 0.875);
  EXPECT_EQ(store.newest_generation(), 4u);
}

TEST(checkpoint_store, file_layout_is_magic_length_meta_checksum_sections) {
  temp_dir dir;
  auto store = open_store(dir.path());
  auto path = save_ok(store, meta_at(3));
  const std::string bytes = slurp(path);
  ASSERT_GE(bytes.size(), 12u);
  EXPECT_EQ(bytes.substr(0, 8), "DTACKPT1");
  uint32_t meta_len = 0;
  for (int i = 0; i < 4; ++i) meta_len |= uint32_t(static_cast<unsigned char>(bytes[8 + i])) << (8 * i);
  const std::string model = sections_for(3)[0].second, optimizer = sections_for(3)[1].second;
  EXPECT_EQ(bytes.size(), 12u + meta_len + 8u + model.size() + optimizer.size());
  EXPECT_EQ(bytes.substr(bytes.size() - optimizer.size()), optimizer);
  EXPECT_EQ(checkpoint_file_name(7), "ckpt-000000007.dtc");
}

TEST(checkpoint_store, rotation_keeps_last_k_and_best_when_higher_is_better) {
  temp_dir dir;
  auto store = open_store(dir.path(), {2, true, "accuracy", true});
  const std::vector<double> accuracy = {0.5, 0.9, 0.7, 0.9, 0.6, 0.4, 0.3};
  for (int step = 1; step <= 7; ++step) {
    save_ok(store, meta_at(step, 1, {{"accuracy", accuracy[step - 1]}}));
    if (step == 3) {
      EXPECT_EQ(steps(store), (std::vector<int64_t>{2, 3}));
    }
    if (step == 4) {
      EXPECT_EQ(steps(store), (std::vector<int64_t>{3, 4})) << "a tie goes to the newer";
    }
  }
  EXPECT_EQ(steps(store), (std::vector<int64_t>{4, 6, 7}));
}

TEST(checkpoint_store, rotation_keeps_best_when_lower_is_better) {
  temp_dir dir;
  auto store = open_store(dir.path(), {1, true, "val_loss", false});
  save_ok(store, meta_at(1, 1, {{"val_loss", 2.0}}));
  save_ok(store, meta_at(2, 1, {{"val_loss", 1.0}}));
  save_ok(store, meta_at(3, 1, {{"val_loss", 1.5}}));
  save_ok(store, meta_at(4, 1));  // no metric: never "best"
  save_ok(store, meta_at(5, 1, {{"val_loss", 1.2}}));
  EXPECT_EQ(steps(store), (std::vector<int64_t>{2, 5}));
}

TEST(checkpoint_store, rotation_without_best_keeps_only_last_k) {
  temp_dir dir;
  auto store = open_store(dir.path(), {2, false, "accuracy", true});
  for (int step = 1; step <= 4; ++step) save_ok(store, meta_at(step, 1, {{"accuracy", step == 1 ? 1.0 : 0.0}}));
  EXPECT_EQ(steps(store), (std::vector<int64_t>{3, 4}));
}

TEST(checkpoint_store, rotation_never_deletes_an_invalid_file) {
  temp_dir dir;
  auto store = open_store(dir.path(), {1, false, "", true});
  auto first = save_ok(store, meta_at(1));
  fs::resize_file(first, fs::file_size(first) - 1);
  save_ok(store, meta_at(2));
  save_ok(store, meta_at(3));
  EXPECT_EQ(file_names(dir.path()), (std::set<std::string>{"ckpt-000000001.dtc", "ckpt-000000003.dtc"}));
  auto listed = store.list();
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_EQ(listed[0].step, 1);
  EXPECT_TRUE(listed[0].metrics.empty());
}

TEST(checkpoint_store, truncated_newest_is_skipped_reported_and_kept) {
  temp_dir dir;
  auto store = open_store(dir.path());
  save_ok(store, meta_at(1));
  auto newest = save_ok(store, meta_at(2));
  const auto full = fs::file_size(newest);
  fs::resize_file(newest, full / 2);

  std::vector<std::pair<std::string, std::string>> skipped;
  auto loaded = store.load_newest_valid([&](const std::string& p, const std::string& why) { skipped.emplace_back(p, why); });
  ASSERT_TRUE(loaded.ok()) << loaded.message();
  ASSERT_TRUE(loaded->has_value());
  EXPECT_EQ((*loaded)->meta.step(), 1);
  EXPECT_EQ((*loaded)->sections.at("model"), "weights@1");
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_EQ(skipped[0].first, newest);
  EXPECT_NE(skipped[0].second.find("truncated: expected"), std::string::npos) << skipped[0].second;
  EXPECT_NE(skipped[0].second.find("file has " + std::to_string(full / 2)), std::string::npos) << skipped[0].second;
  EXPECT_TRUE(fs::exists(newest)) << "a bad checkpoint is reported, never deleted";
}

TEST(checkpoint_store, truncation_inside_the_last_section_names_the_sizes) {
  temp_dir dir;
  auto store = open_store(dir.path());
  auto path = save_ok(store, meta_at(1));
  const auto full = fs::file_size(path);
  fs::resize_file(path, full - 3);
  auto loaded = checkpoint_store::load(path);
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.message(),
            "truncated: expected " + std::to_string(full) + " bytes, file has " + std::to_string(full - 3));
}

TEST(checkpoint_store, flipped_byte_in_a_section_is_a_checksum_error) {
  temp_dir dir;
  auto store = open_store(dir.path());
  auto path = store.save(meta_at(1), {{"optimizer", "adam-state"}, {"model", "weights"}});
  ASSERT_TRUE(path.ok()) << path.message();
  std::string bytes = slurp(*path);
  bytes[bytes.size() - 2] ^= 0x20;  // inside "weights", the last section
  spit(*path, bytes);
  auto loaded = checkpoint_store::load(*path);
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.message(), "checksum mismatch in section 'model'");
}

TEST(checkpoint_store, flipped_byte_in_the_meta_is_a_header_error) {
  temp_dir dir;
  auto store = open_store(dir.path());
  auto path = save_ok(store, meta_at(1));
  std::string bytes = slurp(path);
  bytes[14] ^= 0x01;
  spit(path, bytes);
  auto loaded = checkpoint_store::load(path);
  ASSERT_FALSE(loaded.ok());
  EXPECT_NE(loaded.message().find("meta checksum mismatch"), std::string::npos) << loaded.message();
}

TEST(checkpoint_store, garbage_empty_and_overlong_files_are_rejected) {
  temp_dir dir;
  auto store = open_store(dir.path());
  save_ok(store, meta_at(1));

  spit(dir / "ckpt-000000009.dtc", "this is not a checkpoint at all");
  auto garbage = checkpoint_store::load(dir / "ckpt-000000009.dtc");
  ASSERT_FALSE(garbage.ok());
  EXPECT_NE(garbage.message().find("not a dtactor checkpoint"), std::string::npos) << garbage.message();

  spit(dir / "ckpt-000000008.dtc", "");
  auto empty = checkpoint_store::load(dir / "ckpt-000000008.dtc");
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.message(), "truncated: expected at least 12 bytes, file has 0");

  spit(dir / "ckpt-000000007.dtc", slurp(dir / "ckpt-000000001.dtc") + "extra");
  auto overlong = checkpoint_store::load(dir / "ckpt-000000007.dtc");
  ASSERT_FALSE(overlong.ok());
  EXPECT_NE(overlong.message().find("trailing data"), std::string::npos) << overlong.message();

  auto missing = checkpoint_store::load(dir / "ckpt-000000006.dtc");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.message().find("No such file or directory"), std::string::npos) << missing.message();

  std::vector<std::string> skipped;
  auto loaded = store.load_newest_valid([&](const std::string& p, const std::string&) { skipped.push_back(p); });
  ASSERT_TRUE(loaded.ok() && loaded->has_value());
  EXPECT_EQ((*loaded)->meta.step(), 1);
  EXPECT_EQ(skipped, (std::vector<std::string>{dir / "ckpt-000000009.dtc", dir / "ckpt-000000008.dtc",
                                               dir / "ckpt-000000007.dtc"}));
}

TEST(checkpoint_store, a_file_whose_name_and_meta_disagree_is_skipped) {
  temp_dir dir;
  auto store = open_store(dir.path());
  save_ok(store, meta_at(1));
  auto path = save_ok(store, meta_at(2));
  fs::copy_file(path, dir / "ckpt-000000005.dtc");
  std::vector<std::string> reasons;
  auto loaded = store.load_newest_valid([&](const std::string&, const std::string& why) { reasons.push_back(why); });
  ASSERT_TRUE(loaded.ok() && loaded->has_value());
  EXPECT_EQ((*loaded)->meta.step(), 2);
  ASSERT_EQ(reasons.size(), 1u);
  EXPECT_EQ(reasons[0], "file name says step 5 but its meta says step 2");
}

TEST(checkpoint_store, empty_directory_has_no_checkpoint) {
  temp_dir dir;
  auto store = open_store(dir / "not/yet/there");
  EXPECT_TRUE(fs::is_directory(dir / "not/yet/there"));
  spit(dir / "not/yet/there/notes.txt", "unrelated");
  int skips = 0;
  auto loaded = store.load_newest_valid([&](const std::string&, const std::string&) { ++skips; });
  ASSERT_TRUE(loaded.ok()) << loaded.message();
  EXPECT_FALSE(loaded->has_value());
  EXPECT_EQ(skips, 0);
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

TEST(checkpoint_store, failed_write_keeps_the_old_checkpoint_and_leaves_no_temp_file) {
  temp_dir dir;
  auto store = open_store(dir.path());
  auto old_path = save_ok(store, meta_at(1));
  const std::string old_bytes = slurp(old_path);

  const std::vector<std::pair<faulty_env::fault, std::string>> cases = {
      {faulty_env::fault::disk_full, "No space left on device"},
      {faulty_env::fault::sync_fails, "Input/output error"},
      {faulty_env::fault::rename_fails, "Input/output error"}};
  for (const auto& [fault, reason] : cases) {
    faulty_env env(fault);
    auto faulty = checkpoint_store::open(dir.path(), {}, env);
    ASSERT_TRUE(faulty.ok()) << faulty.message();
    for (int64_t step : {1, 2}) {  // replacing the same step, and a new one
      auto saved = faulty->save(meta_at(step), {{"model", std::string(10000, 'n')}});
      ASSERT_FALSE(saved.ok());
      EXPECT_NE(saved.message().find(dir / checkpoint_file_name(step)), std::string::npos) << saved.message();
      EXPECT_NE(saved.message().find(reason), std::string::npos) << saved.message();
      EXPECT_EQ(file_names(dir.path()), std::set<std::string>{"ckpt-000000001.dtc"});
      EXPECT_EQ(slurp(old_path), old_bytes);
    }
  }
  auto loaded = store.load_newest_valid(nullptr);
  ASSERT_TRUE(loaded.ok() && loaded->has_value());
  EXPECT_EQ((*loaded)->sections.at("model"), "weights@1");
}

TEST(checkpoint_store, saving_the_same_step_again_replaces_it) {
  temp_dir dir;
  auto store = open_store(dir.path());
  save_ok(store, meta_at(5));
  auto again = store.save(meta_at(5), {{"model", "second"}});
  ASSERT_TRUE(again.ok()) << again.message();
  EXPECT_EQ(file_names(dir.path()), std::set<std::string>{"ckpt-000000005.dtc"});
  auto loaded = checkpoint_store::load(*again);
  ASSERT_TRUE(loaded.ok()) << loaded.message();
  EXPECT_EQ(loaded->sections.at("model"), "second");
  EXPECT_EQ(loaded->sections.count("optimizer"), 0u);
}

TEST(checkpoint_store, generation_fencing_refuses_an_older_generation) {
  temp_dir dir;
  auto store = open_store(dir.path());
  save_ok(store, meta_at(10, 5));
  auto zombie = store.save(meta_at(11, 3), sections_for(11));
  ASSERT_FALSE(zombie.ok());
  EXPECT_EQ(zombie.message(), "refusing checkpoint from generation 3: generation 5 already wrote here");
  auto zombie_same_step = store.save(meta_at(10, 4), {{"model", "stale"}});
  ASSERT_FALSE(zombie_same_step.ok());
  EXPECT_EQ(file_names(dir.path()), std::set<std::string>{"ckpt-000000010.dtc"});
  EXPECT_EQ(checkpoint_store::load(dir / "ckpt-000000010.dtc")->sections.at("model"), "weights@10");

  save_ok(store, meta_at(12, 5));
  save_ok(store, meta_at(13, 6));
  EXPECT_EQ(store.newest_generation(), 6u);
  // Another store (a restarted process) sees the same fence.
  auto other = open_store(dir.path());
  EXPECT_FALSE(other.save(meta_at(14, 5), sections_for(14)).ok());
}

TEST(checkpoint_store, open_removes_temp_files_of_a_dead_writer) {
  temp_dir dir;
  spit(dir / "ckpt-000000003.dtc.tmp.999999999.0", "half");
  spit(dir / "notes.tmp.1.2", "not ours");
  auto store = open_store(dir.path());
  EXPECT_EQ(file_names(dir.path()), std::set<std::string>{"notes.tmp.1.2"});
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

}  // namespace
}  // namespace dtactor
