#pragma once
// The cluster roles of the dtactor binary: coordinator, node, rank (started
// by a node, not by users), and `local` (a coordinator and N nodes on this
// machine). Each returns the process's exit code.
#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "base/fault_mode.hpp"
#include "base/job_key.hpp"

namespace dtactor {

struct cluster_cli {
  std::string config_path;
  std::vector<std::string> overrides;
  std::string run_dir = "runs/default";
  std::string listen = "tcp://0.0.0.0:29400";  // coordinator
  std::string coordinator;                     // node
  std::string advertise_addr;                  // node, rank; coordinator: store host for ranks
  std::string node_id;                         // node (default: host name), rank
  std::string node_endpoint;                   // rank: its node's ipc endpoint
  int nproc_per_node = 1;
  int local_rank = 0;                          // rank
  bool spare = false;                          // rank: started as a warm spare, without a local rank (node_spares)
  int spares = -1;                             // node: spare rank processes to keep warm (-1: cluster.spare_ranks)
  bool standby_node = false;                   // node: register as a standby, outside the world until a member is lost
  int threads_per_rank = 0;                    // node, rank: cores each rank uses when train.threads = 0 (0: cores / nproc)
  int metrics_port = 0;
  bool metrics_free_port = false;              // coordinator (set by dtactor local): serve the status page on a port the system picks
  int announce_fd = -1;                        // coordinator (set by dtactor local): write "ENDPOINT STATUS_PORT\n" here once listening
  std::string metrics_addr = "0.0.0.0";       // address /metrics binds (unauthenticated: choose it)
  int nodes = 2;                               // local
  int standby_nodes = 0;                       // local: nodes started beside them with --standby-node
  bool chaos = false;                          // local: kill a node at intervals, start a replacement (app/chaos.hpp)
  double chaos_every_s = 20;                   // local --chaos: seconds of training between recoveries and kills
  int connect_timeout_s = 120;
  bool die_with_parent = false;                // coordinator, node: SIGTERM when the parent (dtactor local) dies
  bool no_resume = false;                      // coordinator, local: start over even if the run directory holds checkpoints
  // coordinator: the job's leader lease (etcd://HOST:PORT[/PREFIX] or a
  // shared directory; app/coordinator_lease.hpp), whether to wait for it
  // while another holds it, and its TTL.
  std::string lease;
  bool standby = false;
  int lease_ttl_ms = 1500;
  int64_t fail_at_step = -1;                   // node, rank: fault injection for tests (rank_worker_options)
  fault_mode fail_mode = fault_mode::crash;
  // node: watch the cloud's instance metadata service for a preemption
  // notice (off, aws, gcp, azure, auto) and leave at the next step boundary.
  std::string preemption_notice = "off";
  std::string azure_metadata_endpoint;  // node: Azure IMDS base URL (default http://169.254.169.254)
  int preemption_poll_ms = 1000;        // node: metadata poll interval
  // node: on SIGTERM/SIGINT/SIGUSR1, wait this long for the coordinator to
  // stop the whole job (final checkpoint) before leaving on its own. Set
  // for Slurm's one-job shape, where a signal reaches every task of the job
  // at once (the coordinator's too); 0: leave at once.
  int signal_waits_for_stop_s = 0;
  const std::atomic<int>* stop_signal = nullptr;
  // The job key (--key / DTACTOR_KEY_FILE), null for an open job; see
  // base/job_key.hpp and docs/security.md.
  std::shared_ptr<const job_key> key;
};

int run_coordinator(const cluster_cli& cli);
// What run_coordinator checks before it starts anything (config, run
// directory writable and not in use): one line and the exit code (2 bad
// command line or config, 1 otherwise) on failure. `dtactor local` runs it
// before it starts any process.
struct setup_check {
  int code = 0;
  std::string message;
};
setup_check check_coordinator_setup(const cluster_cli& cli);
int run_node(const cluster_cli& cli);
int run_rank(const cluster_cli& cli);
int run_local(const cluster_cli& cli);
// Why `dtactor local`'s node and rank counts (and --chaos) cannot run ("" when
// they can): checked before anything, the run directory included, is made.
std::string local_arguments_problem(const cluster_cli& cli);

// torchrun-style static launch: `--role node` without --coordinator but with
// MASTER_ADDR, MASTER_PORT, WORLD_SIZE (all ranks) and NODE_RANK in the
// environment. NODE_RANK 0 also runs the coordinator (listening on
// MASTER_PORT, waiting for WORLD_SIZE / --nproc-per-node nodes, with the
// --config/--set/--run-dir given); every node then joins it as usual.
int run_static_node(const cluster_cli& cli);
// The static launch with its parameters given: node_rank 0 also runs the
// coordinator on `port`; the node's id defaults to `default_node_id`.
int run_static_launch(const cluster_cli& cli, const std::string& addr, int port, int nnodes, int node_rank, const std::string& default_node_id);
// `--role node` without --coordinator inside a Slurm job step (srun): the
// static launch with the allocation's first node as the coordinator
// (app/slurm_env.hpp says which variables are read).
int run_slurm_node(const cluster_cli& cli);

}  // namespace dtactor
