// model.name = "torchscript": a PyTorch module saved with
// torch.jit.script(module).save(PATH) (or torch.jit.trace), trained on NumPy
// .npy arrays. Two contracts, checked on a first batch when the task is
// built: forward(inputs) -> outputs with train.loss = cross_entropy | mse,
// or a `loss(inputs, targets)` method returning one loss per sample.
#include <torch/script.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <numeric>
#include <set>
#include <tuple>

#include "model/npy.hpp"
#include "runtime/data_shards.hpp"
#include "runtime/job_config.hpp"
#include "dtactor/task.hpp"
#include "runtime/data_wait.hpp"

namespace dtactor {

namespace {

// The scripted module's parameters and buffers, registered under their own
// dotted names (a child module per prefix), so that the engine (flat AdamW,
// checkpoints, digests, state transfer) sees them as any module's. The
// tensors are shared: the engine re-pointing a parameter's data re-points
// the scripted module's.
class scripted : public torch::nn::Module {
 public:
  explicit scripted(torch::jit::Module m) : m_(std::move(m)) {
    for (const auto& p : m_.named_parameters(true)) owner(p.name).register_parameter(leaf(p.name), p.value, p.value.requires_grad());
    for (const auto& b : m_.named_buffers(true)) owner(b.name).register_buffer(leaf(b.name), b.value);
  }
  void train(bool on = true) override {
    torch::nn::Module::train(on);
    m_.train(on);
  }
  torch::jit::Module& jit() { return m_; }

 private:
  static std::string leaf(const std::string& name) {
    const auto dot = name.rfind('.');
    return dot == std::string::npos ? name : name.substr(dot + 1);
  }
  torch::nn::Module& owner(const std::string& name) {
    torch::nn::Module* at = this;
    size_t from = 0;
    for (size_t dot = name.find('.'); dot != std::string::npos; from = dot + 1, dot = name.find('.', from)) {
      const std::string part = name.substr(from, dot - from);
      auto children = at->named_children();
      if (auto* found = children.find(part)) at = found->get();
      else at = at->register_module(part, std::make_shared<torch::nn::Module>()).get();
    }
    return *at;
  }
  torch::jit::Module m_;
};

// Rows of an .npy array as a batch tensor: floating dtypes as float32,
// integers as int64, bools as bool.
torch::Tensor rows_of(const npy_array& a, const std::vector<int64_t>& idx) {
  std::vector<int64_t> shape = a.shape();
  shape[0] = static_cast<int64_t>(idx.size());
  int64_t per_row = 1;
  for (size_t i = 1; i < a.shape().size(); ++i) per_row *= a.shape()[i];
  const auto d = a.dtype();
  const bool floating = d == npy_dtype::f2 || d == npy_dtype::f4 || d == npy_dtype::f8;
  const auto target = d == npy_dtype::b1 ? torch::kBool : floating ? torch::kFloat : torch::kLong;
  std::optional<c10::ScalarType> source;
  switch (d) {
    case npy_dtype::b1: source = torch::kBool; break;
    case npy_dtype::u1: source = torch::kByte; break;
    case npy_dtype::i1: source = torch::kChar; break;
    case npy_dtype::i2: source = torch::kShort; break;
    case npy_dtype::i4: source = torch::kInt; break;
    case npy_dtype::i8: source = torch::kLong; break;
    case npy_dtype::f2: source = torch::kHalf; break;
    case npy_dtype::f4: source = torch::kFloat; break;
    case npy_dtype::f8: source = torch::kDouble; break;
    default: break;  // unsigned 16/32/64-bit: no LibTorch dtype, converted element by element
  }
  auto out = torch::empty(shape, target);
  for (size_t r = 0; r < idx.size(); ++r) {
    auto dst = out[static_cast<int64_t>(r)].view({per_row});
    if (source) {
      auto src = torch::from_blob(const_cast<uint8_t*>(a.row(idx[r])), {per_row}, *source);
      dst.copy_(src);
    } else {
      auto* p = dst.data_ptr<int64_t>();
      for (int64_t k = 0; k < per_row; ++k) p[k] = static_cast<int64_t>(a.at(static_cast<uint64_t>(idx[r] * per_row + k)));
    }
  }
  return out;
}

// Where a torchscript task's samples come from: rows of two .npy arrays,
// or windows of a token stream (inputs: `context` tokens from a position,
// targets: the same shifted by one).
class sample_source {
 public:
  virtual ~sample_source() = default;
  virtual int64_t size() const = 0;
  virtual std::pair<torch::Tensor, torch::Tensor> batch(const std::vector<int64_t>& rows) const = 0;
};

class array_source : public sample_source {
 public:
  array_source(npy_array in, npy_array tg) : in_(std::move(in)), tg_(std::move(tg)) {}
  int64_t size() const override { return in_.rows(); }
  std::pair<torch::Tensor, torch::Tensor> batch(const std::vector<int64_t>& rows) const override { return {rows_of(in_, rows), rows_of(tg_, rows)}; }

 private:
  npy_array in_, tg_;
};

class token_source : public sample_source {
 public:
  // Sample i is the window starting at position i * stride.
  token_source(std::shared_ptr<token_file> f, int64_t context, int64_t stride, int64_t first, int64_t count)
      : f_(std::move(f)), context_(context), stride_(stride), first_(first), count_(count) {}
  int64_t size() const override { return count_; }
  std::pair<torch::Tensor, torch::Tensor> batch(const std::vector<int64_t>& rows) const override {
    const int64_t n = static_cast<int64_t>(rows.size());
    auto x = torch::empty({n, context_}, torch::kLong), y = torch::empty({n, context_}, torch::kLong);
    std::vector<int64_t> w;
    for (int64_t r = 0; r < n; ++r) {
      f_->window(static_cast<uint64_t>(first_ + rows[static_cast<size_t>(r)] * stride_), static_cast<uint64_t>(context_ + 1), w);
      std::memcpy(x[r].data_ptr<int64_t>(), w.data(), static_cast<size_t>(context_) * sizeof(int64_t));
      std::memcpy(y[r].data_ptr<int64_t>(), w.data() + 1, static_cast<size_t>(context_) * sizeof(int64_t));
    }
    return {x, y};
  }

 private:
  std::shared_ptr<token_file> f_;
  int64_t context_, stride_, first_, count_;
};

// Windows of token shards (runtime/data_shards, docs/data.md): sample i is
// the window at (i - first sample of its shard) * stride in its shard;
// windows never cross a shard's end. Shards come from a shard_reader
// (mapped in place, or fetched from S3 into the node's cache); each shard's
// ids are checked against the vocabulary the first time this process reads
// it. A shard that cannot be read throws one line naming it (the rank
// reports it and the generation fails; nothing is skipped).
class shard_token_source : public sample_source {
 public:
  shard_token_source(std::shared_ptr<shard_reader> reader, std::vector<size_t> shard_ids, int64_t context, int64_t stride, uint32_t vocab)
      : reader_(std::move(reader)), ids_(std::move(shard_ids)), context_(context), stride_(stride), vocab_(vocab) {
    first_.push_back(0);
    for (size_t id : ids_) {
      const int64_t tokens = static_cast<int64_t>(reader_->shards()[id].bytes / 2);
      const int64_t n = stride_ == 1 ? tokens - context_ : (tokens - 1) / context_;
      per_shard_.push_back(n);
      first_.push_back(first_.back() + n);
    }
  }
  int64_t size() const override { return first_.back(); }
  const std::vector<int64_t>& per_shard() const { return per_shard_; }
  size_t reader_id(int64_t k) const { return ids_[static_cast<size_t>(k)]; }

  std::pair<torch::Tensor, torch::Tensor> batch(const std::vector<int64_t>& rows) const override {
    const int64_t n = static_cast<int64_t>(rows.size());
    auto x = torch::empty({n, context_}, torch::kLong), y = torch::empty({n, context_}, torch::kLong);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t i = rows[static_cast<size_t>(r)];
      const int64_t k = std::upper_bound(first_.begin(), first_.end(), i) - first_.begin() - 1;
      const auto& bytes = shard(k);
      const uint8_t* p = bytes.data() + 2 * (i - first_[static_cast<size_t>(k)]) * stride_;
      auto* xp = x[r].data_ptr<int64_t>();
      auto* yp = y[r].data_ptr<int64_t>();
      for (int64_t t = 0; t <= context_; ++t) {
        const int64_t id = p[2 * t] | (p[2 * t + 1] << 8);
        if (t < context_) xp[t] = id;
        if (t > 0) yp[t - 1] = id;
      }
    }
    return {x, y};
  }

  // Keeps the mappings of these shards (positions in this source) and lets
  // the others go.
  void hold_only(const std::vector<int64_t>& ks) {
    std::map<int64_t, std::shared_ptr<const shard_bytes>> keep;
    for (int64_t k : ks)
      if (auto it = held_.find(k); it != held_.end()) keep.insert(*it);
    held_.swap(keep);
  }

  // Reads shard k now (the first batch's shard, at task construction):
  // an error is returned, not thrown.
  status open_shard(int64_t k) {
    try {
      (void)shard(k);
      return {};
    } catch (const std::exception& e) {
      return make_error(e.what());
    }
  }

 private:
  const shard_bytes& shard(int64_t k) const {
    if (auto it = held_.find(k); it != held_.end()) return *it->second;
    const size_t id = ids_[static_cast<size_t>(k)];
    auto b = reader_->get(id);
    if (!b) throw data_error(b.message());
    const shard_bytes& bytes = *b.value();
    const std::string& url = reader_->shards()[id].url;
    if (bytes.size() % 2 != 0)
      throw data_error("shard " + url + " holds " + std::to_string(bytes.size()) + " bytes, an odd number: not a stream of uint16 token ids");
    if (checked_.insert(id).second) {
      for (size_t t = 0; t < bytes.size() / 2; ++t) {
        const uint32_t v = bytes.data()[2 * t] | (bytes.data()[2 * t + 1] << 8);
        if (v >= vocab_) {
          checked_.erase(id);
          throw data_error("shard " + url + ": token id " + std::to_string(v) + " at position " + std::to_string(t) +
                                   " is outside the model's vocabulary of " + std::to_string(vocab_));
        }
      }
    }
    held_[k] = b.value();
    return bytes;
  }

  std::shared_ptr<shard_reader> reader_;
  std::vector<size_t> ids_;  // positions in the reader's shards
  std::vector<int64_t> per_shard_, first_;
  int64_t context_, stride_;
  uint32_t vocab_;
  mutable std::map<int64_t, std::shared_ptr<const shard_bytes>> held_;
  mutable std::set<size_t> checked_;
};

// A subset of a source's samples (the held-out share of one source).
class subset_source : public sample_source {
 public:
  subset_source(std::shared_ptr<sample_source> s, int64_t from, int64_t count) : s_(std::move(s)), from_(from), count_(count) {}
  int64_t size() const override { return count_; }
  std::pair<torch::Tensor, torch::Tensor> batch(const std::vector<int64_t>& rows) const override {
    std::vector<int64_t> r(rows);
    for (auto& v : r) v += from_;
    return s_->batch(r);
  }

 private:
  std::shared_ptr<sample_source> s_;
  int64_t from_, count_;
};

class torchscript_task : public task {
 public:
  torchscript_task(std::shared_ptr<scripted> m, std::shared_ptr<sample_source> train, std::shared_ptr<sample_source> eval, std::string loss,
                   bool nll, std::shared_ptr<shard_reader> reader = nullptr)
      : m_(std::move(m)), train_(std::move(train)), eval_(std::move(eval)), loss_(std::move(loss)), nll_(nll), reader_(std::move(reader)) {
    has_loss_method_ = m_->jit().find_method("loss").has_value();
    sharded_train_ = std::dynamic_pointer_cast<shard_token_source>(train_);
  }

  std::vector<int64_t> train_shard_samples() const override { return sharded_train_ ? sharded_train_->per_shard() : std::vector<int64_t>{}; }
  void upcoming_shards(const std::vector<int64_t>& shards) override {
    if (!sharded_train_) return;
    std::vector<size_t> ids;
    for (int64_t k : shards) ids.push_back(sharded_train_->reader_id(k));
    reader_->read_ahead(std::move(ids));
    sharded_train_->hold_only(shards);
  }

  std::string name() const override { return "torchscript"; }
  std::shared_ptr<torch::nn::Module> module() override { return m_; }
  int64_t train_size() const override { return train_->size(); }
  int64_t eval_size() const override { return eval_->size(); }
  bool buffers_change_in_training() const override { return !m_->buffers().empty(); }
  bool save_scripted(const std::string& path) override {
    m_->jit().save(path);
    return true;
  }

  // Per-sample losses of a batch (shape [n]); `outputs` is set when the
  // module's forward produced them (cross-entropy metrics).
  torch::Tensor losses(const torch::Tensor& x, const torch::Tensor& y, torch::Tensor* outputs = nullptr) {
    const int64_t n = x.size(0);
    if (has_loss_method_) {
      auto l = m_->jit().get_method("loss")({x, y}).toTensor();
      TORCH_CHECK(l.dim() == 1 && l.size(0) == n, "the module's loss(inputs, targets) must return one value per sample: a tensor of shape [",
                  n, "], got ", l.sizes());
      return l.to(torch::kFloat);
    }
    auto out = m_->jit().forward({x}).toTensor().to(torch::kFloat);
    if (outputs) *outputs = out;
    if (loss_ == "cross_entropy") {
      TORCH_CHECK(y.scalar_type() == torch::kLong, "with train.loss = cross_entropy, the targets must be integer class ids");
      if (out.dim() == 3 && y.dim() == 2) {  // sequences: [batch, positions, classes]; a sample's loss is its positions' mean
        TORCH_CHECK(out.size(0) == n && out.size(1) == y.size(1), "forward returned ", out.sizes(), " for targets of shape ", y.sizes());
        const int64_t t = out.size(1);
        return torch::nn::functional::cross_entropy(out.reshape({n * t, out.size(2)}), y.reshape({n * t}),
                                                    torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone))
            .reshape({n, t})
            .mean(1);
      }
      TORCH_CHECK(out.dim() == 2 && out.size(0) == n && y.dim() == 1,
                  "with train.loss = cross_entropy, forward must return [batch, classes] scores (or [batch, positions, classes] for sequences), got ",
                  out.sizes());
      return torch::nn::functional::cross_entropy(out, y, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
    }
    auto t = y.to(torch::kFloat);
    TORCH_CHECK(out.sizes() == t.sizes(), "with train.loss = mse, forward's output ", out.sizes(), " must have the targets' shape ", t.sizes());
    return (out - t).pow(2).reshape({n, -1}).mean(1);
  }

  torch::Tensor loss_sum(const std::vector<int64_t>& indices) override {
    torch::Tensor x, y;
    {
      data_wait_timer data;
      std::tie(x, y) = train_->batch(indices);
    }
    return losses(x, y).sum();
  }

  eval_result evaluate(int64_t max_samples, int64_t batch_size) override {
    const int64_t n = max_samples > 0 ? std::min(max_samples, eval_size()) : eval_size();
    double loss = 0;
    double correct_f = 0, top5_f = 0;
    int64_t classes = 0;
    for (int64_t i = 0; i < n; i += batch_size) {
      const int64_t e = std::min(n, i + batch_size);
      std::vector<int64_t> rows;
      for (int64_t k = i; k < e; ++k) rows.push_back(k);
      auto [x, y] = eval_->batch(rows);
      torch::Tensor out;
      loss += losses(x, y, &out).sum().item<double>();
      if (out.defined() && loss_ == "cross_entropy") {
        // Sequences count every position (token accuracy), averaged per sample.
        auto scores = out.dim() == 3 ? out : out.unsqueeze(1);
        auto targets = y.dim() == 2 ? y : y.unsqueeze(1);
        classes = scores.size(2);
        const double positions = static_cast<double>(targets.size(1));
        correct_f += scores.argmax(2).eq(targets).to(torch::kDouble).sum().item<double>() / positions;
        if (classes > 5) top5_f += std::get<1>(scores.topk(5, 2)).eq(targets.unsqueeze(2)).any(2).to(torch::kDouble).sum().item<double>() / positions;
      }
    }
    eval_result r;
    if (n == 0) return r;
    r.metrics["val_loss"] = loss / static_cast<double>(n);
    if (!has_loss_method_ && loss_ == "cross_entropy") {
      r.metrics["accuracy"] = correct_f / static_cast<double>(n);
      if (classes > 5) r.metrics["top5_accuracy"] = top5_f / static_cast<double>(n);
    }
    if (nll_) r.metrics["perplexity"] = std::exp(r.metrics["val_loss"]);
    return r;
  }

 private:
  std::shared_ptr<scripted> m_;
  std::shared_ptr<sample_source> train_, eval_;
  std::string loss_;
  bool nll_ = false, has_loss_method_ = false;
  std::shared_ptr<shard_reader> reader_;
  std::shared_ptr<shard_token_source> sharded_train_;
};

result<npy_array> open_array(const config& cfg, const std::string& key) {
  const std::string& path = cfg.get_string(key);
  if (path.empty()) return make_error(key + " is not set (model.name = torchscript trains on .npy arrays: set data.train_inputs and data.train_targets)");
  auto a = npy_array::open(path);
  if (!a) return make_error(key + ": " + a.message());
  return a;
}

// data.train_tokens (and data.eval_tokens) as shards: one reader over both
// sets. Without data.eval_tokens the last data.val_fraction of the shards
// (at least one) is held out, whole shards, so no evaluation token is ever
// trained on.
using sources = std::tuple<std::shared_ptr<sample_source>, std::shared_ptr<sample_source>, std::shared_ptr<shard_reader>>;
result<sources> sharded_tokens(const config& cfg) {
  const int64_t context = cfg.get_int("model.context");
  const auto vocab = static_cast<uint32_t>(cfg.get_int("model.vocab_size"));
  const std::string endpoint = data_s3_endpoint(cfg);
  auto resolve = [&](const std::string& key) -> result<std::vector<shard_info>> {
    auto r = resolve_shards(cfg.get_string(key), endpoint);
    if (!r) return make_error(key + ": " + r.message());
    for (const auto& sh : r.value()) {
      if (sh.bytes % 2 != 0)
        return make_error(key + ": shard " + sh.url + " holds " + std::to_string(sh.bytes) + " bytes, an odd number: not a stream of uint16 token ids");
      if (sh.bytes / 2 < static_cast<uint64_t>(context) + 2)
        return make_error(key + ": shard " + sh.url + " holds " + std::to_string(sh.bytes / 2) + " tokens; every shard needs at least " +
                          std::to_string(context + 2) + " (one window of model.context + 1, and one more)");
    }
    return r;
  };
  auto tr = resolve("data.train_tokens");
  if (!tr) return tr.err();
  std::vector<shard_info> all = tr.value();
  std::vector<size_t> train_ids, eval_ids;
  for (size_t i = 0; i < all.size(); ++i) train_ids.push_back(i);
  if (!cfg.get_string("data.eval_tokens").empty()) {
    auto ev = resolve("data.eval_tokens");
    if (!ev) return ev.err();
    for (auto& sh : ev.value()) {
      eval_ids.push_back(all.size());
      all.push_back(std::move(sh));
    }
  } else {
    const size_t n = train_ids.size();
    if (n < 2)
      return make_error("data.train_tokens names one shard: set data.eval_tokens, or give two or more shards (the last data.val_fraction of them are held out)");
    const size_t held = std::clamp<size_t>(static_cast<size_t>(std::llround(cfg.get_double("data.val_fraction") * static_cast<double>(n))), 1, n - 1);
    eval_ids.assign(train_ids.end() - static_cast<std::ptrdiff_t>(held), train_ids.end());
    train_ids.resize(n - held);
  }
  // The cache must hold what a step reads and what is fetched ahead of it.
  const int64_t block = cfg.get_int("data.shuffle_block_shards");
  const int64_t blocks = 1 + cfg.get_int("data.read_ahead_blocks");
  std::vector<uint64_t> remote;
  for (size_t id : train_ids)
    if (all[id].url.rfind("s3://", 0) == 0) remote.push_back(all[id].bytes);
  std::sort(remote.rbegin(), remote.rend());
  const size_t needed_count = std::min(remote.size(), static_cast<size_t>(block * blocks));
  const uint64_t needed = std::accumulate(remote.begin(), remote.begin() + static_cast<std::ptrdiff_t>(needed_count), uint64_t{0});
  const auto cache_bytes = static_cast<uint64_t>(cfg.get_int("data.cache_bytes"));
  if (needed > cache_bytes)
    return make_error("data.cache_bytes (" + std::to_string(cache_bytes) + ") cannot hold " + std::to_string(needed_count) +
                      " of the largest shards (" + std::to_string(needed) + " bytes): (1 + data.read_ahead_blocks) x data.shuffle_block_shards shards are held at once; raise data.cache_bytes or lower those");
  shard_cache_options o;
  o.cache_dir = cfg.get_string("data.cache_dir");
  o.cache_bytes = cache_bytes;
  o.s3_endpoint = endpoint;
  auto r = shard_reader::open(std::move(all), o);
  if (!r) return r.err();
  std::shared_ptr<shard_reader> reader = std::move(r.value());
  auto train = std::make_shared<shard_token_source>(reader, train_ids, context, 1, vocab);
  auto eval = std::make_shared<shard_token_source>(reader, eval_ids, context, context, vocab);
  if (auto st = train->open_shard(0); !st) return make_error("data.train_tokens: " + st.message());
  return sources{train, eval, reader};
}

}  // namespace

result<std::unique_ptr<task>> make_torchscript_task(const config& cfg) {
  const std::string& file = cfg.get_string("model.file");
  if (file.empty()) return make_error("model.name = torchscript needs model.file, a file written by torch.jit.script(module).save(PATH)");
  std::error_code ec;
  if (!std::filesystem::is_regular_file(file, ec)) return make_error("model.file '" + file + "' does not exist (or is not a file)");
  torch::jit::Module jm;
  try {
    jm = torch::jit::load(file);
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    return make_error("model.file '" + file + "' is not a TorchScript file torch::jit::load can read: " + what.substr(0, what.find('\n')));
  }
  if (!jm.find_method("forward")) return make_error("model.file '" + file + "': the module has no forward method");
  const std::string loss = cfg.get_string("train.loss");
  if (loss != "cross_entropy" && loss != "mse") return make_error("train.loss must be cross_entropy or mse, got '" + loss + "'");
  const double val_fraction = cfg.get_double("data.val_fraction");
  // The held-out share of a source: its last samples.
  auto hold_out = [&](std::shared_ptr<sample_source> all, std::shared_ptr<sample_source>& train, std::shared_ptr<sample_source>& eval) -> status {
    const int64_t n = all->size();
    const int64_t held = std::clamp<int64_t>(static_cast<int64_t>(std::llround(val_fraction * static_cast<double>(n))), n > 1 ? 1 : 0,
                                             std::max<int64_t>(0, n - 1));
    if (n - held < 1) return make_error("no training samples left after data.val_fraction");
    train = std::make_shared<subset_source>(all, 0, n - held);
    eval = std::make_shared<subset_source>(all, n - held, held);
    return {};
  };
  std::shared_ptr<sample_source> train, eval;
  std::shared_ptr<shard_reader> reader;
  const bool tokens = !cfg.get_string("data.train_tokens").empty();
  if (tokens && (names_shards(cfg.get_string("data.train_tokens")) || names_shards(cfg.get_string("data.eval_tokens")))) {
    auto made = sharded_tokens(cfg);
    if (!made) return made.err();
    std::tie(train, eval, reader) = std::move(made.value());
  } else if (tokens) {
    // nanoGPT's .bin token streams: a sample is a window of model.context + 1 tokens.
    const int64_t context = cfg.get_int("model.context");
    const auto vocab = static_cast<uint32_t>(cfg.get_int("model.vocab_size"));
    auto open_tokens = [&](const std::string& key) -> result<std::shared_ptr<token_file>> {
      auto f = token_file::open(cfg.get_string(key), vocab, static_cast<uint64_t>(context) + 2);
      if (!f) return make_error(key + ": " + f.message());
      return std::make_shared<token_file>(std::move(f.value()));
    };
    auto tf = open_tokens("data.train_tokens");
    if (!tf) return tf.err();
    // Training: every start position; evaluation: windows side by side.
    auto all = std::make_shared<token_source>(tf.value(), context, 1, 0, static_cast<int64_t>(tf.value()->size()) - context);
    if (!cfg.get_string("data.eval_tokens").empty()) {
      auto ef = open_tokens("data.eval_tokens");
      if (!ef) return ef.err();
      train = all;
      eval = std::make_shared<token_source>(ef.value(), context, context, 0, (static_cast<int64_t>(ef.value()->size()) - 1) / context);
    } else {
      // Held out: the stream's last share, cut at a window boundary so no
      // evaluation token is ever trained on.
      const int64_t n = static_cast<int64_t>(tf.value()->size());
      const int64_t cut = n - std::max<int64_t>(context + 1, static_cast<int64_t>(std::llround(val_fraction * static_cast<double>(n))));
      if (cut < context + 1) return make_error("data.train_tokens: too few tokens to hold out data.val_fraction and still train");
      train = std::make_shared<token_source>(tf.value(), context, 1, 0, cut - context);
      eval = std::make_shared<token_source>(tf.value(), context, context, cut, (n - cut - 1) / context);
    }
  } else {
    auto tin = open_array(cfg, "data.train_inputs");
    if (!tin) return tin.err();
    auto ttg = open_array(cfg, "data.train_targets");
    if (!ttg) return ttg.err();
    if (tin->rows() != ttg->rows())
      return make_error("data.train_inputs has " + std::to_string(tin->rows()) + " samples ('" + tin->path() + "'), data.train_targets " +
                        std::to_string(ttg->rows()) + " ('" + ttg->path() + "'): they must have the same first axis");
    auto all = std::make_shared<array_source>(std::move(tin.value()), std::move(ttg.value()));
    if (!cfg.get_string("data.eval_inputs").empty() || !cfg.get_string("data.eval_targets").empty()) {
      auto a = open_array(cfg, "data.eval_inputs");
      if (!a) return a.err();
      auto b = open_array(cfg, "data.eval_targets");
      if (!b) return b.err();
      if (a->rows() != b->rows())
        return make_error("data.eval_inputs has " + std::to_string(a->rows()) + " samples, data.eval_targets " + std::to_string(b->rows()) +
                          ": they must have the same first axis");
      train = all;
      eval = std::make_shared<array_source>(std::move(a.value()), std::move(b.value()));
    } else {
      if (all->size() < 2) return make_error("data.train_inputs has fewer than 2 samples: nothing to hold out for evaluation");
      if (auto st = hold_out(all, train, eval); !st) return st.err();
    }
  }
  auto m = std::make_shared<scripted>(std::move(jm));
  auto t = std::make_unique<torchscript_task>(m, train, eval, loss, cfg.get_bool("train.loss_is_nll"), reader);
  if (t->train_size() < 1) return make_error("no training samples");
  // The contract, on a first batch of two samples: one clear line when the
  // module and the data do not fit each other.
  try {
    torch::NoGradGuard no_grad;
    std::vector<int64_t> first{0};
    if (t->train_size() > 1) first.push_back(1);
    auto l = t->loss_sum(first);
    if (!l.defined() || l.numel() != 1 || !std::isfinite(l.item<double>()))
      return make_error("model.file '" + file + "': the loss of a first batch is not one finite value");
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    return make_error("model.file '" + file + "' does not fit the data: " + what.substr(0, what.find('\n')));
  } catch (const std::exception& e) {
    std::string what = e.what();
    return make_error("model.file '" + file + "' does not fit the data: " + what.substr(0, what.find('\n')));
  }
  return std::unique_ptr<task>(std::move(t));
}

}  // namespace dtactor
