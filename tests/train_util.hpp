#pragma once
// What tests that train through app/train_command share.
#include <string>

#include "app/train_command.hpp"

namespace dtactor::testing {

// run_training's options for a test: into `dir`, with no progress line.
inline train_options quiet(const std::string& dir) {
  train_options o;
  o.run_dir = dir;
  o.interactive = false;
  return o;
}

}  // namespace dtactor::testing
