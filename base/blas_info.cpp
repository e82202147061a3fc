#include "base/blas_info.hpp"

#include <dlfcn.h>

#include <unistd.h>

#include <cctype>
#include <climits>
#include <cstdio>
#include <cstdlib>

namespace dtactor {

blas_info describe_blas() {
  blas_info info;
  if (void* sym = ::dlsym(RTLD_DEFAULT, "sgemm_")) {
    Dl_info dl{};
    if (::dladdr(sym, &dl) && dl.dli_fname) {
      char resolved[PATH_MAX];
      info.library = ::realpath(dl.dli_fname, resolved) ? resolved : dl.dli_fname;
    }
  }
  using get_config_fn = char* (*)();
  if (auto fn = reinterpret_cast<get_config_fn>(::dlsym(RTLD_DEFAULT, "openblas_get_config"))) {
    info.is_openblas = true;
    if (const char* c = fn()) info.config = c;
  }
  if (info.library.find("openblas") != std::string::npos) info.is_openblas = true;
  return info;
}

std::string quiet_blas_workers() {
  if (const char* user = std::getenv("OPENBLAS_THREAD_TIMEOUT"); user && *user) return user;
  using void_fn = void (*)();
  using int_fn = int (*)();
  auto read_env = reinterpret_cast<void_fn>(::dlsym(RTLD_DEFAULT, "openblas_read_env"));
  auto shutdown = reinterpret_cast<int_fn>(::dlsym(RTLD_DEFAULT, "blas_thread_shutdown_"));
  const std::string value = std::to_string(kBlasThreadTimeout);
  ::setenv("OPENBLAS_THREAD_TIMEOUT", value.c_str(), 0);  // children read it when they load OpenBLAS
  if (!read_env || !shutdown) return {};
  read_env();
  // Workers are started again (with the new timeout) by the next BLAS call,
  // as after a fork.
  shutdown();
  return value;
}

std::string better_blas_core(const std::string& openblas_core, bool avx2_fma, bool avx512) {
  std::string core;
  for (char c : openblas_core) core += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const bool fallback = core == "prescott" || core == "core2" || core == "katmai" || core == "northwood" || core == "nehalem" ||
                        core == "unknown" || core == "generic";
  if (!fallback) return {};
  if (avx512) return "SkylakeX";
  if (avx2_fma) return "Haswell";
  return {};
}

std::string blas_core() {
  using name_fn = char* (*)();
  if (auto fn = reinterpret_cast<name_fn>(::dlsym(RTLD_DEFAULT, "openblas_get_corename")))
    if (const char* n = fn()) return n;
  return {};
}

namespace {
struct cpu_features {
  bool avx2_fma = false, avx512 = false;
};
cpu_features this_cpu() {
  cpu_features f;
#if defined(__x86_64__)
  __builtin_cpu_init();
  f.avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  f.avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512dq");
#endif
  return f;
}
}  // namespace

void choose_blas_kernels_for_children() {
  if (std::getenv("OPENBLAS_CORETYPE")) return;
  if (!blas_core().empty()) return;  // OpenBLAS is in this process: use_the_cpus_blas_kernels decides
  void* h = ::dlopen("libblas.so.3", RTLD_NOW | RTLD_LOCAL);
  if (!h) return;
  using name_fn = char* (*)();
  std::string core;
  if (auto fn = reinterpret_cast<name_fn>(::dlsym(h, "openblas_get_corename")))
    if (const char* n = fn()) core = n;
  ::dlclose(h);
  const cpu_features f = this_cpu();
  const std::string better = better_blas_core(core, f.avx2_fma, f.avx512);
  if (!better.empty()) ::setenv("OPENBLAS_CORETYPE", better.c_str(), 1);
}

void use_the_cpus_blas_kernels(char** argv, bool say) {
  if (const char* user = std::getenv("OPENBLAS_CORETYPE"); user) return;  // the user's choice (or ours, after the exec)
  const std::string core = blas_core();
  if (core.empty()) return;
  const cpu_features f = this_cpu();
  const bool avx512 = f.avx512;
  const std::string better = better_blas_core(core, f.avx2_fma, f.avx512);
  if (better.empty()) return;
  ::setenv("OPENBLAS_CORETYPE", better.c_str(), 1);
  if (say)
    std::fprintf(stderr, "dtactor: OpenBLAS did not recognise this CPU and chose its %s kernels; using its %s kernels (the CPU has %s; set OPENBLAS_CORETYPE to choose)\n",
                 core.c_str(), better.c_str(), avx512 ? "AVX-512" : "AVX2");
  ::execv("/proc/self/exe", argv);
  // Not executed again: go on with the old kernels (children still get the setting).
}

bool set_blas_threads(int n) {
  using set_fn = void (*)(int);
  if (auto fn = reinterpret_cast<set_fn>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    fn(n);
    return true;
  }
  return false;
}

}  // namespace dtactor
