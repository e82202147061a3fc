#pragma once
// `dtactor train`, `eval` and `export`: the single-process commands over the
// training engine (model/trainer.hpp), with the run directory's journal,
// checkpoints and console progress. `train` runs the cluster rank's step
// loop (rank/rank_worker) at world 1, so every training feature exists once.
#include <atomic>
#include <optional>
#include <string>
#include <vector>

#include "model/trainer.hpp"
#include "dtactor/config.hpp"
#include "dtactor/result.hpp"

namespace dtactor {

struct train_options {
  std::string run_dir = "runs/default";
  // Stop after this many completed steps (checkpoint written), as a
  // preemption would; -1 = train to train.max_steps.
  int64_t stop_at_step = -1;
  bool resume = true;            // resume from the newest valid checkpoint in the checkpoint dir
  std::string resume_from;       // explicit checkpoint file (overrides `resume`)
  std::optional<bool> interactive;  // progress line; default: stderr is a terminal
  const std::atomic<int>* stop_signal = nullptr;  // non-zero: stop at the next step boundary
};

struct train_summary {
  int64_t step = 0;       // completed steps
  bool finished = false;  // reached train.max_steps
  int stop_signal = 0;    // the signal that stopped it early, if any
  std::string params_digest;
  eval_result last_eval;
  double wall_s = 0;
};

// `dtactor train`: trains to train.max_steps (or until stopped), resuming from
// the newest valid checkpoint, writing RUN_DIR/journal.jsonl, RUN_DIR/train.log,
// RUN_DIR/config.toml and checkpoints.
result<train_summary> run_training(const config& cfg, const train_options& opts);

// `dtactor eval`: evaluates a checkpoint (a file, or the newest valid one in a
// run directory's checkpoint folder) on the held-out data. The config is the
// one stored in the checkpoint unless config_path is given; overrides apply
// on top ("key=value").
result<eval_result> run_evaluation(const std::string& checkpoint_or_run_dir, const std::string& config_path,
                                   const std::vector<std::string>& overrides, int64_t* step_out);

// `dtactor export`: a checkpoint (as `eval` finds it) to PyTorch. For a
// torchscript job, the scripted module with the trained weights
// (torch.jit.load reads it); with `state_dict`, or for any other model, a
// file torch.load reads: {parameter or buffer name: tensor}, names and shapes
// as the module's state_dict().
struct export_summary {
  int64_t step = 0;
  std::string what;  // "scripted module" or "state_dict"
  int64_t tensors = 0;
};
result<export_summary> run_export(const std::string& checkpoint_or_run_dir, const std::string& out, bool state_dict);

}  // namespace dtactor
