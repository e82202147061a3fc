// dtactor's command line (dtactor::run_main, the API's entry point): parses
// arguments (CLI11) and hands over to the libraries. Exit codes: 0 done, 1 the job failed, 2 bad command line or
// config, 128+N stopped by signal N (after a checkpoint).
#include <CLI/CLI.hpp>

#include <atomic>
#include <sys/prctl.h>

#include <csignal>
#include <cstdlib>
#include <cstdio>
#include <string>
#include <vector>

#include "app/cluster.hpp"
#include "dtactor/main.hpp"
#include "rank/train_command.hpp"
#include "rank/tune_batch.hpp"
#include "monitoring/report.hpp"
#include "runtime/blas_info.hpp"
#include "dtactor/config.hpp"

namespace {

std::atomic<int> g_stop{0};

extern "C" void on_stop_signal(int sig) {
  if (g_stop.exchange(sig) != 0) {
    // Second signal: the user insists; stop now.
    std::signal(sig, SIG_DFL);
    std::raise(sig);
  }
}

int fail(const std::string& message, int code = 1) {
  std::fprintf(stderr, "dtactor: %s\n", message.c_str());
  return code;
}

std::string config_reference() {
  std::string out = "Config keys (TOML sections = the part before the dot; override any with --set key=value):\n";
  for (const auto& k : dtactor::config_schema()) {
    out += "  " + k.name + " = " + (k.kind == dtactor::value_kind::string ? "\"" + k.default_value + "\"" : k.default_value) + "\n      " + k.doc + "\n";
  }
  return out;
}

}  // namespace

int dtactor::run_main(int argc, char** argv) {
  dtactor::quiet_blas_workers();
  CLI::App app{"dtactor: data-parallel LibTorch training that survives the loss of machines.\n"
               "Modes: train, eval, export, tune-batch, config, local, report, and --role coordinator|node."};
  app.require_subcommand(0, 1);

  std::string role;
  dtactor::cluster_cli cl;
  app.add_option("--role", role, "Run as a cluster process: coordinator or node")->check(CLI::IsMember({"coordinator", "node", "rank"}));
  app.add_option("--listen", cl.listen, "coordinator: address to bind")->capture_default_str();
  app.add_option("--coordinator", cl.coordinator, "node: the coordinator's address, e.g. tcp://COORD_HOST:29400");
  app.add_option("--nproc-per-node", cl.nproc_per_node, "node: rank processes to start (one per device)")->capture_default_str();
  app.add_option("--metrics-port", cl.metrics_port, "Port of the Prometheus /metrics endpoint (0 = none)");
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
  app.add_flag("--die-with-parent", cl.die_with_parent, "stop when the parent process ends (set by dtactor local)")->group("");
  app.add_option("--node-endpoint", cl.node_endpoint, "rank (started by the node agent): the node's ipc endpoint")->group("");
  app.add_option("--local-rank", cl.local_rank, "rank (started by the node agent): its local rank")->group("");
  app.add_option("--fail-at-step", cl.fail_at_step,
                 "node, for tests: after step N, local rank 0 injects the fault given by --fail-mode (default: off)");
  std::string fail_mode = to_string(cl.fail_mode);
  app.add_option("--fail-mode", fail_mode, "node, for tests: crash (kill -9 of the node), hang (SIGSTOP of the node), leave (SIGTERM), rank-crash")
      ->check(CLI::IsMember(fault_mode_names()))
      ->capture_default_str();

  std::string config_path, run_dir = "runs/default", resume_from, target;
  std::vector<std::string> overrides;
  int64_t stop_at = -1;
  bool no_resume = false, print_config = false, reference = false;

  auto* train = app.add_subcommand("train", "Train one model in this process (single process, all cores)");
  train->add_option("--config", config_path, "Job config file (TOML); defaults for every key otherwise");
  train->add_option("--set", overrides, "Override a config key: --set train.max_steps=200 (repeatable)")->allow_extra_args(false);
  train->add_option("--run-dir", run_dir, "Where the journal, logs and checkpoints go")->capture_default_str();
  train->add_option("--stop-at-step", stop_at, "Stop after this many completed steps, with a checkpoint, as a preemption would");
  train->add_flag("--no-resume", no_resume, "Start from scratch even if the run directory holds checkpoints");
  train->add_option("--resume-from", resume_from, "Resume from this checkpoint (a ckpt-*.manifest file, or a checkpoint directory: its newest valid one)");
  train->add_flag("--print-config", print_config, "Print the effective config as TOML and exit");

  auto* eval = app.add_subcommand("eval", "Evaluate a checkpoint on the held-out data");
  eval->add_option("target", target, "A checkpoint (a ckpt-*.manifest file), a checkpoint directory, or a run directory (its newest valid checkpoint)")->required();
  eval->add_option("--config", config_path, "Config file (default: the config stored in the checkpoint)");
  eval->add_option("--set", overrides, "Override a config key (repeatable)")->allow_extra_args(false);

  std::string export_out;
  bool export_state_dict = false;
  auto* exp = app.add_subcommand("export", "Write a checkpoint as a PyTorch file: the scripted module (torchscript jobs) or a state_dict");
  exp->add_option("target", target, "A checkpoint (a ckpt-*.manifest file), a checkpoint directory, or a run directory (its newest valid checkpoint)")->required();
  exp->add_option("--out", export_out, "The file to write (torch.jit.load / torch.load read it)")->required();
  exp->add_flag("--state-dict", export_state_dict, "Write a state_dict (torch.load) even for a torchscript job");

  std::string tb_max_memory;
  int64_t tb_probe = 0;
  dtactor::tune_batch_options tb;
  auto* tune = app.add_subcommand("tune-batch",
                                  "Find the largest per-rank micro-batch that fits a memory budget (doubling, then bisecting, one probe "
                                  "process per size); results go to the run's journal and log book");
  tune->add_option("--config", config_path, "Job config file (TOML)");
  tune->add_option("--set", overrides, "Override a config key (repeatable)")->allow_extra_args(false);
  tune->add_option("--run-dir", run_dir, "Whose journal and log book get the results (the run you will train in)")->capture_default_str();
  tune->add_option("--max-memory", tb_max_memory, "Memory one rank may use, e.g. 6G (default: MemAvailable less 10%, over --nproc-per-node)");
  tune->add_option("--nproc-per-node", tb.ranks_per_host, "Ranks that will share this machine's memory")->check(CLI::Range(1, 100000000))->capture_default_str();
  tune->add_option("--start", tb.start, "First micro-batch tried")->check(CLI::Range(1, 100000000))->capture_default_str();
  tune->add_option("--up-to", tb.up_to, "Largest micro-batch tried (default: train.global_batch_size)");
  tune->add_option("--steps", tb.steps, "Training steps per size (the first is not timed)")->check(CLI::Range(1, 100000000))->capture_default_str();
  tune->add_option("--max-trials", tb.max_trials, "Most sizes tried")->check(CLI::Range(1, 100000000))->capture_default_str();
  tune->add_option("--probe", tb_probe, "(internal) train this micro-batch and report peak memory")->group("");

  auto* cfgcmd = app.add_subcommand("config", "Print the effective config (or, with --reference, every key with its default and meaning)");
  cfgcmd->add_option("--config", config_path, "Job config file (TOML)");
  cfgcmd->add_option("--set", overrides, "Override a config key (repeatable)")->allow_extra_args(false);
  cfgcmd->add_flag("--reference", reference, "List every key, its default and what it does");

  std::string report_dir, report_out;
  auto* report = app.add_subcommand("report", "Write a Markdown log book of a run (config, metrics, time, memory, recoveries, loss curve)");
  report->add_option("run_dir", report_dir, "The run directory (holds journal.jsonl and config.toml)")->required();
  report->add_option("--out", report_out, "Markdown file to write (default RUN_DIR/report.md; loss.svg goes next to it)");

  dtactor::cluster_cli lc;
  lc.run_dir = "runs/local";
  auto* local = app.add_subcommand("local", "A whole cluster on this machine: a coordinator and N node processes over loopback");
  local->add_option("--nodes", lc.nodes, "Node processes to start")->capture_default_str();
  local->add_option("--nproc-per-node", lc.nproc_per_node, "Rank processes per node")->capture_default_str();
  local->add_option("--config", lc.config_path, "Job config file (TOML)");
  local->add_option("--set", lc.overrides, "Override a config key (repeatable)")->allow_extra_args(false);
  local->add_option("--run-dir", lc.run_dir, "Where the journal and checkpoints go")->capture_default_str();
  local->add_option("--metrics-port", lc.metrics_port, "Coordinator's /metrics port; node i uses the next ports (0 = none)");
  local->add_option("--metrics-addr", lc.metrics_addr, "Address the /metrics endpoints bind")->capture_default_str();
  local->add_flag("--no-resume", lc.no_resume, "Start over even if the run directory holds checkpoints");

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return fail(std::string(e.what()) + " (see dtactor --help)", 2);
  }
  cl.fail_mode = fault_mode_names().at(fail_mode);

  if (*local || !role.empty()) {
    std::signal(SIGINT, on_stop_signal);
    std::signal(SIGTERM, on_stop_signal);
    if (*local) {
      lc.stop_signal = &g_stop;
      return dtactor::run_local(lc);
    }
    cl.stop_signal = &g_stop;
    // A cluster started by `dtactor local` must not outlive it.
    if (cl.die_with_parent) ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (role == "coordinator") return dtactor::run_coordinator(cl);
    if (role == "node" && cl.coordinator.empty() && std::getenv("MASTER_ADDR")) return dtactor::run_static_node(cl);
    if (role == "node") return dtactor::run_node(cl);
    return dtactor::run_rank(cl);
  }

  if (*tune) {
    auto cfg = dtactor::config::load(config_path, overrides);
    if (!cfg) return fail(cfg.message(), 2);
    dtactor::absolutize_data_paths(cfg.value());
    if (tb_probe > 0) return dtactor::run_batch_probe(cfg.value(), tb_probe, tb.steps);
    if (!tb_max_memory.empty()) {
      auto b = dtactor::parse_bytes(tb_max_memory);
      if (!b) return fail("--max-memory: " + b.message(), 2);
      tb.max_memory = b.value();
    }
    std::signal(SIGINT, on_stop_signal);
    std::signal(SIGTERM, on_stop_signal);
    tb.run_dir = run_dir;
    tb.stop_signal = &g_stop;
    if (!config_path.empty()) tb.probe_args = {"--config", config_path};
    for (const auto& o : overrides) {
      tb.probe_args.push_back("--set");
      tb.probe_args.push_back(o);
    }
    auto r = dtactor::run_tune_batch(cfg.value(), tb);
    if (!r) return fail(r.message());
    std::printf("largest micro-batch that fits in %.2f GiB per rank: %lld%s\nuse it with --set train.micro_batch_size=%lld "
                "(results in %s/journal.jsonl; `dtactor report %s` shows them)\n",
                static_cast<double>(r->max_memory) / (1024.0 * 1024 * 1024), static_cast<long long>(r->micro_batch),
                r->limited_by_up_to ? " (every size tried fit: raise --up-to to look further)" : "", static_cast<long long>(r->micro_batch),
                run_dir.c_str(), run_dir.c_str());
    return 0;
  }

  if (*cfgcmd) {
    if (reference) {
      std::fputs(config_reference().c_str(), stdout);
      return 0;
    }
    auto cfg = dtactor::config::load(config_path, overrides);
    if (!cfg) return fail(cfg.message(), 2);
    std::fputs(cfg->to_toml().c_str(), stdout);
    return 0;
  }

  if (*report) {
    auto r = dtactor::write_report(report_dir, report_out);
    if (!r) return fail(r.message());
    std::printf("wrote %s and %s\n", r->markdown.c_str(), r->svg.c_str());
    return 0;
  }

  if (*exp) {
    auto r = dtactor::run_export(target, export_out, export_state_dict);
    if (!r) return fail(r.message());
    std::printf("wrote %s: %s of step %lld (%lld tensors)\n", export_out.c_str(), r->what.c_str(), static_cast<long long>(r->step),
                static_cast<long long>(r->tensors));
    return 0;
  }

  if (*eval) {
    int64_t step = 0;
    auto r = dtactor::run_evaluation(target, config_path, overrides, &step);
    if (!r) return fail(r.message());
    std::printf("step %lld", static_cast<long long>(step));
    for (const auto& [k, v] : r->metrics) std::printf(" %s=%.6f", k.c_str(), v);
    std::printf("\n");
    for (const auto& ex : r->examples) std::printf("  %s\n", ex.c_str());
    return 0;
  }

  if (*train) {
    auto cfg = dtactor::config::load(config_path, overrides);
    if (!cfg) return fail(cfg.message(), 2);
    dtactor::absolutize_data_paths(cfg.value());
    if (auto st = dtactor::validate_training_config(cfg.value()); !st) return fail(st.message(), 2);
    if (print_config) {
      std::fputs(cfg->to_toml().c_str(), stdout);
      return 0;
    }
    std::signal(SIGINT, on_stop_signal);
    std::signal(SIGTERM, on_stop_signal);
    dtactor::train_options opts;
    opts.run_dir = run_dir;
    opts.stop_at_step = stop_at;
    opts.resume = !no_resume;
    opts.resume_from = resume_from;
    opts.stop_signal = &g_stop;
    auto r = dtactor::run_training(cfg.value(), opts);
    if (!r) return fail(r.message());
    std::printf("%s at step %lld:", r->finished ? "finished" : "stopped", static_cast<long long>(r->step));
    for (const auto& [k, v] : r->last_eval.metrics) std::printf(" %s=%.4f", k.c_str(), v);
    std::printf(" params_digest=%s wall_s=%.1f\n", r->params_digest.c_str(), r->wall_s);
    if (r->stop_signal) return 128 + r->stop_signal;
    return 0;
  }

  std::fputs(app.help().c_str(), stdout);
  return 0;
}
