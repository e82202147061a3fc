#include "model/transformer.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <set>

#include "data/data_wait.hpp"
#include "model/builtin_tasks.hpp"

namespace dtactor {

namespace {

// Rows of ids padded with `pad` to the longest row: [B, L] int64.
torch::Tensor pad_rows(const std::vector<std::vector<int64_t>>& rows, int64_t pad) {
  size_t len = 1;
  for (const auto& r : rows) len = std::max(len, r.size());
  std::vector<int64_t> flat(rows.size() * len, pad);
  for (size_t i = 0; i < rows.size(); ++i) std::copy(rows[i].begin(), rows[i].end(), flat.begin() + static_cast<std::ptrdiff_t>(i * len));
  return torch::tensor(flat, torch::kLong).view({static_cast<int64_t>(rows.size()), static_cast<int64_t>(len)});
}

}  // namespace

char_vocab::char_vocab(const std::vector<word_pair>& pairs) {
  std::set<uint32_t> seen;
  for (const auto& p : pairs) {
    for (uint32_t c : utf8_decode(p.english)) seen.insert(c);
    for (uint32_t c : utf8_decode(p.italian)) seen.insert(c);
  }
  chars_.assign(seen.begin(), seen.end());
  for (size_t i = 0; i < chars_.size(); ++i) ids_[chars_[i]] = static_cast<int64_t>(i) + 4;
}

std::vector<int64_t> char_vocab::encode(std::string_view s) const {
  std::vector<int64_t> out;
  for (uint32_t c : utf8_decode(s)) {
    auto it = ids_.find(c);
    out.push_back(it == ids_.end() ? unk : it->second);
  }
  return out;
}

std::string char_vocab::decode(const std::vector<int64_t>& ids) const {
  std::vector<uint32_t> cps;
  for (int64_t id : ids) {
    if (id == eos) break;
    if (id == unk) cps.push_back(0xFFFD);
    if (id >= 4 && id < size()) cps.push_back(chars_[static_cast<size_t>(id - 4)]);
  }
  return utf8_encode(cps);
}

seq2seq_impl::seq2seq_impl(const seq2seq_options& o) : opts(o) {
  TORCH_CHECK(o.vocab > 4, "seq2seq needs a vocabulary");
  tok = register_module("tok", torch::nn::Embedding(o.vocab, o.dim));
  {
    torch::NoGradGuard no_grad;
    tok->weight.normal_(0.0, 1.0 / std::sqrt(static_cast<double>(o.dim)));
  }
  encoder = register_module("encoder", torch::nn::ModuleList());
  decoder = register_module("decoder", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.layers; ++i) {
    encoder->push_back(block(block_options{o.dim, o.heads, o.mlp_ratio, o.dropout, false, o.checkpointed}));
    decoder->push_back(block(block_options{o.dim, o.heads, o.mlp_ratio, o.dropout, true, o.checkpointed}));
  }
  enc_norm = register_module("enc_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.dim})));
  dec_norm = register_module("dec_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.dim})));
  positions = register_buffer("positions", sinusoidal_positions(o.max_len, o.dim));
}

torch::Tensor seq2seq_impl::embed(const torch::Tensor& ids) {
  const int64_t len = ids.size(1);
  TORCH_CHECK(len <= opts.max_len, "sequence of ", len, " tokens is longer than the model's ", opts.max_len);
  auto e = tok(ids);  // the parameters' dtype (train.precision): the float32 positions are added in it
  auto x = e * std::sqrt(static_cast<double>(opts.dim)) + positions.slice(0, 0, len).unsqueeze(0).to(e.scalar_type());
  return opts.dropout > 0 ? torch::dropout(x, opts.dropout, is_training()) : x;
}

torch::Tensor seq2seq_impl::encode(const torch::Tensor& src) {
  auto mask = padding_mask(src.eq(char_vocab::pad));
  auto x = embed(src);
  for (const auto& m : *encoder) x = m->as<block_impl>()->forward(x, mask);
  return enc_norm(x);
}

torch::Tensor seq2seq_impl::decode(const torch::Tensor& tgt_in, const torch::Tensor& memory, const torch::Tensor& src) {
  return torch::matmul(decode_hidden(tgt_in, memory, src), tok->weight.t());
}

torch::Tensor seq2seq_impl::decode_hidden(const torch::Tensor& tgt_in, const torch::Tensor& memory, const torch::Tensor& src) {
  auto memory_mask = padding_mask(src.eq(char_vocab::pad));
  // Causal alone suffices: target padding only follows the real tokens, and
  // the losses of padded positions are ignored.
  auto self_mask = causal_mask(tgt_in.size(1));
  auto y = embed(tgt_in);
  for (const auto& m : *decoder) y = m->as<block_impl>()->forward(y, self_mask, memory, memory_mask);
  return dec_norm(y);
}

torch::Tensor seq2seq_impl::forward(const torch::Tensor& src, const torch::Tensor& tgt_in) {
  return decode(tgt_in, encode(src), src);
}

std::vector<std::vector<int64_t>> seq2seq_impl::greedy(const torch::Tensor& src, int64_t max_steps) {
  torch::NoGradGuard no_grad;
  const int64_t b = src.size(0);
  max_steps = std::min(max_steps, opts.max_len);  // decoder inputs: bos + at most max_len - 1 tokens
  auto memory = encode(src);
  auto ys = torch::full({b, 1}, char_vocab::bos, torch::kLong);
  auto done = torch::zeros({b}, torch::kBool);
  for (int64_t step = 0; step < max_steps; ++step) {
    auto logits = torch::matmul(decode_hidden(ys, memory, src).select(1, ys.size(1) - 1), tok->weight.t());
    // pad and bos are never a prediction; without this an untrained model
    // that prefers pad would decode for max_steps.
    logits.slice(-1, char_vocab::pad, char_vocab::bos + 1).fill_(-std::numeric_limits<float>::infinity());
    auto next = logits.argmax(-1).masked_fill(done, char_vocab::pad);
    ys = torch::cat({ys, next.unsqueeze(1)}, 1);
    done = done.logical_or(next.eq(char_vocab::eos));
    if (done.all().item<bool>()) break;  // one sync per decoded character, not per sample
  }
  std::vector<std::vector<int64_t>> out(static_cast<size_t>(b));
  auto acc = ys.accessor<int64_t, 2>();
  for (int64_t i = 0; i < b; ++i)
    for (int64_t t = 1; t < ys.size(1); ++t) {
      const int64_t id = acc[i][t];
      if (id == char_vocab::eos || id == char_vocab::pad) break;
      out[static_cast<size_t>(i)].push_back(id);
    }
  return out;
}

transformer_task::transformer_task(const job_settings& s, word_pairs data)
    : data_(std::move(data)), vocab_(data_.train), max_chars_(s.model.context), label_smoothing_(s.model.label_smoothing) {
  seq2seq_options o;
  o.vocab = vocab_.size();
  o.dim = s.model.dim;
  o.layers = s.model.layers;
  o.heads = s.model.heads;
  o.mlp_ratio = s.model.mlp_ratio;
  o.dropout = s.model.dropout;
  o.max_len = max_chars_ + 1;  // characters plus bos (decoder input) or eos
  o.checkpointed = s.train.activation_checkpointing;
  model_ = seq2seq(o);
  for (const auto& p : data_.train) longest_target_ = std::max(longest_target_, utf8_length(p.italian));
}

torch::Tensor transformer_task::encode_sources(const std::vector<std::string>& english) const {
  std::vector<std::vector<int64_t>> rows;
  rows.reserve(english.size());
  for (const auto& e : english) {
    auto ids = vocab_.encode(e);
    if (static_cast<int64_t>(ids.size()) > max_chars_) ids.resize(static_cast<size_t>(max_chars_));
    ids.push_back(char_vocab::eos);
    rows.push_back(std::move(ids));
  }
  return pad_rows(rows, char_vocab::pad);
}

transformer_task::batch transformer_task::make_batch(const std::vector<const word_pair*>& pairs) const {
  std::vector<std::string> english;
  std::vector<std::vector<int64_t>> in, out;
  for (const auto* p : pairs) {
    english.push_back(p->english);
    auto ids = vocab_.encode(p->italian);
    std::vector<int64_t> i{char_vocab::bos};
    i.insert(i.end(), ids.begin(), ids.end());
    ids.push_back(char_vocab::eos);
    in.push_back(std::move(i));
    out.push_back(std::move(ids));
  }
  return batch{encode_sources(english), pad_rows(in, char_vocab::pad), pad_rows(out, char_vocab::pad)};
}

torch::Tensor transformer_task::sample_losses(const torch::Tensor& logits, const torch::Tensor& tgt_out, double smoothing) const {
  namespace F = torch::nn::functional;
  const int64_t b = tgt_out.size(0), t = tgt_out.size(1);
  auto per_token = F::cross_entropy(logits.reshape({b * t, -1}).to(torch::kFloat), tgt_out.reshape({b * t}),
                                    F::CrossEntropyFuncOptions().ignore_index(char_vocab::pad).label_smoothing(smoothing).reduction(torch::kNone))
                       .view({b, t});
  auto real = tgt_out.ne(char_vocab::pad).to(per_token.scalar_type());
  return (per_token * real).sum(1) / real.sum(1).clamp_min(1.0);
}

std::vector<param_unit> transformer_task::param_units() {
  auto units = block_units(model_->encoder, "encoder");
  for (auto& u : block_units(model_->decoder, "decoder")) units.push_back(std::move(u));
  return units;
}

torch::Tensor transformer_task::loss_sum(const std::vector<int64_t>& indices) {
  std::optional<data_wait_timer> data(std::in_place);
  std::vector<const word_pair*> pairs;
  pairs.reserve(indices.size());
  for (int64_t i : indices) {
    TORCH_CHECK(i >= 0 && i < train_size(), "sample index ", i, " out of range [0, ", train_size(), ")");
    pairs.push_back(&data_.train[static_cast<size_t>(i)]);
  }
  auto b = make_batch(pairs);
  data.reset();
  return sample_losses(model_->forward(b.src, b.tgt_in), b.tgt_out, label_smoothing_).sum();
}

std::vector<std::string> transformer_task::translate(const std::vector<std::string>& english) {
  if (english.empty()) return {};
  // A translation longer than every training target is wrong anyway (eos
  // included); the bound keeps the decoding of an untrained model short.
  auto ids = model_->greedy(encode_sources(english), std::min(max_chars_, longest_target_) + 1);
  std::vector<std::string> out;
  for (const auto& row : ids) out.push_back(vocab_.decode(row));
  return out;
}

eval_result transformer_task::evaluate(int64_t max_samples, int64_t batch_size) {
  torch::NoGradGuard no_grad;
  const int64_t n = max_samples > 0 ? std::min(max_samples, eval_size()) : eval_size();
  batch_size = std::max<int64_t>(1, batch_size);
  double loss = 0, exact = 0, chars_right = 0, chars = 0;
  eval_result r;
  for (int64_t start = 0; start < n; start += batch_size) {
    const int64_t end = std::min(n, start + batch_size);
    std::vector<const word_pair*> pairs;
    std::vector<std::string> english;
    for (int64_t i = start; i < end; ++i) {
      pairs.push_back(&data_.held_out[static_cast<size_t>(i)]);
      english.push_back(pairs.back()->english);
    }
    auto b = make_batch(pairs);
    auto logits = model_->forward(b.src, b.tgt_in);
    loss += sample_losses(logits, b.tgt_out, 0.0).sum().item<double>();
    auto real = b.tgt_out.ne(char_vocab::pad);
    chars_right += logits.argmax(-1).eq(b.tgt_out).logical_and(real).sum().item<double>();
    chars += real.sum().item<double>();
    auto guesses = translate(english);
    for (size_t k = 0; k < pairs.size(); ++k) {
      const bool hit = guesses[k] == pairs[k]->italian;
      exact += hit ? 1 : 0;
      if (r.examples.size() < 8) r.examples.push_back(pairs[k]->english + " -> " + guesses[k] + " (target: " + pairs[k]->italian + ")");
    }
  }
  const double count = static_cast<double>(std::max<int64_t>(n, 1));
  r.metrics["val_loss"] = n > 0 ? loss / count : std::nan("");
  r.metrics["exact_match"] = exact / count;
  r.metrics["char_accuracy"] = chars > 0 ? chars_right / chars : 0.0;
  return r;
}

result<std::unique_ptr<task>> make_transformer_task(const config& cfg) {
  auto s = job_settings_of(cfg);
  if (!s) return s.err();
  return make_transformer_task(s.value());
}

// model_settings_of checked that model.heads divides model.dim.
result<std::unique_ptr<task>> make_transformer_task(const job_settings& s) {
  auto data = load_eng_ita_pairs(s.data.freedict_eng_ita, s.model.context, s.data.val_fraction);
  if (!data) return data.err();
  if (data->train.empty()) return make_error("data.val_fraction holds out every English->Italian pair; lower it below 1");
  if (data->held_out.empty()) return make_error("no English->Italian pair is held out for evaluation; raise data.val_fraction");
  try {
    return std::unique_ptr<task>(std::make_unique<transformer_task>(s, std::move(data.value())));
  } catch (const std::exception& e) {
    return make_error(std::string("cannot build the transformer: ") + e.what());
  }
}

}  // namespace dtactor
