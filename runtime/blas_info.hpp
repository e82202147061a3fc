#pragma once
// Which BLAS the process really calls (LibTorch uses whatever libblas.so.3
// resolves to) and control of its thread count.
#include <string>

namespace dtactor {

struct blas_info {
  std::string library;  // file that provides sgemm_, e.g. .../openblas-pthread/libblas.so.3
  std::string config;   // OpenBLAS's own description, empty for other BLAS
  bool is_openblas = false;
};

blas_info describe_blas();

// Sets OpenBLAS's thread count when OpenBLAS is loaded; returns whether it was.
bool set_blas_threads(int n);

// OpenBLAS's idle worker threads spin for 2^28 cycles (~0.1 s) after every
// call before they sleep. Between two matrix products LibTorch works on one
// thread, so on a small machine the spinning workers take the cores it
// needs: `dtactor train` with its default 2 threads ran at 858-2,155
// samples/s from run to run here. Unless the user set
// OPENBLAS_THREAD_TIMEOUT, this sets it (to kBlasThreadTimeout: idle workers
// sleep at once) for this process and every process it starts: OpenBLAS
// reads it when it loads, so in this process its worker threads are shut
// down and start again with the new setting at the next call. Returns the
// value in force ("" without OpenBLAS). Call first thing in main.
std::string quiet_blas_workers();
constexpr int kBlasThreadTimeout = 4;

}  // namespace dtactor
