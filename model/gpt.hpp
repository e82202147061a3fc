#pragma once
// Byte-level decoder-only language model (GPT) over GCIDE text
// (model/text_data.hpp), and its task.
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "model/layers.hpp"
#include "dtactor/task.hpp"
#include "model/text_data.hpp"
#include "job/settings.hpp"

namespace dtactor {

struct gpt_options {
  int64_t vocab = 256;  // bytes
  int64_t dim = 64;
  int64_t layers = 4;
  int64_t heads = 4;
  double mlp_ratio = 4.0;
  double dropout = 0.0;
  int64_t context = 128;  // longest input
  bool checkpointed = false;
};

// Pre-LayerNorm causal Transformer: learned positions, final LayerNorm, head
// tied to the token embedding.
struct gpt_impl : torch::nn::Module {
  explicit gpt_impl(const gpt_options& o);
  // ids: [B,T] int64 with T <= context -> logits [B,T,vocab].
  torch::Tensor forward(const torch::Tensor& ids);
  // Greedy continuation: `count` more bytes after `prompt` (the input is cut
  // to the last `context` bytes at every step).
  std::string generate(const std::string& prompt, int64_t count);

  gpt_options opts;
  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE_IMPL(gpt, gpt_impl);

// Next-byte prediction. Sample i is the window of context + 1 bytes starting
// at byte i * context of the training text (consecutive windows share one
// byte, so every byte but the first is a target exactly once).
class gpt_task : public task {
 public:
  // Reads model.*, train.activation_checkpointing; the module is initialised
  // from the current torch seed. Both texts must hold at least one window.
  gpt_task(const job_settings& s, text_corpus corpus);

  std::string name() const override { return "gpt"; }
  std::shared_ptr<torch::nn::Module> module() override { return model_.ptr(); }
  std::vector<param_unit> param_units() override { return block_units(model_->blocks, "blocks"); }
  int64_t train_size() const override { return windows(train_); }
  int64_t eval_size() const override { return windows(held_out_); }
  torch::Tensor loss_sum(const std::vector<int64_t>& indices) override;
  // Metrics: val_loss (mean over held-out windows of each window's mean
  // next-byte cross-entropy, in nats) and perplexity = exp(val_loss).
  // Example: a greedy continuation of a fixed prompt.
  eval_result evaluate(int64_t max_samples, int64_t batch_size) override;

  gpt& model() { return model_; }
  int64_t context() const { return context_; }

  // The prompt of the example continuation.
  static constexpr const char* prompt = "Water, n.\n";

 private:
  int64_t windows(const torch::Tensor& text) const;
  // Windows [B, context + 1] (int64) of `text` starting at index * context.
  torch::Tensor gather(const torch::Tensor& text, const torch::Tensor& starts) const;
  // Per-window mean next-byte loss [B].
  torch::Tensor window_losses(const torch::Tensor& windows);

  int64_t context_;
  torch::Tensor train_, held_out_;  // uint8 [N]
  gpt model_{nullptr};
};

// Makes text printable on one line as valid UTF-8 ("\n" shown as "\\n").
std::string printable_line(const std::string& bytes);

}  // namespace dtactor
