// What reading the default job's data costs a rank at its start: the four
// Fashion-MNIST .gz files inflated by libdeflate (whole, as the ranks read
// them) against zlib's streaming read, alternating in one run; prints JSON.
//   bench_inflate [--repeats N] [--dir DIR]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/fashion_mnist.hpp"

using namespace dtactor;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Seconds to inflate all four files; -1 when one fails.
double inflate_all(const std::string& dir, gz_inflater how, size_t& bytes) {
  const auto t0 = std::chrono::steady_clock::now();
  bytes = 0;
  for (const char* name : {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"}) {
    auto r = inflate_gz_file(dir + "/" + name, how);
    if (!r) {
      std::fprintf(stderr, "bench_inflate: %s\n", r.message().c_str());
      return -1;
    }
    bytes += r->size();
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  int repeats = 9;
  std::string dir = "/usr/share/datasets/fashion-mnist";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--repeats" && i + 1 < argc) repeats = std::max(1, std::atoi(argv[++i]));
    else if (a == "--dir" && i + 1 < argc) dir = argv[++i];
    else {
      std::fprintf(stderr, "usage: bench_inflate [--repeats N] [--dir DIR]\n");
      return 2;
    }
  }
  std::vector<double> fast, streamed, ratio;
  size_t bytes = 0;
  for (int r = 0; r < repeats; ++r) {
    const double f = inflate_all(dir, gz_inflater::libdeflate, bytes);
    const double z = inflate_all(dir, gz_inflater::zlib, bytes);
    if (f < 0 || z < 0) return 1;
    fast.push_back(f);
    streamed.push_back(z);
    ratio.push_back(z / f);
  }
  nlohmann::json out = {{"benchmark", "inflate"},
                        {"what", "Fashion-MNIST's four .gz files (train and test, images and labels) inflated as a rank's start does"},
                        {"repeats", repeats},
                        {"decompressed_bytes", bytes},
                        {"libdeflate_s_median", median(fast)},
                        {"zlib_s_median", median(streamed)},
                        {"zlib_over_libdeflate_paired_median", median(ratio)},
                        {"libdeflate_s_runs", fast},
                        {"zlib_s_runs", streamed}};
  std::printf("%s\n", out.dump(1).c_str());
  return 0;
}
