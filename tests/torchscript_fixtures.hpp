#pragma once
// The scripted modules and data of tests/data/make_torchscript_fixtures.py,
// written once per test program into a directory of its own.
#include <unistd.h>

#include <filesystem>
#include <string>

#include "test_util.hpp"

namespace dtactor::testing {

struct torchscript_fixture_dir {
  std::string dir, error;  // error: why they could not be written
};
inline const torchscript_fixture_dir& torchscript_fixtures(const std::string& source_dir) {
  static torchscript_fixture_dir f = [&source_dir] {
    torchscript_fixture_dir out;
    out.dir = (std::filesystem::temp_directory_path() / ("dtactor-ts-" + std::to_string(::getpid()))).string();
    out.error = write_torchscript_fixtures(out.dir, source_dir);
    return out;
  }();
  return f;
}

}  // namespace dtactor::testing
