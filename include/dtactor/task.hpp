#pragma once
// dtactor's public C++ API, part 1 of 2: a task (a model together with its
// data, its loss and its metrics) and how a program of your own registers one.
// Part 2 is dtactor/main.hpp (run_main). docs/cpp_api.md walks through it;
// examples/custom_task/ is a complete outside project.
//
// What the engine does with a task, and the rules a task must keep:
//
// * Construction. The factory you register is called once per rank process
//   (and by `dtactor train`, `eval`, `export`) with the job's effective
//   config, on the thread that will train, after torch::manual_seed(
//   train.seed). Build the module and open the data there. Every rank must
//   build the same initial parameters: draw them from torch's default
//   generator only (the engine seeded it), never from a clock or
//   std::random_device. Errors a user can cause (a missing file, a bad
//   setting) are returned as one line (make_error), not thrown.
//
// * Threads. Every method is called from that one training thread; the
//   engine never calls a task concurrently. Do not start threads that touch
//   the module. LibTorch's intra-op pool is set up by the engine
//   (train.threads).
//
// * Data order. The engine picks the samples: loss_sum gets the indices of
//   this rank's slice of a global step (a keyed permutation of
//   [0, train_size()) per epoch, from train.seed). The same index must always
//   mean the same sample, on every rank and after a restart: data is a pure
//   function of the index (and the config), never of call order.
//
// * Determinism. Before each forward pass the engine reseeds torch's default
//   generator from (seed, step, rank), so dropout and other torch randomness
//   in loss_sum is reproducible and resumes exactly. Randomness of your own
//   (std::mt19937 in a member, say) is not in checkpoints and breaks exact
//   resume: take it from torch's generator.
//
// * State. What is checkpointed and sent to a replacement rank is the
//   module's parameters and buffers (module()->named_parameters(),
//   named_buffers()), the optimizer's state and the data position. A task
//   must keep no other state that changes during training.
//
// * Loss. loss_sum returns the *sum* over the given samples of each sample's
//   own loss (forward only, a scalar tensor). The engine divides by the
//   global batch size and runs backward, so the gradient does not depend on
//   how a global batch is split over ranks and micro-batches.
#include <torch/torch.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dtactor/config.hpp"
#include "dtactor/param_gate.hpp"
#include "dtactor/result.hpp"

namespace dtactor {

struct eval_result {
  std::map<std::string, double> metrics;  // e.g. accuracy, val_loss, perplexity, exact_match
  std::vector<std::string> examples;      // human-readable samples (e.g. greedy translations)
};

class task {
 public:
  virtual ~task() = default;
  // A short name for logs (usually model.name).
  virtual std::string name() const = 0;
  // The module that is trained: its parameters get the gradients and the
  // optimizer, its parameters and buffers are the checkpointed state.
  virtual std::shared_ptr<torch::nn::Module> module() = 0;
  // Number of training samples; indices passed to loss_sum are in [0, train_size()).
  virtual int64_t train_size() const = 0;
  // Number of held-out samples used by evaluate().
  virtual int64_t eval_size() const = 0;
  // Sum over the given training samples of each sample's own loss (a
  // sequence's loss is the mean over its target tokens). Forward only; the
  // engine divides by the global batch size and runs backward, so that the
  // gradient does not depend on how a global batch is split.
  virtual torch::Tensor loss_sum(const std::vector<int64_t>& indices) = 0;
  // Evaluates on the first max_samples held-out samples (0 = all), in
  // batches of at most batch_size. The caller has put the module in eval mode
  // and disabled gradients. The metrics go to the journal, Prometheus and the
  // log book under their names; the registration's main_metric must be one
  // of them.
  virtual eval_result evaluate(int64_t max_samples, int64_t batch_size) = 0;
  // A task whose module is a TorchScript module writes it (with the current
  // weights) to `path` and returns true; others return false (`dtactor
  // export` then writes a state_dict).
  virtual bool save_scripted(const std::string& path) { (void)path; return false; }
  // Whether training changes the module's buffers (BatchNorm's running
  // statistics): the data-parallel engine then gives every rank global rank
  // 0's after each step, as PyTorch DDP's broadcast_buffers does.
  virtual bool buffers_change_in_training() const { return false; }
  // train.zero = 3 (dtactor/param_gate.hpp): the modules whose parameters
  // are gathered together, in the order forward runs them; each runs its
  // computation through gated(unit.slot, ...). None (the default): every
  // parameter stays resident on every rank, as at train.zero = 2.
  virtual std::vector<param_unit> param_units() { return {}; }
  // Sharded data (docs/data.md, dtactor/shards.hpp): the number of
  // training samples in each shard, in index order (the indices of shard k
  // follow those of shard k - 1; the sum is train_size()). Called once,
  // after construction; it must be the same on every rank (take it from
  // shard_set::records(), not from what a rank happened to parse). When not
  // empty, the engine's order permutes the shards each epoch and shuffles
  // the samples within blocks of data.shuffle_block_shards consecutive
  // shards, so that a step reads from a few shards only and the next ones
  // can be fetched while it trains. Empty (the default): one permutation
  // over all samples.
  virtual std::vector<int64_t> train_shard_samples() const { return {}; }
  // Sharded data: before each step, the shards the next steps read, most
  // urgent first (this step's block, then data.read_ahead_blocks more).
  // Hand them to shard_set::read_ahead and let go of every other shard (its
  // shard_data and what was parsed from it): the bytes a task holds stay
  // bounded, and the cache may evict what is no longer held.
  virtual void upcoming_shards(const std::vector<int64_t>& shards) { (void)shards; }
  // Sharded data: before each step, the sample indices this rank's next
  // step will most likely ask loss_sum for (if the world does not change
  // meanwhile). A task whose samples cost time to decode (images) may
  // prepare them on a thread of its own, touching no module and no torch
  // state; loss_sum must give the same result whether it did or not.
  virtual void upcoming_samples(const std::vector<int64_t>& indices) { (void)indices; }
};

// A task of your own, selected by `model.name = "<name>"`.
struct task_registration {
  // Lower-case letters, digits and '_'; not vit, transformer, gpt, torchscript.
  std::string name;
  // One line, shown by `config --reference` under model.name.
  std::string description;
  // The metric (a key of evaluate()'s metrics) that ranks checkpoints for
  // checkpoint.keep_best; a name containing "loss", or "perplexity", means
  // lower is better.
  std::string main_metric = "val_loss";
  // The task's own settings, each under "model." (part of the architecture a
  // checkpoint is checked against when resuming) or "data.", with a default
  // written as after `--set key=`. They are then accepted in TOML and
  // --set, listed by `config --reference`, and read with cfg.get_int() etc.
  std::vector<config_key> keys;
  // Keys (yours or built-in string keys) whose value is a file every node
  // must hold identically: relative paths are made absolute where dtactor
  // starts, and every rank compares the files' size and XXH3 with the
  // coordinator's before training; a node with a different file is refused.
  // A value that names shards (a glob, a range, a list, s3://;
  // dtactor/shards.hpp) has each local item made absolute, and the digest
  // compared is the whole set's (names, sizes, the shard index's digests).
  std::vector<std::string> file_keys;
  // Builds the task (see the rules above).
  std::function<result<std::unique_ptr<task>>(const config&)> make;
};

// Registers a task. Call it from main() before run_main(), once per task; not
// thread-safe. An invalid registration (bad name, a key that exists or is
// outside model./data., a default that does not parse) is an error.
status register_task(task_registration registration);

// Builds the task named by model.name (a built-in model or a registered
// one), loading its data. Errors (missing data file, impossible shape) come
// back as one clear line.
result<std::unique_ptr<task>> make_task(const config& cfg);

// The built-in models (not part of the API).
result<std::unique_ptr<task>> make_vit_task(const config& cfg);
result<std::unique_ptr<task>> make_transformer_task(const config& cfg);
result<std::unique_ptr<task>> make_gpt_task(const config& cfg);
result<std::unique_ptr<task>> make_torchscript_task(const config& cfg);

}  // namespace dtactor
