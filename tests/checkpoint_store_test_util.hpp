// What the checkpoint store's tests share (tests/checkpoint_store_test.cpp,
// tests/checkpoint_store_files_test.cpp): a temporary directory, streams,
// parts written as ranks write them, and a commit.
#pragma once

#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <cstring>
#include <fstream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "storage/fs.hpp"
#include "storage/object_store.hpp"
#include "job/job_config.hpp"
#include "job/shipped_file.hpp"
#include "storage/checkpoint_store.hpp"

namespace dtactor::checkpoint_test {

namespace fs = std::filesystem;

// A fresh directory per test, removed afterwards.
class temp_dir {
 public:
  temp_dir() {
    std::string tmpl = ::testing::TempDir() + "/dtactor-ckpt-XXXXXX";
    if (!::mkdtemp(tmpl.data())) std::abort();
    path_ = fs::path(tmpl).lexically_normal().string();
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

inline std::string slurp(const std::string& path) {
  auto data = read_file(path);
  EXPECT_TRUE(data.ok()) << data.message();
  return data.ok() ? *data : std::string();
}

inline void spit(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << data;
}

inline std::set<std::string> file_names(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

// The state stream of a checkpoint at `step`: n bytes derived from the step.
inline std::string stream_for(int64_t step, size_t n = 10000) {
  std::string out(n, '\0');
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<char>((i * 131 + static_cast<size_t>(step) * 7) & 0xff);
  return out;
}

inline pb::checkpoint_meta meta_at(int64_t step, uint64_t generation = 1, std::map<std::string, double> metrics = {}) {
  pb::checkpoint_meta m;
  m.set_model("vit");
  m.set_step(step);
  m.set_generation(generation);
  for (const auto& [k, v] : metrics) (*m.mutable_metrics())[k] = v;
  return m;
}

inline checkpoint_store open_store(const std::string& dir, checkpoint_policy policy = {}, fs_env& env = default_fs_env()) {
  auto store = checkpoint_store::open(dir, policy, env);
  if (!store.ok()) {
    ADD_FAILURE() << store.message();
    std::abort();
  }
  return std::move(store).value();
}

// What the ranks and the coordinator do: each of `world` ranks stores its
// byte range of the stream as a part; the manifest lists them and one
// uint8 tensor over the whole stream. Returns the meta to commit.
inline pb::checkpoint_meta write_parts(checkpoint_store& store, pb::checkpoint_meta meta, const std::string& stream, int world) {
  meta.set_state_bytes(stream.size());
  meta.set_world_size(world);
  auto* t = meta.add_tensors();
  t->set_name("blob");
  t->set_dtype("uint8");
  t->add_shape(static_cast<int64_t>(stream.size()));
  t->set_offset(0);
  t->set_size(stream.size());
  for (int r = 0; r < world; ++r) {
    auto [a, b] = part_range(stream.size(), r, world);
    auto part = write_part(store.objects(), part_name(meta.step(), meta.generation(), r, world), a, stream.data() + a, b - a);
    EXPECT_TRUE(part.ok()) << part.message();
    if (part.ok()) *meta.add_parts() = part.value();
  }
  return meta;
}

inline std::string commit_ok(checkpoint_store& store, pb::checkpoint_meta meta, int world = 2, const std::string& stream = "") {
  auto m = write_parts(store, meta, stream.empty() ? stream_for(meta.step()) : stream, world);
  auto done = store.commit(m);
  EXPECT_TRUE(done.ok()) << done.message();
  return done.ok() ? done->location : std::string();
}

inline std::string read_all(checkpoint_store& store, const pb::checkpoint_meta& meta, status* st_out = nullptr) {
  std::string out(meta.state_bytes(), '\0');
  auto st = store.read_stream(meta, [&](uint64_t at, const char* data, size_t n) {
    std::memcpy(out.data() + at, data, n);
    return status{};
  });
  if (st_out) *st_out = st;
  else EXPECT_TRUE(st.ok()) << st.message();
  return out;
}

inline std::optional<pb::checkpoint_meta> newest(checkpoint_store& store, std::vector<std::string>* skipped = nullptr) {
  auto n = store.newest_valid(
      [&](const std::string& path, const std::string& why) {
        if (skipped) skipped->push_back(path + ": " + why);
      },
      true);
  EXPECT_TRUE(n.ok()) << n.message();
  return n.ok() ? n.value() : std::nullopt;
}

}  // namespace dtactor::checkpoint_test
