// OpenBLAS's idle workers: dtactor makes them sleep at once instead of
// spinning ~0.1 s after every call (base/blas_info.hpp), without breaking
// BLAS in the process that changes it.
#include "base/blas_info.hpp"

#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

namespace {

using sgemm_fn = void (*)(const char*, const char*, const int*, const int*, const int*, const float*, const float*, const int*, const float*,
                          const int*, const float*, float*, const int*);

// C = A * B for n x n matrices through the process's BLAS (column-major).
std::vector<float> multiply(sgemm_fn sgemm, const std::vector<float>& a, const std::vector<float>& b, int n) {
  std::vector<float> c(static_cast<size_t>(n) * n, 0.f);
  const float one = 1.f, zero = 0.f;
  sgemm("N", "N", &n, &n, &n, &one, a.data(), &n, b.data(), &n, &zero, c.data(), &n);
  return c;
}

}  // namespace

TEST(Blas, IdleWorkersSleepAtOnceAndBlasStillComputes) {
  auto sgemm = reinterpret_cast<sgemm_fn>(::dlsym(RTLD_DEFAULT, "sgemm_"));
  auto timeout = reinterpret_cast<int (*)()>(::dlsym(RTLD_DEFAULT, "openblas_thread_timeout"));
  if (!sgemm || !timeout || !dtactor::describe_blas().is_openblas) GTEST_SKIP() << "the BLAS in this process is not OpenBLAS";
  ::unsetenv("OPENBLAS_THREAD_TIMEOUT");
  const int n = 256;  // large enough for OpenBLAS to use its workers
  std::vector<float> a(static_cast<size_t>(n) * n), b(a.size());
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i % 7) - 3.f, b[i] = static_cast<float>(i % 5) * 0.5f;
  ASSERT_TRUE(dtactor::set_blas_threads(2));
  const auto before = multiply(sgemm, a, b, n);  // workers running with the library's default

  EXPECT_EQ(dtactor::quiet_blas_workers(), std::to_string(dtactor::kBlasThreadTimeout));
  ASSERT_NE(std::getenv("OPENBLAS_THREAD_TIMEOUT"), nullptr);  // processes started from here read it at load
  EXPECT_EQ(std::string(std::getenv("OPENBLAS_THREAD_TIMEOUT")), std::to_string(dtactor::kBlasThreadTimeout));
  EXPECT_EQ(timeout(), dtactor::kBlasThreadTimeout);  // and this process's OpenBLAS took it
  const auto after = multiply(sgemm, a, b, n);  // workers started again
  EXPECT_EQ(before, after);
  // A user's own setting is left alone.
  ::setenv("OPENBLAS_THREAD_TIMEOUT", "12", 1);
  EXPECT_EQ(dtactor::quiet_blas_workers(), "12");
  EXPECT_EQ(std::string(std::getenv("OPENBLAS_THREAD_TIMEOUT")), "12");
  ::unsetenv("OPENBLAS_THREAD_TIMEOUT");
}

// OpenBLAS's fallback kernels on a CPU it does not know are replaced by the
// ones the CPU's features allow; its own choice of a newer kernel stays.
TEST(Blas, FallbackKernelsAreReplacedByWhatTheCpuCanRun) {
  EXPECT_EQ(dtactor::better_blas_core("Prescott", true, true), "SkylakeX");
  EXPECT_EQ(dtactor::better_blas_core("prescott", true, false), "Haswell");
  EXPECT_EQ(dtactor::better_blas_core("Core2", true, false), "Haswell");
  EXPECT_EQ(dtactor::better_blas_core("Prescott", false, false), "");
  EXPECT_EQ(dtactor::better_blas_core("Cooperlake", true, true), "");
  EXPECT_EQ(dtactor::better_blas_core("Zen", true, false), "");
  EXPECT_EQ(dtactor::better_blas_core("Haswell", true, true), "");
  EXPECT_EQ(dtactor::better_blas_core("", true, true), "");
}
