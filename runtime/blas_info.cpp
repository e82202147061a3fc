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

bool set_blas_threads(int n) {
  using set_fn = void (*)(int);
  if (auto fn = reinterpret_cast<set_fn>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    fn(n);
    return true;
  }
  return false;
}

}  // namespace dtactor
