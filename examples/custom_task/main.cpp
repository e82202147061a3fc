// A task of our own on dtactor's C++ API: classify the rows of a CSV file
// (numeric features, the class id in the last column) with an MLP. The
// program is a complete dtactor binary with model.name = "tabular" added:
//   tabular_trainer local --nodes 2 --config tabular.toml
//   tabular_trainer --role coordinator --config tabular.toml ...
//   tabular_trainer --role node --coordinator tcp://HOST:29400
// See README.md next to this file.
#include <dtactor/dtactor.hpp>

#include "csv_rows.hpp"

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

namespace {

namespace F = torch::nn::functional;

struct table {
  torch::Tensor features;  // [rows, columns - 1] float32
  torch::Tensor labels;    // [rows] int64
};

// Reads "x1,x2,...,label" rows (csv_rows.hpp) into tensors.
dtactor::result<table> read_csv(const std::string& path, int64_t classes) {
  std::ifstream in(path);
  if (!in) return dtactor::make_error("cannot open '" + path + "'");
  auto rows = tabular::parse_csv(in, path, classes);
  if (!rows) return rows.err();
  auto& r = rows.value();
  const auto n = static_cast<int64_t>(r.labels.size());
  return table{torch::from_blob(r.values.data(), {n, static_cast<int64_t>(r.columns - 1)}, torch::kFloat).clone(),
               torch::from_blob(r.labels.data(), {n}, torch::kLong).clone()};
}

class tabular_task : public dtactor::task {
 public:
  tabular_task(table train, table eval, int64_t hidden, int64_t depth, int64_t classes, double dropout)
      : train_(std::move(train)), eval_(std::move(eval)) {
    // Parameters come from torch's default generator, which the engine has
    // seeded: every rank builds the same initial model.
    int64_t width = train_.features.size(1);
    for (int64_t i = 0; i < depth; ++i) {
      net_->push_back(torch::nn::Linear(width, hidden));
      net_->push_back(torch::nn::GELU());
      if (dropout > 0) net_->push_back(torch::nn::Dropout(dropout));
      width = hidden;
    }
    net_->push_back(torch::nn::Linear(width, classes));
  }

  std::string name() const override { return "tabular"; }
  std::shared_ptr<torch::nn::Module> module() override { return net_.ptr(); }
  int64_t train_size() const override { return train_.labels.size(0); }
  int64_t eval_size() const override { return eval_.labels.size(0); }

  // Sum of the samples' cross-entropies: the engine divides by the global batch.
  torch::Tensor loss_sum(const std::vector<int64_t>& indices) override {
    auto idx = torch::tensor(indices, torch::kLong);
    auto logits = net_->forward(train_.features.index_select(0, idx));
    return F::cross_entropy(logits, train_.labels.index_select(0, idx), F::CrossEntropyFuncOptions().reduction(torch::kSum));
  }

  dtactor::eval_result evaluate(int64_t max_samples, int64_t batch_size) override {
    const int64_t n = max_samples > 0 ? std::min(max_samples, eval_size()) : eval_size();
    double loss = 0;
    int64_t correct = 0;
    for (int64_t i = 0; i < n; i += batch_size) {
      const int64_t end = std::min(n, i + batch_size);
      auto logits = net_->forward(eval_.features.slice(0, i, end));
      auto y = eval_.labels.slice(0, i, end);
      loss += F::cross_entropy(logits, y, F::CrossEntropyFuncOptions().reduction(torch::kSum)).item<double>();
      correct += logits.argmax(1).eq(y).sum().item<int64_t>();
    }
    dtactor::eval_result r;
    r.metrics["val_loss"] = loss / static_cast<double>(n);
    r.metrics["accuracy"] = static_cast<double>(correct) / static_cast<double>(n);
    return r;
  }

 private:
  table train_, eval_;
  torch::nn::Sequential net_;
};

dtactor::task_registration tabular_registration() {
  using vk = dtactor::value_kind;
  dtactor::task_registration r;
  r.name = "tabular";
  r.description = "an MLP on CSV rows, examples/custom_task";
  r.main_metric = "accuracy";
  r.keys = {
      {"model.hidden", vk::integer, "64", "tabular: width of each hidden layer.", 1},
      {"model.depth", vk::integer, "2", "tabular: number of hidden layers.", 1},
      {"model.classes", vk::integer, "3", "tabular: number of classes (labels are 0 .. classes-1).", 2},
      {"data.train_csv", vk::string, "", "tabular: training rows, x1,...,xn,label."},
      {"data.eval_csv", vk::string, "", "tabular: held-out rows, same columns."},
  };
  // Every node must hold these files identically (checked before training).
  r.file_keys = {"data.train_csv", "data.eval_csv"};
  r.make = [](const dtactor::config& cfg) -> dtactor::result<std::unique_ptr<dtactor::task>> {
    const int64_t classes = cfg.get_int("model.classes");
    for (const char* key : {"data.train_csv", "data.eval_csv"})
      if (cfg.get_string(key).empty()) return dtactor::make_error(std::string("model.name = tabular needs ") + key);
    auto train = read_csv(cfg.get_string("data.train_csv"), classes);
    if (!train) return train.err();
    auto eval = read_csv(cfg.get_string("data.eval_csv"), classes);
    if (!eval) return eval.err();
    if (eval->features.size(1) != train->features.size(1))
      return dtactor::make_error("data.eval_csv has " + std::to_string(eval->features.size(1)) + " feature columns, data.train_csv " +
                                 std::to_string(train->features.size(1)));
    return std::unique_ptr<dtactor::task>(new tabular_task(std::move(train.value()), std::move(eval.value()), cfg.get_int("model.hidden"),
                                                           cfg.get_int("model.depth"), classes, cfg.get_double("model.dropout")));
  };
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  if (auto st = dtactor::register_task(tabular_registration()); !st) {
    std::fprintf(stderr, "tabular_trainer: %s\n", st.message().c_str());
    return 2;
  }
  return dtactor::run_main(argc, argv);
}
