#include "model/vit.hpp"

#include <optional>
#include <sstream>
#include <tuple>

#include "model/fashion_mnist.hpp"
#include "model/sample_sources.hpp"
#include "dtactor/task.hpp"
#include "model/builtin_tasks.hpp"
#include "data/data_wait.hpp"

namespace dtactor {

vit_impl::vit_impl(const vit_options& o) : opts(o) {
  TORCH_CHECK(o.image_size % o.patch == 0, "model.patch_size (", o.patch, ") must divide the image size (", o.image_size, ")");
  const int64_t n = (o.image_size / o.patch) * (o.image_size / o.patch);
  const int64_t d = o.blk.dim;
  patch_embed = register_module("patch_embed", torch::nn::Linear(o.channels * o.patch * o.patch, d));
  cls_token = register_parameter("cls_token", torch::randn({1, 1, d}) * 0.02);
  pos_embed = register_parameter("pos_embed", torch::randn({1, n + 1, d}) * 0.02);
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.layers; ++i) blocks->push_back(block(o.blk));
  norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  head = register_module("head", torch::nn::Linear(d, o.classes));
}

torch::Tensor vit_impl::forward(const torch::Tensor& x) {
  const int64_t b = x.size(0), c = opts.channels, p = opts.patch, g = opts.image_size / p;
  // [B,C,H,W] -> [B, g*g, C*p*p]: one GEMM embeds all patches.
  // In the parameters' dtype (train.precision).
  auto patches = x.view({b, c, g, p, g, p}).permute({0, 2, 4, 1, 3, 5}).reshape({b, g * g, c * p * p}).to(patch_embed->weight.scalar_type());
  auto h = patch_embed(patches);
  h = torch::cat({cls_token.expand({b, 1, opts.blk.dim}), h}, 1) + pos_embed;
  for (auto& m : *blocks) h = m->as<block_impl>()->forward(h);
  return head(norm(h.select(1, 0)));
}

namespace {

constexpr double kMean = 0.2860, kStd = 0.3530;  // Fashion-MNIST pixel statistics

class vit_task : public task {
 public:
  vit_task(vit model, image_set train, image_set test) : model_(std::move(model)), train_(std::move(train)), test_(std::move(test)) {}

  std::string name() const override { return "vit"; }
  std::shared_ptr<torch::nn::Module> module() override { return model_.ptr(); }
  std::vector<param_unit> param_units() override { return block_units(model_->blocks, "blocks"); }
  int64_t train_size() const override { return train_.images.size(0); }
  int64_t eval_size() const override { return test_.images.size(0); }

  torch::Tensor loss_sum(const std::vector<int64_t>& indices) override {
    torch::Tensor x, y;
    {
      data_wait_timer data;
      auto idx = torch::tensor(indices, torch::kInt64);
      x = prepare(train_.images.index_select(0, idx));
      y = train_.labels.index_select(0, idx);
    }
    return torch::nn::functional::cross_entropy(model_->forward(x).to(torch::kFloat),
                                                y, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
  }

  eval_result evaluate(int64_t max_samples, int64_t batch_size) override {
    const int64_t n = max_samples > 0 ? std::min(max_samples, eval_size()) : eval_size();
    double loss = 0;
    int64_t correct = 0;
    for (int64_t i = 0; i < n; i += batch_size) {
      const int64_t e = std::min(n, i + batch_size);
      auto x = prepare(test_.images.slice(0, i, e));
      auto y = test_.labels.slice(0, i, e);
      auto logits = model_->forward(x).to(torch::kFloat);
      loss += torch::nn::functional::cross_entropy(logits, y, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                  .item<double>();
      correct += logits.argmax(1).eq(y).sum().item<int64_t>();
    }
    eval_result r;
    r.metrics["accuracy"] = static_cast<double>(correct) / static_cast<double>(n);
    r.metrics["val_loss"] = loss / static_cast<double>(n);
    return r;
  }

 private:
  static torch::Tensor prepare(const torch::Tensor& u8) { return ((u8.to(torch::kFloat) / 255.0 - kMean) / kStd).unsqueeze(1); }

  vit model_;
  image_set train_, test_;
};

// The ViT on image tar shards (data.train_shards, docs/data.md): samples
// read through a shard reader, pixels in [0, 1] normalised as Fashion-MNIST's.
class vit_shard_task : public task {
 public:
  vit_shard_task(vit model, sharded_split data, int64_t classes) : model_(std::move(model)), data_(std::move(data)), classes_(classes) {}

  std::string name() const override { return "vit"; }
  std::shared_ptr<torch::nn::Module> module() override { return model_.ptr(); }
  std::vector<param_unit> param_units() override { return block_units(model_->blocks, "blocks"); }
  int64_t train_size() const override { return data_.train->size(); }
  int64_t eval_size() const override { return data_.eval->size(); }
  std::vector<int64_t> train_shard_samples() const override { return data_.train->per_shard(); }
  void upcoming_shards(const std::vector<int64_t>& shards) override { data_.train->upcoming(shards); }
  void upcoming_samples(const std::vector<int64_t>& indices) override { data_.train->upcoming_samples(indices); }

  torch::Tensor loss_sum(const std::vector<int64_t>& indices) override {
    torch::Tensor x, y;
    {
      data_wait_timer data;
      std::tie(x, y) = batch(*data_.train, indices);
    }
    return torch::nn::functional::cross_entropy(model_->forward(x).to(torch::kFloat), y,
                                                torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
  }

  eval_result evaluate(int64_t max_samples, int64_t batch_size) override {
    const int64_t n = max_samples > 0 ? std::min(max_samples, eval_size()) : eval_size();
    double loss = 0;
    int64_t correct = 0;
    for (int64_t i = 0; i < n; i += batch_size) {
      std::vector<int64_t> rows;
      for (int64_t k = i; k < std::min(n, i + batch_size); ++k) rows.push_back(k);
      data_.eval->read_ahead_from(i, 2);
      auto [x, y] = batch(*data_.eval, rows);
      auto logits = model_->forward(x).to(torch::kFloat);
      loss += torch::nn::functional::cross_entropy(logits, y, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                  .item<double>();
      correct += logits.argmax(1).eq(y).sum().item<int64_t>();
    }
    data_.eval->hold_only({});
    eval_result r;
    if (n == 0) return r;
    r.metrics["accuracy"] = static_cast<double>(correct) / static_cast<double>(n);
    r.metrics["val_loss"] = loss / static_cast<double>(n);
    return r;
  }

  // Normalised images and class ids, checked against the model's shape.
  std::pair<torch::Tensor, torch::Tensor> batch(const sample_source& s, const std::vector<int64_t>& rows) const {
    auto [x, y] = s.batch(rows);
    const auto& o = model_->opts;
    if (x.dim() != 4 || x.size(1) != o.channels || x.size(2) != o.image_size || x.size(3) != o.image_size || x.scalar_type() != torch::kFloat) {
      std::ostringstream m;
      m << "vit: a batch of inputs of shape " << x.sizes() << " (" << x.scalar_type() << "); the model takes images of " << o.channels << "x"
        << o.image_size << "x" << o.image_size << " (the first training sample's): every image of the shards must have that size";
      throw data_error(m.str());
    }
    if (y.dim() != 1 || y.scalar_type() != torch::kLong)
      throw data_error("vit: the targets must be class ids (a .cls member per sample; data.shard_targets)");
    if (y.numel() && (y.min().item<int64_t>() < 0 || y.max().item<int64_t>() >= classes_))
      throw data_error("vit: a class id " + std::to_string(y.min().item<int64_t>() < 0 ? y.min().item<int64_t>() : y.max().item<int64_t>()) +
                       " is outside model.classes = " + std::to_string(classes_));
    return {(x - kMean) / kStd, y};
  }

 private:
  vit model_;
  sharded_split data_;
  int64_t classes_;
};

}  // namespace

result<std::unique_ptr<task>> make_vit_task(const config& cfg) {
  auto s = job_settings_of(cfg);
  if (!s) return s.err();
  return make_vit_task(s.value());
}

result<std::unique_ptr<task>> make_vit_task(const job_settings& s) {
  const model_settings& m = s.model;
  vit_options o;
  o.patch = m.patch_size;
  std::optional<sharded_split> shards;
  std::optional<image_set> train, test;
  if (!s.data.train_shards.empty()) {
    auto sh = open_tar_shards(s.data);
    if (!sh) return sh.err();
    torch::Tensor x;
    try {
      x = sh->train->batch({0}).first;
    } catch (const std::exception& e) {
      return make_error(std::string("data.train_shards: ") + e.what());
    }
    if (x.dim() != 4 || x.scalar_type() != torch::kFloat)
      return make_error("vit: data.train_shards' inputs must be images (data.shard_inputs: png, jpg)");
    if (x.size(2) != x.size(3)) return make_error("vit expects square images, the first training sample is " + std::to_string(x.size(2)) + "x" + std::to_string(x.size(3)));
    o.channels = x.size(1);
    o.image_size = x.size(2);
    o.classes = m.classes;
    shards = std::move(sh.value());
  } else {
    const std::string& dir = s.data.fashion_mnist_dir;
    auto tr = load_fashion_mnist(dir, "train");
    if (!tr) return tr.err();
    auto te = load_fashion_mnist(dir, "test");
    if (!te) return te.err();
    if (tr->images.size(1) != tr->images.size(2)) return make_error("vit expects square images");
    o.image_size = tr->images.size(1);
    train = std::move(tr.value());
    test = std::move(te.value());
  }
  if (o.image_size % o.patch != 0)
    return make_error("model.patch_size must divide the image size " + std::to_string(o.image_size) + ", got " + std::to_string(o.patch));
  o.layers = m.layers;
  o.blk.dim = m.dim;
  o.blk.heads = m.heads;
  o.blk.mlp_ratio = m.mlp_ratio;
  o.blk.dropout = m.dropout;
  o.blk.checkpointed = s.train.activation_checkpointing;
  if (o.blk.dim % o.blk.heads != 0)
    return make_error("model.heads (" + std::to_string(o.blk.heads) + ") must divide model.dim (" + std::to_string(o.blk.dim) + ")");
  if (shards) return std::unique_ptr<task>(std::make_unique<vit_shard_task>(vit(o), std::move(*shards), o.classes));
  return std::unique_ptr<task>(std::make_unique<vit_task>(vit(o), std::move(*train), std::move(*test)));
}

}  // namespace dtactor
