#include "runtime/blas_info.hpp"

#include <dlfcn.h>

#include <climits>
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

bool set_blas_threads(int n) {
  using set_fn = void (*)(int);
  if (auto fn = reinterpret_cast<set_fn>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    fn(n);
    return true;
  }
  return false;
}

}  // namespace dtactor
