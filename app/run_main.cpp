// run_main (the C++ API's entry point, dtactor/main.hpp): the
// command line of app/cli.hpp with the training commands run in this
// process. The `dtactor-train` binary and every program built on the API
// are run_main.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "app/cli.hpp"
#include "app/cluster.hpp"
#include "dtactor/config.hpp"
#include "dtactor/main.hpp"
#include "app/train_command.hpp"
#include "app/tune_batch.hpp"
#include "job/job_config.hpp"

namespace dtactor {

namespace {

int fail(const std::string& message, int code = 1) { return cli_fail(message, code); }

// The internal `--role rank` (started by a node agent).
int rank_command(const parsed_cli& p) {
  install_stop_handlers();
  cluster_cli cl = p.cluster;
  cl.stop_signal = stop_flag();
  return run_rank(cl);
}

// `tune-batch`, and its internal `--probe` (one size, in a child process).
int tune_batch_command(const parsed_cli& p) {
  auto cfg = config::load(p.config_path, p.overrides);
  if (!cfg) return fail(cfg.message(), 2);
  absolutize_data_paths(cfg.value());
  if (p.tb_probe > 0) return run_batch_probe(cfg.value(), p.tb_probe, p.tb.steps);
  tune_batch_options tb = p.tb;
  if (!p.tb_max_memory.empty()) {
    auto b = parse_bytes(p.tb_max_memory);
    if (!b) return fail("--max-memory: " + b.message(), 2);
    tb.max_memory = b.value();
  }
  install_stop_handlers();
  tb.run_dir = p.run_dir;
  tb.stop_signal = stop_flag();
  // Each probe reads the same config as this process.
  if (!p.config_path.empty()) tb.probe_args = {"--config", p.config_path};
  for (const auto& o : p.overrides) {
    tb.probe_args.push_back("--set");
    tb.probe_args.push_back(o);
  }
  auto r = run_tune_batch(cfg.value(), tb);
  if (!r) return fail(r.message());
  std::printf("largest micro-batch that fits in %.2f GiB per rank: %lld%s\nuse it with --set train.micro_batch_size=%lld "
              "(results in %s/journal.jsonl; `dtactor report %s` shows them)\n",
              static_cast<double>(r->max_memory) / (1024.0 * 1024 * 1024), static_cast<long long>(r->micro_batch),
              r->limited_by_up_to ? " (every size tried fit: raise --up-to to look further)" : "", static_cast<long long>(r->micro_batch),
              p.run_dir.c_str(), p.run_dir.c_str());
  return 0;
}

int export_command(const parsed_cli& p) {
  auto r = run_export(p.target, p.export_out, p.export_state_dict);
  if (!r) return fail(r.message());
  std::printf("wrote %s: %s of step %lld (%lld tensors)\n", p.export_out.c_str(), r->what.c_str(), static_cast<long long>(r->step),
              static_cast<long long>(r->tensors));
  return 0;
}

int eval_command(const parsed_cli& p) {
  int64_t step = 0;
  auto r = run_evaluation(p.target, p.config_path, p.overrides, &step);
  if (!r) return fail(r.message());
  std::printf("step %lld", static_cast<long long>(step));
  for (const auto& [k, v] : r->metrics) std::printf(" %s=%.6f", k.c_str(), v);
  std::printf("\n");
  for (const auto& ex : r->examples) std::printf("  %s\n", ex.c_str());
  return 0;
}

// `train`; exits 128 + N when signal N stopped it.
int train_command(const parsed_cli& p) {
  auto cfg = config::load(p.config_path, p.overrides);
  if (!cfg) return fail(cfg.message(), 2);
  absolutize_data_paths(cfg.value());
  if (auto st = validate_training_config(cfg.value()); !st) return fail(st.message(), 2);
  if (p.print_config) {
    std::fputs(cfg->to_toml().c_str(), stdout);
    return 0;
  }
  install_stop_handlers();
  train_options opts;
  opts.run_dir = p.run_dir;
  opts.stop_at_step = p.stop_at;
  opts.resume = !p.no_resume;
  opts.resume_from = p.resume_from;
  opts.stop_signal = stop_flag();
  auto r = run_training(cfg.value(), opts);
  if (!r) return fail(r.message());
  std::printf("%s at step %lld:", r->finished ? "finished" : "stopped", static_cast<long long>(r->step));
  for (const auto& [k, v] : r->last_eval.metrics) std::printf(" %s=%.4f", k.c_str(), v);
  std::printf(" params_digest=%s wall_s=%.1f\n", r->params_digest.c_str(), r->wall_s);
  if (r->stop_signal) return 128 + r->stop_signal;
  return 0;
}

// The commands that need LibTorch, run in this process; the exit code.
int run_training_command(const parsed_cli& p) {
  switch (p.command) {
    case cli_command::role: return rank_command(p);
    case cli_command::tune_batch: return tune_batch_command(p);
    case cli_command::export_checkpoint: return export_command(p);
    case cli_command::eval: return eval_command(p);
    case cli_command::train: return train_command(p);
    default: return cli_fail("internal: not a training command", 2);
  }
}

}  // namespace

int run_main(int argc, char** argv) {
  return run_cli(argc, argv, [](int, char**, const parsed_cli& p) { return run_training_command(p); });
}

}  // namespace dtactor
