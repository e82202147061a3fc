#pragma once
// LibTorch's exceptions as dtactor errors, at the training thread's edge
// (STYLE.md: exceptions stay inside LibTorch calls). The one place that
// knows how LibTorch says "out of memory": CUDA's allocator throws
// c10::OutOfMemoryError, the CPU allocator a plain c10::Error ("can't
// allocate memory"), the C++ runtime std::bad_alloc.
#include <c10/util/Exception.h>

#include <exception>
#include <new>
#include <string>

#include "dtactor/result.hpp"

namespace dtactor {

// The last line of LibTorch's message (the cause, without its context lines).
inline std::string torch_error_line(const std::string& what) {
  const auto end = what.find_last_not_of('\n');
  if (end == std::string::npos) return what;
  const auto start = what.rfind('\n', end);
  return what.substr(start == std::string::npos ? 0 : start + 1, end - (start == std::string::npos ? 0 : start + 1) + 1);
}

// Call inside a catch block: the exception in flight as an error.
inline error current_torch_error() {
  try {
    throw;
  } catch (const std::bad_alloc&) {
    return make_error("out of memory (std::bad_alloc)", errc::out_of_memory);
  } catch (const c10::OutOfMemoryError& e) {
    return make_error(torch_error_line(e.what_without_backtrace()), errc::out_of_memory);
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    const bool oom = what.find("can't allocate memory") != std::string::npos || what.find("out of memory") != std::string::npos;
    return make_error(torch_error_line(what), oom ? errc::out_of_memory : errc::unspecified);
  } catch (const std::exception& e) {
    return make_error(e.what());
  } catch (...) {
    return make_error("an exception that is not a std::exception");
  }
}

}  // namespace dtactor
