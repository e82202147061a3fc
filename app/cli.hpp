#pragma once
// dtactor's command line, torch-free: parses every mode (CLI11) and runs the
// ones that train no model in this process (config, report, local,
// --role coordinator|node). The others (train, eval, export, tune-batch,
// --role rank) go to a training_launcher: in libdtactor (run_main, the C++
// API) it runs them in-process; in the small `dtactor` binary it executes
// `dtactor-train` with the same arguments (app/dtactor_main.cpp).
// Exit codes: 0 done, 1 the job failed, 2 bad command line or config,
// 128+N stopped by signal N (after a checkpoint).
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "app/cluster.hpp"
#include "app/tune_batch.hpp"  // options only: torch-free header

namespace dtactor {

enum class cli_command { none, train, eval, export_checkpoint, tune_batch, config, report, local, role, keygen, data_index };

// --role: a cluster process (a rank is started by its node, not by hand).
enum class process_role { none, coordinator, node, rank };
// --role's names, the one table its parsing reads.
inline const std::map<std::string, process_role>& process_role_names() {
  static const std::map<std::string, process_role> names{{"coordinator", process_role::coordinator}, {"node", process_role::node}, {"rank", process_role::rank}};
  return names;
}

// Everything the command line sets, for whichever command it names.
struct parsed_cli {
  cli_command command = cli_command::none;
  process_role role = process_role::none;  // with cli_command::role
  cluster_cli cluster;
  cluster_cli local;
  std::string local_fail_mode = "crash";  // local --fail-mode (for tests), into local.fail_mode
  std::string config_path, run_dir = "runs/default", resume_from, target;
  std::vector<std::string> overrides;
  int64_t stop_at = -1;
  bool no_resume = false, print_config = false, reference = false;
  std::string export_out;
  bool export_state_dict = false;
  std::string tb_max_memory;
  int64_t tb_probe = 0;
  tune_batch_options tb;
  std::string report_dir, report_out;
  std::string key_path;    // --key (else DTACTOR_KEY_FILE)
  std::string keygen_out;  // keygen --out
  std::string data_spec, data_s3_endpoint;  // data index SPEC [--s3-endpoint URL]
  // The job key, loaded once run_cli has parsed the line (null: none); also
  // in cluster.key and local.key.
  std::shared_ptr<const job_key> key;
};

// True for the commands that need LibTorch (the training side).
bool needs_training(const parsed_cli& p);

// Runs a training command (needs_training) and returns the exit code.
// `argv` is the original command line (for a launcher that re-executes it).
using training_launcher = std::function<int(int argc, char** argv, const parsed_cli& parsed)>;

int run_cli(int argc, char** argv, const training_launcher& launcher);

// The stop flag SIGINT/SIGTERM set (a second signal kills at once), and the
// call that installs those handlers. It also ignores SIGPIPE: a write to a
// socket or pipe whose reader is gone (a Gloo peer on a killed host, a log
// reader that went away) fails with EPIPE for the writer to handle, instead
// of killing a long-running process. Spawned children start with every
// signal at its default (base/process).
const std::atomic<int>* stop_flag();
void install_stop_handlers();

// One line on stderr, "dtactor: MESSAGE"; returns `code`.
int cli_fail(const std::string& message, int code = 1);

}  // namespace dtactor
