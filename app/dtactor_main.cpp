// The `dtactor` binary: the command line without LibTorch. The coordinator,
// node agents, `local`, `config` and `report` run here, in a small process
// (the coordinator never holds model bytes); the commands that train (train,
// eval, export, tune-batch, and the rank processes a node starts as
// `dtactor --role rank`) execute `dtactor-train`, the same command line with
// the training engine linked (app/main.cpp), with the same arguments and the
// same process id. Programs of your own are built on run_main
// (dtactor/main.hpp) and run every mode in-process.
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

#include "app/cli.hpp"
#include "base/blas_info.hpp"
#include "base/process.hpp"

namespace {

// DTACTOR_TRAIN_BINARY, or dtactor-train next to this executable.
std::string train_binary() {
  if (const char* env = std::getenv("DTACTOR_TRAIN_BINARY"); env && *env) return env;
  const std::string self = dtactor::self_executable();
  const auto slash = self.rfind('/');
  return (slash == std::string::npos ? std::string(".") : self.substr(0, slash)) + "/dtactor-train";
}

int exec_training(int, char** argv, const dtactor::parsed_cli&) {
  dtactor::choose_blas_kernels_for_children();
  const std::string path = train_binary();
  ::execv(path.c_str(), argv);
  return dtactor::cli_fail("this command trains a model, which runs in " + path + ", and that could not be started (" + std::strerror(errno) +
                           "): install dtactor-train next to dtactor, or name it with DTACTOR_TRAIN_BINARY");
}

}  // namespace

int main(int argc, char** argv) { return dtactor::run_cli(argc, argv, exec_training); }
