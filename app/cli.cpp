// dtactor's command line, torch-free (app/cli.hpp): parses arguments (CLI11)
// and runs the modes that need no LibTorch; hands the others to the
// training launcher.
#include "app/cli.hpp"

#include <CLI/CLI.hpp>

#include <arpa/inet.h>
#include <sys/prctl.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "app/slurm_env.hpp"
#include "dtactor/config.hpp"
#include "monitoring/report.hpp"
#include "base/blas_info.hpp"
#include "base/printable.hpp"
#include "job/job_config.hpp"
#include "net/wire.hpp"
#include "storage/checkpoint_store.hpp"
#include "data/data_shards.hpp"
#include "storage/fs.hpp"
#include "base/job_key.hpp"
#include "base/process.hpp"

namespace dtactor {

namespace {

std::atomic<int> g_stop{0};

extern "C" void on_stop_signal(int sig) {
  if (g_stop.exchange(sig) != 0) {
    // Second signal: the user insists; stop now.
    std::signal(sig, SIG_DFL);
    std::raise(sig);
  }
}

std::string config_reference() {
  std::string out = "Config keys (TOML sections = the part before the dot; override any with --set key=value):\n";
  for (const auto& k : config_schema()) {
    out += "  " + k.name + " = " + (k.kind == value_kind::string ? "\"" + k.default_value + "\"" : k.default_value) + "\n      " + k.doc + "\n";
  }
  return out;
}

}  // namespace

const std::atomic<int>* stop_flag() { return &g_stop; }

void install_stop_handlers() {
  std::signal(SIGINT, on_stop_signal);
  std::signal(SIGTERM, on_stop_signal);
  // Slurm's --signal=USR1@SECONDS before a job's time limit.
  std::signal(SIGUSR1, on_stop_signal);
  std::signal(SIGPIPE, SIG_IGN);
}

int cli_fail(const std::string& message, int code) {
  std::fprintf(stderr, "dtactor: %s\n", message.c_str());
  return code;
}

bool needs_training(const parsed_cli& p) {
  switch (p.command) {
    case cli_command::train:
    case cli_command::eval:
    case cli_command::export_checkpoint:
    case cli_command::tune_batch: return true;
    case cli_command::role: return p.role == process_role::rank;
    default: return false;
  }
}

// The cluster roles' options (--role coordinator|node, and the internal
// rank's). `fail_mode` is --fail-mode's text, turned into a fault_mode after
// parsing.
void add_role_options(CLI::App& app, parsed_cli& p, std::string& fail_mode) {
  cluster_cli& cl = p.cluster;
  app.add_option("--role", p.role, "Run as a cluster process: coordinator or node")->transform(CLI::CheckedTransformer(process_role_names()));
  app.add_option("--listen", cl.listen, "coordinator: address to bind")->capture_default_str();
  app.add_option("--coordinator", cl.coordinator,
                 "node: the coordinator's address, e.g. tcp://COORD_HOST:29400; or several, comma-separated: a coordinator and its standbys (--standby)");
  app.add_option("--nproc-per-node", cl.nproc_per_node, "node: rank processes to start (one per device)")->capture_default_str();
  app.add_option("--metrics-port", cl.metrics_port, "Port of the Prometheus /metrics endpoint (0 = none)")->check(CLI::Range(0, 65535));
  app.add_option("--metrics-addr", cl.metrics_addr, "Address the /metrics endpoint binds (it is unauthenticated)")->capture_default_str();
  app.add_option("--advertise-addr", cl.advertise_addr,
                 "node: address peers use to reach this machine (default: the one that routes to the coordinator); coordinator: its host "
                 "as the ranks should reach it");
  app.add_option("--node-id", cl.node_id, "node: stable name of this machine (default: host name)");
  app.add_option("--connect-timeout", cl.connect_timeout_s, "node: seconds to wait for a first answer from the coordinator (0 = forever)")
      ->capture_default_str();
  app.add_option("--config", cl.config_path, "coordinator: job config file (TOML)");
  app.add_option("--set", cl.overrides, "coordinator: override a config key (repeatable)")->allow_extra_args(false);
  app.add_option("--run-dir", cl.run_dir, "coordinator: where the journal and checkpoints go")->capture_default_str();
  app.add_option("--threads-per-rank", cl.threads_per_rank,
                 "node: compute threads of each rank when train.threads is 0 (default: this machine's cores / --nproc-per-node)");
  app.add_flag("--no-resume", cl.no_resume, "coordinator: start over even if the run directory holds checkpoints");
  app.add_option("--lease", cl.lease,
                 "coordinator: the job's leader lease, etcd://HOST:PORT[/PREFIX], s3://BUCKET/PREFIX (a server with conditional writes) or "
                 "a directory on a shared file system: one coordinator decides at a time");
  app.add_flag("--standby", cl.standby, "coordinator (with --lease): wait while another holds the lease, and take over when it is gone");
  app.add_option("--lease-ttl-ms", cl.lease_ttl_ms, "coordinator: how long a lease not renewed stays held")->check(CLI::Range(300, 600000))->capture_default_str();
  app.add_flag("--die-with-parent", cl.die_with_parent, "stop when the parent process ends (set by dtactor local)")->group("");
  app.add_flag("--metrics-free-port", cl.metrics_free_port, "coordinator (set by dtactor local): serve the status page on a free port")->group("");
  app.add_option("--announce-fd", cl.announce_fd, "coordinator (set by dtactor local): descriptor to report the bound ports on")
      ->check(CLI::Range(3, 1 << 20))
      ->group("");
  app.add_option("--node-endpoint", cl.node_endpoint, "rank (started by the node agent): the node's ipc endpoint")->group("");
  app.add_option("--local-rank", cl.local_rank, "rank (started by the node agent): its local rank")->group("");
  app.add_flag("--spare", cl.spare, "rank (started by the node agent): a warm spare, given its local rank when it takes a rank's place")->group("");
  app.add_option("--spares", cl.spares,
                 "node: spare rank processes to keep started and warmed up, each taking the place of a rank process that exits "
                 "(default: the job's cluster.spare_ranks)")
      ->check(CLI::Range(0, 64));
  app.add_flag("--standby-node", cl.standby_node,
               "node: join as a standby node: wait outside the world, ranks started and warm, and take the place of a node the job "
               "loses (not --standby, which is the coordinator's)");
  app.add_option("--fail-at-step", cl.fail_at_step,
                 "node, for tests: after step N, local rank 0 injects the fault given by --fail-mode (default: off)");
  app.add_option("--preemption-notice", cl.preemption_notice,
                 "node: watch the cloud's metadata service (aws, gcp, azure, or auto: whichever answers) and leave at the next step "
                 "boundary on a spot/preemption notice")
      ->check(CLI::IsMember({"off", "aws", "gcp", "azure", "auto"}))
      ->capture_default_str();
  app.add_option("--azure-metadata-endpoint", cl.azure_metadata_endpoint,
                 "node: Azure instance metadata base URL (default http://169.254.169.254, or DTACTOR_AZURE_METADATA_ENDPOINT)");
  app.add_option("--preemption-poll-ms", cl.preemption_poll_ms, "node: how often the metadata service is asked (ms)")
      ->check(CLI::Range(50, 600000))
      ->capture_default_str();
  app.add_option("--fail-mode", fail_mode, "node, for tests: crash (kill -9 of the node), hang (SIGSTOP of the node), leave (SIGTERM), rank-crash, rank-oom (kill -9 of local rank 0 as it begins the step after N, in every process of it)")
      ->check(CLI::IsMember(fault_mode_names()))
      ->capture_default_str();
}

// The subcommands, bound to `p`'s fields.
struct subcommands {
  CLI::App *train, *eval, *exp, *tune, *cfgcmd, *report, *local, *keygen, *data_index;
};

// One function per subcommand: its options, bound to `p`'s fields.
CLI::App* add_train(CLI::App& app, parsed_cli& p) {
  auto* train = app.add_subcommand("train", "Train one model in this process (single process, all cores)");
  train->add_option("--config", p.config_path, "Job config file (TOML); defaults for every key otherwise");
  train->add_option("--set", p.overrides, "Override a config key: --set train.max_steps=200 (repeatable)")->allow_extra_args(false);
  train->add_option("--run-dir", p.run_dir, "Where the journal, logs and checkpoints go")->capture_default_str();
  train->add_option("--stop-at-step", p.stop_at, "Stop after this many completed steps, with a checkpoint, as a preemption would");
  train->add_flag("--no-resume", p.no_resume, "Start from scratch even if the run directory holds checkpoints");
  train->add_option("--resume-from", p.resume_from, "Resume from this checkpoint (a ckpt-*.manifest file, or a checkpoint directory: its newest valid one)");
  train->add_flag("--print-config", p.print_config, "Print the effective config as TOML and exit");
  return train;
}

CLI::App* add_eval(CLI::App& app, parsed_cli& p) {
  auto* eval = app.add_subcommand("eval", "Evaluate a checkpoint on the held-out data");
  eval->add_option("target", p.target, "A checkpoint (a ckpt-*.manifest file), a checkpoint directory, or a run directory (its newest valid checkpoint)")->required();
  eval->add_option("--config", p.config_path, "Config file (default: the config stored in the checkpoint)");
  eval->add_option("--set", p.overrides, "Override a config key (repeatable)")->allow_extra_args(false);
  return eval;
}

CLI::App* add_export(CLI::App& app, parsed_cli& p) {
  auto* exp = app.add_subcommand("export", "Write a checkpoint as a PyTorch file: the scripted module (torchscript jobs) or a state_dict");
  exp->add_option("target", p.target, "A checkpoint (a ckpt-*.manifest file), a checkpoint directory, or a run directory (its newest valid checkpoint)")->required();
  exp->add_option("--out", p.export_out, "The file to write (torch.jit.load / torch.load read it)")->required();
  exp->add_flag("--state-dict", p.export_state_dict, "Write a state_dict (torch.load) even for a torchscript job");
  return exp;
}

CLI::App* add_tune_batch(CLI::App& app, parsed_cli& p) {
  tune_batch_options& tb = p.tb;
  auto* tune = app.add_subcommand("tune-batch",
                                  "Find the largest per-rank micro-batch that fits a memory budget (doubling, then bisecting, one probe "
                                  "process per size); results go to the run's journal and log book");
  tune->add_option("--config", p.config_path, "Job config file (TOML)");
  tune->add_option("--set", p.overrides, "Override a config key (repeatable)")->allow_extra_args(false);
  tune->add_option("--run-dir", p.run_dir, "Whose journal and log book get the results (the run you will train in)")->capture_default_str();
  tune->add_option("--max-memory", p.tb_max_memory, "Memory one rank may use, e.g. 6G (default: MemAvailable less 10%, over --nproc-per-node)");
  tune->add_option("--nproc-per-node", tb.ranks_per_host, "Ranks that will share this machine's memory")->check(CLI::Range(1, 100000000))->capture_default_str();
  tune->add_option("--start", tb.start, "First micro-batch tried")->check(CLI::Range(1, 100000000))->capture_default_str();
  tune->add_option("--up-to", tb.up_to, "Largest micro-batch tried (default: train.global_batch_size)");
  tune->add_option("--steps", tb.steps, "Training steps per size (the first is not timed)")->check(CLI::Range(1, 100000000))->capture_default_str();
  tune->add_option("--max-trials", tb.max_trials, "Most sizes tried")->check(CLI::Range(1, 100000000))->capture_default_str();
  tune->add_option("--probe", p.tb_probe, "(internal) train this micro-batch and report peak memory")->group("");
  return tune;
}

CLI::App* add_config(CLI::App& app, parsed_cli& p) {
  auto* cfgcmd = app.add_subcommand("config", "Print the effective config (or, with --reference, every key with its default and meaning)");
  cfgcmd->add_option("--config", p.config_path, "Job config file (TOML)");
  cfgcmd->add_option("--set", p.overrides, "Override a config key (repeatable)")->allow_extra_args(false);
  cfgcmd->add_flag("--reference", p.reference, "List every key, its default and what it does");
  return cfgcmd;
}

CLI::App* add_report(CLI::App& app, parsed_cli& p) {
  auto* report = app.add_subcommand("report", "Write a Markdown log book of a run (config, metrics, time, memory, recoveries, loss curve)");
  report->add_option("run_dir", p.report_dir, "The run directory (holds journal.jsonl and config.toml)")->required();
  report->add_option("--out", p.report_out, "Markdown file to write (default RUN_DIR/report.md; loss.svg goes next to it)");
  return report;
}

CLI::App* add_local(CLI::App& app, parsed_cli& p) {
  cluster_cli& lc = p.local;
  lc.run_dir = "runs/local";
  auto* local = app.add_subcommand("local", "A whole cluster on this machine: a coordinator and N node processes over loopback");
  local->add_option("--nodes", lc.nodes, "Node processes to start")->capture_default_str();
  local->add_option("--nproc-per-node", lc.nproc_per_node, "Rank processes per node")->capture_default_str();
  local->add_option("--standby-nodes", lc.standby_nodes,
                    "Node processes started beside --nodes with --standby-node: each waits warm outside the world and takes the place of "
                    "a node the job loses")
      ->capture_default_str();
  local->add_option("--config", lc.config_path, "Job config file (TOML)");
  local->add_option("--set", lc.overrides, "Override a config key (repeatable)")->allow_extra_args(false);
  local->add_option("--run-dir", lc.run_dir, "Where the journal and checkpoints go")->capture_default_str();
  local->add_option("--metrics-port", lc.metrics_port,
                    "Coordinator's /metrics and status page port; node i uses the next ports (default: a free port on 127.0.0.1 for the "
                    "coordinator's status page alone)")
      ->check(CLI::Range(0, 65535));
  local->add_option("--metrics-addr", lc.metrics_addr, "Address the /metrics endpoints bind")->capture_default_str();
  local->add_flag("--no-resume", lc.no_resume, "Start over even if the run directory holds checkpoints");
  local->add_flag("--chaos", lc.chaos, "Kill a node with SIGKILL at intervals and start a replacement; print each recovery's figures");
  local->add_option("--chaos-every", lc.chaos_every_s, "With --chaos: seconds of training between a recovery and the next kill")
      ->check(CLI::Range(1.0, 86400.0))
      ->capture_default_str();
  // For tests: node 0 gets the fault (as `--role node --fail-at-step`).
  local->add_option("--fail-at-step", lc.fail_at_step, "for tests: node 0's --fail-at-step")->group("");
  local->add_option("--fail-mode", p.local_fail_mode, "for tests: node 0's --fail-mode")->check(CLI::IsMember(fault_mode_names()))->group("");
  return local;
}

CLI::App* add_keygen(CLI::App& app, parsed_cli& p) {
  auto* keygen = app.add_subcommand("keygen", "Write a new job key (CURVE keys for every ZeroMQ link, a MAC key for checkpoints; docs/security.md)");
  keygen->add_option("--out", p.keygen_out, "The key file to write (mode 0600; an existing file is not overwritten)")->required();
  return keygen;
}

// `data index` (the `data` group requires one of its subcommands).
CLI::App* add_data_index(CLI::App& app, parsed_cli& p) {
  auto* data = app.add_subcommand("data", "Sharded data sets (docs/data.md)");
  data->require_subcommand(1);
  auto* data_index = data->add_subcommand(
      "index", "Read every shard of SPEC once and write dtactor-shards.json (name, bytes, xxh3) beside them, in each directory or S3 prefix");
  data_index->add_option("spec", p.data_spec, "The shards: a glob, a {000..127} range or a comma-separated list of them, local or s3://")->required();
  data_index->add_option("--s3-endpoint", p.data_s3_endpoint, "S3-compatible endpoint for s3:// shards (default: $AWS_ENDPOINT_URL, else AWS)");
  return data_index;
}

// In the order `dtactor --help` lists them.
subcommands add_subcommands(CLI::App& app, parsed_cli& p) {
  subcommands s;
  s.train = add_train(app, p);
  s.eval = add_eval(app, p);
  s.exp = add_export(app, p);
  s.tune = add_tune_batch(app, p);
  s.cfgcmd = add_config(app, p);
  s.report = add_report(app, p);
  s.local = add_local(app, p);
  s.keygen = add_keygen(app, p);
  s.data_index = add_data_index(app, p);
  // Every process of a keyed job takes the same key file.
  const std::string key_help = "The job key file (dtactor keygen); default: $DTACTOR_KEY_FILE. Refused unless mode 0600";
  app.add_option("--key", p.key_path, key_help);
  for (auto* sub : {s.train, s.eval, s.exp, s.tune, s.local}) sub->add_option("--key", p.key_path, key_help);
  return s;
}

// The checks of counts and addresses CLI11 cannot make alone, before
// anything (a run directory, a key, a lock) is created: 0, or 2 with one
// line.
int check_arguments(const parsed_cli& p) {
  // The HTTP server binds IPv4 addresses (monitoring/http_server.cpp).
  const auto is_ipv4 = [](const std::string& a) {
    in_addr buf{};
    return ::inet_pton(AF_INET, a.c_str(), &buf) == 1;
  };
  for (const cluster_cli* c : {&p.cluster, &p.local})
    if (!is_ipv4(c->metrics_addr))
      return cli_fail("--metrics-addr '" + printable(c->metrics_addr) + "' is not an IPv4 address (e.g. 0.0.0.0 for every interface, or 127.0.0.1)", 2);
  if (p.cluster.standby_node && (p.command != cli_command::role || p.role != process_role::node))
    return cli_fail("--standby-node is a node's flag (--role node); a standby coordinator is --role coordinator --standby", 2);
  if (p.command == cli_command::local && p.local.metrics_port > 0 && p.local.metrics_port + p.local.nodes + p.local.standby_nodes > 65535)
    return cli_fail("--metrics-port " + std::to_string(p.local.metrics_port) + ": its " + std::to_string(p.local.nodes + p.local.standby_nodes) +
                        " nodes would use ports above 65535; choose a lower port", 2);
  const int most = max_compute_threads();
  for (const cluster_cli* c : {&p.cluster, &p.local})
    if (c->threads_per_rank > most)
      return cli_fail("--threads-per-rank " + std::to_string(c->threads_per_rank) + " is more than this machine can use (at most " +
                          std::to_string(most) + ")", 2);
  if (p.command == cli_command::local)
    if (auto why = local_arguments_problem(p.local); !why.empty()) return cli_fail(why, 2);
  if (const int64_t ranks = int64_t{p.local.nodes + p.local.standby_nodes} * p.local.nproc_per_node; p.command == cli_command::local && ranks > most)
    return cli_fail("dtactor local --nodes " + std::to_string(p.local.nodes) +
                        (p.local.standby_nodes > 0 ? " --standby-nodes " + std::to_string(p.local.standby_nodes) : "") + " --nproc-per-node " +
                        std::to_string(p.local.nproc_per_node) +
                        ": " + std::to_string(ranks) + " rank processes, more than this machine can run (at most " + std::to_string(most) + ")",
                    2);
  return 0;
}

// dtactor keygen --out FILE.
int run_keygen(const parsed_cli& p) {
  auto k = generate_job_key();
  if (!k) return cli_fail(k.message());
  if (auto st = write_job_key(p.keygen_out, k.value()); !st) return cli_fail(st.message());
  std::printf("wrote job key %s (mode 0600): give it to every process of the job with --key or DTACTOR_KEY_FILE\n", p.keygen_out.c_str());
  return 0;
}

// dtactor data index SPEC.
int run_data_index(const parsed_cli& p) {
  size_t places = 0;
  uint64_t bytes = 0;
  auto n = write_shard_index(p.data_spec, p.data_s3_endpoint, [&](const std::string& where, size_t shards, uint64_t b) {
    std::printf("indexed %zu shard(s), %llu bytes: %s\n", shards, static_cast<unsigned long long>(b), where.c_str());
    std::fflush(stdout);
    ++places;
    bytes += b;
  });
  if (!n) return cli_fail(n.message());
  std::printf("data index: %zu shard(s), %llu bytes, %zu index file(s) written; readers now check every shard's size and digest against them\n",
              n.value(), static_cast<unsigned long long>(bytes), places);
  return 0;
}

// The job key of every command that talks to a cluster or reads its
// checkpoints; `dtactor local` makes one in its run directory when none is
// given. Returns a non-zero exit code when the key is refused.
int take_job_key(parsed_cli& p) {
  cluster_cli &cl = p.cluster, &lc = p.local;
  auto key = resolve_job_key(p.key_path);
  if (!key) return cli_fail(key.message(), 2);
  p.key = key.value();
  if (!p.key && p.command == cli_command::local) {
    // A cluster on this machine gets a key of its own, kept in its run
    // directory (a later `dtactor local` on it, eval and export reuse it).
    if (auto st = ensure_writable_dir(lc.run_dir); !st) return cli_fail("run directory: " + st.message());
    std::error_code ec;
    const std::string path = lc.run_dir + "/job.key";
    if (!std::filesystem::exists(path, ec)) {
      auto fresh = generate_job_key();
      if (!fresh) return cli_fail(fresh.message());
      if (auto st = write_job_key(path, fresh.value()); !st) return cli_fail(st.message());
    }
    auto own = resolve_job_key(path);
    if (!own) return cli_fail(own.message(), 2);
    p.key = own.value();
  }
  cl.key = lc.key = p.key;
  if (p.key) set_checkpoint_mac_key(p.key->mac_key);
  return 0;
}

// dtactor config / report (no training, no cluster).
int run_tool(const parsed_cli& p) {
  if (p.command == cli_command::config) {
    if (p.reference) {
      std::fputs(config_reference().c_str(), stdout);
      return 0;
    }
    auto cfg = config::load(p.config_path, p.overrides);
    if (!cfg) return cli_fail(cfg.message(), 2);
    std::fputs(cfg->to_toml().c_str(), stdout);
    return 0;
  }

  if (p.command == cli_command::report) {
    auto r = write_report(p.report_dir, p.report_out);
    if (!r) return cli_fail(r.message());
    std::printf("wrote %s, %s and %s\n", r->markdown.c_str(), r->svg.c_str(), r->timeline.c_str());
    return 0;
  }
  return -1;
}

int run_cli(int argc, char** argv, const training_launcher& launcher) {
  use_the_cpus_blas_kernels(argv, false);  // may execute this program again (the journal's job_started names the kernels)
  wire::route_protobuf_logs();  // before any thread: a stranger's frames must not flood the log
  quiet_blas_workers();
  (void)raise_open_file_limit();
  CLI::App app{"dtactor: data-parallel LibTorch training that survives the loss of machines.\n"
               "Modes: train, eval, export, tune-batch, config, local, report, keygen, data, and --role coordinator|node."};
  app.require_subcommand(0, 1);

  parsed_cli p;
  cluster_cli& cl = p.cluster;
  std::string fail_mode = to_string(cl.fail_mode);
  add_role_options(app, p, fail_mode);
  const subcommands sub = add_subcommands(app, p);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return cli_fail(std::string(e.what()) + " (see dtactor --help)", 2);
  }
  cl.fail_mode = fault_mode_names().at(fail_mode);
  p.local.fail_mode = fault_mode_names().at(p.local_fail_mode);
  if (*sub.keygen) p.command = cli_command::keygen;
  if (*sub.data_index) p.command = cli_command::data_index;

  if (*sub.local) p.command = cli_command::local;
  else if (p.role != process_role::none) p.command = cli_command::role;
  else if (*sub.tune) p.command = cli_command::tune_batch;
  else if (*sub.cfgcmd) p.command = cli_command::config;
  else if (*sub.report) p.command = cli_command::report;
  else if (*sub.exp) p.command = cli_command::export_checkpoint;
  else if (*sub.eval) p.command = cli_command::eval;
  else if (*sub.train) p.command = cli_command::train;

  if (const int code = check_arguments(p); code != 0) return code;
  if (p.command == cli_command::keygen) return run_keygen(p);
  if (p.command == cli_command::data_index) return run_data_index(p);
  if (needs_training(p) || p.command == cli_command::local || p.command == cli_command::role)
    if (const int code = take_job_key(p); code != 0) return code;

  if (p.command == cli_command::role) {
    // A cluster started by `dtactor local` must not outlive it (kept across
    // the exec into dtactor-train).
    if (cl.die_with_parent) ::prctl(PR_SET_PDEATHSIG, SIGTERM);
  }
  if (needs_training(p)) return launcher(argc, argv, p);

  if (p.command == cli_command::local || p.command == cli_command::role) {
    install_stop_handlers();
    if (p.command == cli_command::local) {
      p.local.stop_signal = &g_stop;
      return run_local(p.local);
    }
    cl.stop_signal = &g_stop;
    if (p.role == process_role::coordinator) return run_coordinator(cl);
    if (p.role == process_role::node && cl.coordinator.empty() && std::getenv("MASTER_ADDR")) return run_static_node(cl);
    if (p.role == process_role::node && cl.coordinator.empty() && under_srun([](const char* k) { return std::getenv(k); })) return run_slurm_node(cl);
    return run_node(cl);
  }

  if (p.command == cli_command::config || p.command == cli_command::report) return run_tool(p);

  std::fputs(app.help().c_str(), stdout);
  return 0;
}

}  // namespace dtactor
