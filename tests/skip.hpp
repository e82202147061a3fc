#pragma once
// A skip is not a pass in CI. Outside CI a test that cannot run here (a
// package missing, a fixture script that failed, a service that did not
// start, no network namespaces) skips, saying why, and ctest shows it as
// skipped. Under CI=true (.ci/run; most CI services set it) the machine is
// meant to run everything: the same is a failure that shows the reason,
// the fixture's own output included. scripts/test.sh counts the skips.
#include <gtest/gtest.h>
#include <stdio.h>
#include <sys/wait.h>

#include <cstdlib>
#include <string>

namespace dtactor::testing {

inline bool under_ci() {
  const char* ci = std::getenv("CI");
  return ci && std::string(ci) == "true";
}

// Runs `command` under sh with its stdout and stderr captured. Empty when
// it exited 0; else "<what> failed (exit N): " and the end of what it
// printed, so that the fixture's own error is what the test shows.
inline std::string run_fixture(const std::string& what, const std::string& command) {
  std::string out;
  FILE* p = ::popen((command + " 2>&1").c_str(), "r");
  if (!p) return what + ": cannot start a shell";
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int st = ::pclose(p);
  if (st == 0) return {};
  constexpr size_t keep = 3000;
  if (out.size() > keep) out = "..." + out.substr(out.size() - keep);
  while (!out.empty() && out.back() == '\n') out.pop_back();
  const int code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return what + " failed (exit " + std::to_string(code) + ")" + (out.empty() ? "" : ":\n" + out);
}

// For a test program registered as one ctest entry (add_test, not
// gtest_discover_tests): its exit status, 77 (the entry's SKIP_RETURN_CODE)
// when every test that ran passed but some skipped, so that ctest shows
// the entry as skipped rather than passed.
inline int exit_status_with_skips(int run_all_tests_result) {
  if (run_all_tests_result == 0 && ::testing::UnitTest::GetInstance()->skipped_test_count() > 0) return 77;
  return run_all_tests_result;
}

}  // namespace dtactor::testing

// Skips the test with `why`; under CI=true fails it with `why` instead.
#define SKIP_OR_FAIL_IN_CI(why)                                                                                 \
  do {                                                                                                          \
    const std::string skip_why_ = (why);                                                                        \
    if (::dtactor::testing::under_ci()) FAIL() << skip_why_ << "\n(CI=true: a test that cannot run fails)"; \
    GTEST_SKIP() << skip_why_;                                                                                  \
  } while (0)
