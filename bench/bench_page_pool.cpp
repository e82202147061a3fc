// A train.zero = 3 gather's writes (rank/zero3): a unit's bytes copied into
// the part of the parameters' buffer a rank does not hold, after the unit
// was released, with its pages given back to the kernel (MADV_DONTNEED:
// every gather faults them in and zeroes them again) against kept in the
// gate's page pool (base/page_pool: moved out with mremap, taken back
// before the gather). Units of 64 MiB by default, two in the pool, each
// round both ways in turn; prints one JSON object (bench/bench_meta.py
// stamp --kind page_pool).
//
// Usage: bench_page_pool [--unit-mib N] [--units U] [--rounds R]
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/page_pool.hpp"

using namespace dtactor;

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t) { return std::chrono::duration<double>(clock_type::now() - t).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

struct times {
  double gather_s = 0, release_s = 0;
};

// One pass over every unit: gathered (copied in), then released.
times pass(char* flat, const char* src, size_t unit, int units, page_pool* pool) {
  times t;
  for (int u = 0; u < units; ++u) {
    char* p = flat + static_cast<size_t>(u) * unit;
    auto at = clock_type::now();
    if (pool) pool->take(p, unit);
    std::memcpy(p, src, unit);
    t.gather_s += seconds_since(at);
    at = clock_type::now();
    if (pool)
      pool->give(p, unit);
    else
      ::madvise(p, unit, MADV_DONTNEED);
    t.release_s += seconds_since(at);
  }
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  size_t unit_mib = 64;
  int units = 8, rounds = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--unit-mib") unit_mib = std::strtoul(argv[i + 1], nullptr, 10);
    if (a == "--units") units = std::atoi(argv[i + 1]);
    if (a == "--rounds") rounds = std::atoi(argv[i + 1]);
  }
  const size_t unit = unit_mib << 20;
  const size_t total = unit * static_cast<size_t>(units);
  char* flat = static_cast<char*>(::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (flat == MAP_FAILED) {
    std::fprintf(stderr, "bench_page_pool: cannot map %zu bytes\n", total);
    return 1;
  }
  std::vector<char> src(unit, 3);
  page_pool pool(2 * unit);
  (void)pass(flat, src.data(), unit, units, &pool);  // the pool filled once, as after a generation's first step
  std::vector<double> back_gbps, pooled_gbps, ratio, back_release, pooled_release;
  const double gb = static_cast<double>(total) / 1e9;
  for (int r = 0; r < rounds; ++r) {
    const times back = pass(flat, src.data(), unit, units, nullptr);
    (void)pass(flat, src.data(), unit, units, &pool);  // the pool filled again after the pages went back
    const times pooled = pass(flat, src.data(), unit, units, &pool);
    back_gbps.push_back(gb / back.gather_s);
    pooled_gbps.push_back(gb / pooled.gather_s);
    ratio.push_back(back.gather_s / pooled.gather_s);
    back_release.push_back(back.release_s / units);
    pooled_release.push_back(pooled.release_s / units);
  }
  nlohmann::json out = {{"benchmark", "page_pool"},
                        {"unit_bytes", unit},
                        {"units", units},
                        {"rounds", rounds},
                        {"given_back", {{"gather_gb_per_s_median", median(back_gbps)}, {"gather_gb_per_s_runs", back_gbps},
                                        {"release_s_median", median(back_release)}}},
                        {"pooled", {{"gather_gb_per_s_median", median(pooled_gbps)}, {"gather_gb_per_s_runs", pooled_gbps},
                                    {"release_s_median", median(pooled_release)}}},
                        {"given_back_over_pooled_gather_s_paired_median", median(ratio)},
                        {"pooled_bytes_after", pool.pooled_bytes()}};
  std::printf("%s\n", out.dump(1).c_str());
  ::munmap(flat, total);
  return 0;
}
