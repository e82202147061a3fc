#include "model/gpt.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "data/data_wait.hpp"
#include "model/builtin_tasks.hpp"

namespace dtactor {

namespace {

torch::Tensor bytes_tensor(const std::string& s) {
  auto t = torch::empty({static_cast<int64_t>(s.size())}, torch::kUInt8);
  std::memcpy(t.data_ptr<uint8_t>(), s.data(), s.size());
  return t;
}

}  // namespace

std::string printable_line(const std::string& bytes) {
  std::vector<uint32_t> cps;
  for (uint32_t c : utf8_decode(bytes)) {
    if (c == '\n') {
      cps.push_back('\\');
      cps.push_back('n');
    } else if (c < 0x20 || c == 0x7F) {
      cps.push_back(' ');
    } else {
      cps.push_back(c);
    }
  }
  return utf8_encode(cps);
}

gpt_impl::gpt_impl(const gpt_options& o) : opts(o) {
  tok = register_module("tok", torch::nn::Embedding(o.vocab, o.dim));
  pos = register_module("pos", torch::nn::Embedding(o.context, o.dim));
  {
    // GPT-2's initialisation of the embeddings; the tied head then starts
    // near the uniform distribution.
    torch::NoGradGuard no_grad;
    tok->weight.normal_(0.0, 0.02);
    pos->weight.normal_(0.0, 0.02);
  }
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.layers; ++i)
    blocks->push_back(block(block_options{o.dim, o.heads, o.mlp_ratio, o.dropout, false, o.checkpointed}));
  norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.dim})));
}

torch::Tensor gpt_impl::forward(const torch::Tensor& ids) {
  const int64_t t = ids.size(1);
  TORCH_CHECK(t <= opts.context, "input of ", t, " bytes is longer than the model's context ", opts.context);
  auto x = tok(ids) + pos->weight.slice(0, 0, t).unsqueeze(0);
  if (opts.dropout > 0) x = torch::dropout(x, opts.dropout, is_training());
  auto mask = causal_mask(t);
  for (const auto& m : *blocks) x = m->as<block_impl>()->forward(x, mask);
  return torch::matmul(norm(x), tok->weight.t());
}

std::string gpt_impl::generate(const std::string& prompt, int64_t count) {
  torch::NoGradGuard no_grad;
  std::string text = prompt.empty() ? std::string("\n") : prompt;
  for (int64_t i = 0; i < count; ++i) {
    const size_t keep = std::min(text.size(), static_cast<size_t>(opts.context));
    auto ids = bytes_tensor(text.substr(text.size() - keep)).to(torch::kLong).unsqueeze(0);
    const auto next = forward(ids).select(1, ids.size(1) - 1).argmax(-1).item<int64_t>();
    text += static_cast<char>(static_cast<uint8_t>(next));
  }
  return text.substr(prompt.empty() ? 1 : 0);
}

gpt_task::gpt_task(const job_settings& s, text_corpus corpus) : context_(s.model.context) {
  TORCH_CHECK(static_cast<int64_t>(corpus.train.size()) > context_, "training text has fewer than model.context + 1 bytes");
  train_ = bytes_tensor(corpus.train);
  held_out_ = bytes_tensor(corpus.held_out);
  gpt_options o;
  o.dim = s.model.dim;
  o.layers = s.model.layers;
  o.heads = s.model.heads;
  o.mlp_ratio = s.model.mlp_ratio;
  o.dropout = s.model.dropout;
  o.context = context_;
  o.checkpointed = s.train.activation_checkpointing;
  model_ = gpt(o);
}

int64_t gpt_task::windows(const torch::Tensor& text) const {
  const int64_t n = text.numel();
  return n > context_ ? (n - 1) / context_ : 0;
}

torch::Tensor gpt_task::gather(const torch::Tensor& text, const torch::Tensor& starts) const {
  auto offsets = starts.unsqueeze(1) * context_ + torch::arange(context_ + 1, torch::kLong).unsqueeze(0);
  return text.index_select(0, offsets.reshape({-1})).to(torch::kLong).view({starts.size(0), context_ + 1});
}

torch::Tensor gpt_task::window_losses(const torch::Tensor& w) {
  namespace F = torch::nn::functional;
  auto input = w.slice(1, 0, context_), target = w.slice(1, 1, context_ + 1);
  auto logits = model_->forward(input);
  const int64_t b = w.size(0);
  return F::cross_entropy(logits.reshape({b * context_, -1}).to(torch::kFloat), target.reshape({b * context_}),
                          F::CrossEntropyFuncOptions().reduction(torch::kNone))
      .view({b, context_})
      .mean(1);
}

torch::Tensor gpt_task::loss_sum(const std::vector<int64_t>& indices) {
  const int64_t n = train_size();
  for (int64_t i : indices) TORCH_CHECK(i >= 0 && i < n, "sample index ", i, " out of range [0, ", n, ")");
  torch::Tensor windows;
  {
    data_wait_timer data;
    windows = gather(train_, torch::tensor(indices, torch::kLong));
  }
  return window_losses(windows).sum();
}

eval_result gpt_task::evaluate(int64_t max_samples, int64_t batch_size) {
  torch::NoGradGuard no_grad;
  const int64_t n = max_samples > 0 ? std::min(max_samples, eval_size()) : eval_size();
  batch_size = std::max<int64_t>(1, batch_size);
  auto total = torch::zeros({}, torch::kDouble);
  for (int64_t start = 0; start < n; start += batch_size) {
    auto starts = torch::arange(start, std::min(n, start + batch_size), torch::kLong);
    total += window_losses(gather(held_out_, starts)).sum().to(torch::kDouble);
  }
  eval_result r;
  const double loss = n > 0 ? total.item<double>() / static_cast<double>(n) : std::nan("");
  r.metrics["val_loss"] = loss;
  r.metrics["perplexity"] = std::exp(loss);
  const std::string p = prompt;
  r.examples.push_back(printable_line(p) + " -> " + printable_line(model_->generate(p, 80).substr(p.size())));
  return r;
}

result<std::unique_ptr<task>> make_gpt_task(const config& cfg) {
  auto s = job_settings_of(cfg);
  if (!s) return s.err();
  return make_gpt_task(s.value());
}

// model_settings_of checked that model.heads divides model.dim.
result<std::unique_ptr<task>> make_gpt_task(const job_settings& s) {
  const int64_t context = s.model.context;
  auto corpus = load_gcide_corpus(s.data.gcide, s.data.val_fraction, s.data.max_text_bytes);
  if (!corpus) return corpus.err();
  if (static_cast<int64_t>(corpus->train.size()) <= context)
    return make_error("the GCIDE training text has " + std::to_string(corpus->train.size()) + " bytes, fewer than model.context + 1 (" +
                      std::to_string(context + 1) + "); raise data.max_text_bytes or lower data.val_fraction");
  if (static_cast<int64_t>(corpus->held_out.size()) <= context)
    return make_error("the held-out GCIDE text has " + std::to_string(corpus->held_out.size()) + " bytes, fewer than model.context + 1 (" +
                      std::to_string(context + 1) + "); raise data.val_fraction or data.max_text_bytes");
  try {
    return std::unique_ptr<task>(std::make_unique<gpt_task>(s, std::move(corpus.value())));
  } catch (const std::exception& e) {
    return make_error(std::string("cannot build the GPT: ") + e.what());
  }
}

}  // namespace dtactor
