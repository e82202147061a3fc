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

}  // namespace dtactor
