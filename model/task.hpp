#pragma once
// A task is a model together with its data and its loss: what the training
// engine needs to train and evaluate one of dtactor's models, whatever it is.
#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "runtime/config.hpp"
#include "runtime/job_config.hpp"
#include "runtime/result.hpp"

namespace dtactor {

struct eval_result {
  std::map<std::string, double> metrics;  // e.g. accuracy, val_loss, perplexity, exact_match
  std::vector<std::string> examples;      // human-readable samples (e.g. greedy translations)
};

class task {
 public:
  virtual ~task() = default;
  virtual std::string name() const = 0;
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
  // Evaluates on the first max_samples held-out samples (0 = all). The caller
  // has put the module in eval mode and disabled gradients.
  virtual eval_result evaluate(int64_t max_samples, int64_t batch_size) = 0;
  // Metric that ranks checkpoints by default, and its direction.
  virtual std::string main_metric() const = 0;
  // A task whose module is a TorchScript module writes it (with the current
  // weights) to `path` and returns true; others return false.
  virtual bool save_scripted(const std::string& path) { (void)path; return false; }
  // Whether training changes the module's buffers (BatchNorm's running
  // statistics): the data-parallel engine then gives every rank global rank
  // 0's after each step, as PyTorch DDP's broadcast_buffers does.
  virtual bool buffers_change_in_training() const { return false; }
};


// Builds the task named by model.name, loading its data. Errors (missing data
// file, impossible shape) come back as one clear line.
result<std::unique_ptr<task>> make_task(const config& cfg);

result<std::unique_ptr<task>> make_vit_task(const config& cfg);
result<std::unique_ptr<task>> make_transformer_task(const config& cfg);
result<std::unique_ptr<task>> make_gpt_task(const config& cfg);
// model.name = torchscript (model/torchscript_task.cpp).
result<std::unique_ptr<task>> make_torchscript_task(const config& cfg);

}  // namespace dtactor
