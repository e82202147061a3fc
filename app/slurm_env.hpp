#pragma once
// dtactor under Slurm's srun: what a node process reads from the
// allocation's environment so that `dtactor --role node` needs no
// --coordinator (docs/slurm.md lists the variables).
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace dtactor {

struct slurm_launch {
  std::string job_id;           // SLURM_JOB_ID
  std::string node_name;        // SLURMD_NODENAME: the node id
  int node_index = 0;           // SLURM_NODEID: 0 runs the coordinator too
  int nnodes = 1;               // SLURM_JOB_NUM_NODES (SLURM_NNODES)
  std::string coordinator_host; // the first node of SLURM_JOB_NODELIST, its NodeAddr
  int port = 0;                 // DTACTOR_COORDINATOR_PORT, else 20000 + job id % 10000
  int gpus_on_node = 0;         // SLURM_GPUS_ON_NODE
  int restart_count = 0;        // SLURM_RESTART_COUNT (a requeued job)
};

// "n[1-3,7],gpu-a[01-02],login" -> each host name, in order. Empty with
// `error` set on a malformed list.
std::vector<std::string> expand_slurm_hostlist(const std::string& list, std::string& error);

// Whether this process is a task of a Slurm job step (srun): SLURM_JOB_ID
// and SLURM_STEP_ID both set.
bool under_srun(const std::function<const char*(const char*)>& getenv_fn);

// The launch from the environment. `node_addr` maps a Slurm node name to its
// address (scontrol show node NAME: NodeAddr); the name itself when it
// cannot. An error is one line.
std::optional<slurm_launch> slurm_launch_from(const std::function<const char*(const char*)>& getenv_fn,
                                              const std::function<std::string(const std::string&)>& node_addr, std::string& error);

// NodeAddr of a node through `scontrol show node NAME -o`; NAME when that fails.
std::string scontrol_node_addr(const std::string& name);

}  // namespace dtactor
