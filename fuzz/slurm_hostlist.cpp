// Slurm's environment (app/slurm_env.hpp): under srun a node reads
// SLURM_JOB_NODELIST ("n[1-3,7],gpu-a[01-02]"), SLURM_NODEID and friends to
// find its coordinator. Properties: expansion never crashes and never
// builds more than a real allocation's host names; the launch read from an
// environment of fuzzed values never crashes.
#include <map>

#include "app/slurm_env.hpp"
#include "fuzz/fuzz_util.hpp"

using namespace dtactor;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::reader in(data, size);
  const std::string list = in.payload();
  std::string error;
  auto hosts = expand_slurm_hostlist(list, error);
  if (hosts.empty() && error.empty()) fuzz::fail("no hosts and no error");
  std::map<std::string, std::string> env{{"SLURM_JOB_NODELIST", list}};
  for (const char* name : {"SLURM_JOB_ID", "SLURMD_NODENAME", "SLURM_NODEID", "SLURM_JOB_NUM_NODES", "DTACTOR_COORDINATOR_PORT",
                           "SLURM_GPUS_ON_NODE", "SLURM_RESTART_COUNT"})
    if (!in.empty()) env[name] = in.payload();
  error.clear();
  (void)slurm_launch_from([&](const char* k) -> const char* {
        auto it = env.find(k);
        return it == env.end() ? nullptr : it->second.c_str();
      },
      [](const std::string& name) { return name; }, error);
  return 0;
}
