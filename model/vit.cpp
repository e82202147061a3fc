#include "model/vit.hpp"

#include "model/fashion_mnist.hpp"
#include "dtactor/task.hpp"
#include "runtime/data_wait.hpp"

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
  auto patches = x.view({b, c, g, p, g, p}).permute({0, 2, 4, 1, 3, 5}).reshape({b, g * g, c * p * p});
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

}  // namespace

result<std::unique_ptr<task>> make_vit_task(const config& cfg) {
  const std::string dir = cfg.get_string("data.fashion_mnist_dir");
  auto train = load_fashion_mnist(dir, "train");
  if (!train) return train.err();
  auto test = load_fashion_mnist(dir, "test");
  if (!test) return test.err();
  vit_options o;
  o.image_size = train->images.size(1);
  o.patch = cfg.get_int("model.patch_size");
  if (train->images.size(1) != train->images.size(2)) return make_error("vit expects square images");
  if (o.image_size % o.patch != 0)
    return make_error("model.patch_size must divide the image size " + std::to_string(o.image_size) + ", got " + std::to_string(o.patch));
  o.layers = cfg.get_int("model.layers");
  o.blk.dim = cfg.get_int("model.dim");
  o.blk.heads = cfg.get_int("model.heads");
  o.blk.mlp_ratio = cfg.get_double("model.mlp_ratio");
  o.blk.dropout = cfg.get_double("model.dropout");
  o.blk.checkpointed = cfg.get_bool("train.activation_checkpointing");
  if (o.blk.dim % o.blk.heads != 0)
    return make_error("model.heads (" + std::to_string(o.blk.heads) + ") must divide model.dim (" + std::to_string(o.blk.dim) + ")");
  return std::unique_ptr<task>(std::make_unique<vit_task>(vit(o), std::move(train.value()), std::move(test.value())));
}

}  // namespace dtactor
