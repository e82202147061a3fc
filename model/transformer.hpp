#pragma once
// Character-level Transformer encoder-decoder that translates English words
// into Italian (FreeDict pairs, model/text_data.hpp), and its task.
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "model/layers.hpp"
#include "dtactor/task.hpp"
#include "model/text_data.hpp"
#include "job/settings.hpp"

namespace dtactor {

// Characters (Unicode code points) of the training pairs, both languages in
// one table, after four special ids. A pure function of the pairs' text.
class char_vocab {
 public:
  static constexpr int64_t pad = 0, bos = 1, eos = 2, unk = 3;

  explicit char_vocab(const std::vector<word_pair>& pairs);
  int64_t size() const { return static_cast<int64_t>(chars_.size()) + 4; }
  // Ids of the characters of s; unknown characters become unk.
  std::vector<int64_t> encode(std::string_view s) const;
  // Text of the ids up to the first eos; specials other than unk are skipped,
  // unk is written as U+FFFD.
  std::string decode(const std::vector<int64_t>& ids) const;

 private:
  std::vector<uint32_t> chars_;
  std::unordered_map<uint32_t, int64_t> ids_;
};

struct seq2seq_options {
  int64_t vocab = 0;
  int64_t dim = 64;
  int64_t layers = 2;  // encoder and decoder each
  int64_t heads = 4;
  double mlp_ratio = 4.0;
  double dropout = 0.0;
  int64_t max_len = 64;  // longest sequence, specials included
  bool checkpointed = false;
};

// Pre-LayerNorm encoder-decoder; sinusoidal positions; one embedding table
// shared by source, target and the output projection (weight tying).
struct seq2seq_impl : torch::nn::Module {
  explicit seq2seq_impl(const seq2seq_options& o);
  // src: [B,S] ids (pad = char_vocab::pad) -> memory [B,S,D].
  torch::Tensor encode(const torch::Tensor& src);
  // tgt_in: [B,T] ids starting with bos -> logits [B,T,V].
  torch::Tensor decode(const torch::Tensor& tgt_in, const torch::Tensor& memory, const torch::Tensor& src);
  // The decoder's final hidden states [B,T,D] (before the output projection).
  torch::Tensor decode_hidden(const torch::Tensor& tgt_in, const torch::Tensor& memory, const torch::Tensor& src);
  torch::Tensor forward(const torch::Tensor& src, const torch::Tensor& tgt_in);
  // Greedy decoding of a batch; each row's ids end before its eos (or after
  // max_steps tokens).
  std::vector<std::vector<int64_t>> greedy(const torch::Tensor& src, int64_t max_steps);

  seq2seq_options opts;
  torch::nn::Embedding tok{nullptr};
  torch::nn::ModuleList encoder{nullptr}, decoder{nullptr};
  torch::nn::LayerNorm enc_norm{nullptr}, dec_norm{nullptr};
  torch::Tensor positions;  // buffer [max_len, D]

 private:
  torch::Tensor embed(const torch::Tensor& ids);
};
TORCH_MODULE_IMPL(seq2seq, seq2seq_impl);

// English -> Italian translation task. Sample i is the i-th training pair.
class transformer_task : public task {
 public:
  // Reads model.*, train.activation_checkpointing; the module is initialised
  // from the current torch seed.
  transformer_task(const job_settings& s, word_pairs data);

  std::string name() const override { return "transformer"; }
  std::shared_ptr<torch::nn::Module> module() override { return model_.ptr(); }
  // The encoder's blocks, then the decoder's (the order forward runs them).
  std::vector<param_unit> param_units() override;
  int64_t train_size() const override { return static_cast<int64_t>(data_.train.size()); }
  int64_t eval_size() const override { return static_cast<int64_t>(data_.held_out.size()); }
  torch::Tensor loss_sum(const std::vector<int64_t>& indices) override;
  // Metrics: val_loss (cross-entropy without label smoothing, mean over the
  // target tokens of a word, then over words), exact_match (greedy
  // translation equals the target), char_accuracy (teacher-forced next
  // character accuracy over all target tokens, eos included).
  eval_result evaluate(int64_t max_samples, int64_t batch_size) override;

  // Greedy translations of English words (longer inputs are cut; outputs stop
  // at eos or after twice the longest training target).
  std::vector<std::string> translate(const std::vector<std::string>& english);
  const char_vocab& vocab() const { return vocab_; }
  const word_pairs& data() const { return data_; }
  seq2seq& model() { return model_; }

 private:
  struct batch {
    torch::Tensor src, tgt_in, tgt_out;  // [B,S], [B,T], [B,T]
  };
  batch make_batch(const std::vector<const word_pair*>& pairs) const;
  torch::Tensor encode_sources(const std::vector<std::string>& english) const;
  // Per-sample mean token loss [B] (pad ignored).
  torch::Tensor sample_losses(const torch::Tensor& logits, const torch::Tensor& tgt_out, double smoothing) const;

  word_pairs data_;
  char_vocab vocab_;
  int64_t max_chars_;
  int64_t longest_target_ = 0;  // code points of the longest training target
  double label_smoothing_;
  seq2seq model_{nullptr};
};

}  // namespace dtactor
