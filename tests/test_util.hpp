#pragma once
// Helpers shared by the tests: temporary directories and small configs.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "job/journal_events.hpp"
#include "dtactor/config.hpp"
#include "skip.hpp"

namespace dtactor::testing {

// A fresh directory under the test temp dir, removed by the destructor.
class temp_dir {
 public:
  temp_dir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "dtactor-test-XXXXXX").string();
    path_ = ::mkdtemp(tmpl.data());
  }
  // DTACTOR_KEEP_TEST_DIRS=1 keeps it (logs and journals of a failing run).
  ~temp_dir() {
    if (const char* keep = std::getenv("DTACTOR_KEEP_TEST_DIRS"); keep && *keep && std::string(keep) != "0") return;
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// n bytes from a seeded generator.
inline std::string random_bytes(size_t n, int seed) {
  std::string out(n, '\0');
  std::mt19937 rng(seed);
  for (auto& c : out) c = static_cast<char>(rng());
  return out;
}

// A ViT small enough to train a few dozen steps in seconds.
// Checkpoints are taken at the steps they fall due at, never deferred while
// the previous one is still stored (the tests read them by step; deferral
// has tests of its own).
// Pages of [p, p + bytes) wholly inside it: (resident, all).
inline std::pair<size_t, size_t> interior_pages(const void* p, int64_t bytes) {
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t first = (a + page - 1) / page * page, last = (a + static_cast<uintptr_t>(bytes)) / page * page;
  if (first >= last) return {0, 0};
  std::vector<unsigned char> v((last - first) / page);
  if (::mincore(reinterpret_cast<void*>(first), last - first, v.data()) != 0) return {0, 0};
  size_t in = 0;
  for (unsigned char c : v) in += c & 1;
  return {in, v.size()};
}

inline config tiny_vit_config(const std::vector<std::string>& extra = {}) {
  std::vector<std::string> o = {"model.dim=16", "model.layers=1", "model.heads=2", "model.mlp_ratio=2", "train.global_batch_size=32",
                                "train.max_steps=40", "train.warmup_steps=5", "train.lr=0.003", "train.threads=1", "eval.max_samples=500",
                                "eval.every_steps=0", "checkpoint.every_steps=0", "train.log_every_steps=5", "checkpoint.defer_while_writing=false"};
  o.insert(o.end(), extra.begin(), extra.end());
  auto c = config::load("", o);
  if (!c) throw std::runtime_error(c.message());
  return c.value();
}

// Scripted PyTorch modules and .npy / .bin data written by Debian's
// python3-torch and NumPy (tests/data/make_torchscript_fixtures.py) into
// `dir`. Empty when written; else why not, with the script's own output
// (tests skip with it, or fail under CI: SKIP_OR_FAIL_IN_CI).
inline std::string write_torchscript_fixtures(const std::string& dir, const std::string& source_dir) {
  return run_fixture("tests/data/make_torchscript_fixtures.py (python3-torch and python3-numpy, Debian; scripts/install-deps.sh --test)",
                     "/usr/bin/python3.11 " + source_dir + "/tests/data/make_torchscript_fixtures.py " + dir);
}

inline std::vector<nlohmann::json> read_journal(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

// The lines of one event, by its schema type (a renamed event breaks here at
// compile time); rank_down's two names go through events_named.
inline std::vector<nlohmann::json> events_named(const std::vector<nlohmann::json>& j, std::string_view name) {
  std::vector<nlohmann::json> out;
  for (const auto& e : j)
    if (e.at("event").get<std::string>() == name) out.push_back(e);
  return out;
}
template <class E>
std::vector<nlohmann::json> events(const std::vector<nlohmann::json>& j) {
  return events_named(j, E::name);
}

// A field of this process's /proc/self/status in kB ("VmRSS:", "VmHWM:":
// resident memory now and its peak), -1 when absent; reset_peak() starts
// the peak again from what is resident now (/proc/self/clear_refs).
inline int64_t status_kb(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const std::string k = key;
  while (std::getline(f, line))
    if (line.compare(0, k.size(), k) == 0) return std::stoll(line.substr(k.size()));
  return -1;
}
inline bool reset_peak() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  f.flush();
  return static_cast<bool>(f);
}

}  // namespace dtactor::testing
