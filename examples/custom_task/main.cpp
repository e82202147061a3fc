// A task of our own on dtactor's C++ API: classify the rows of CSV files
// (numeric features, the class id in the last column) with an MLP. The
// rows come from one file or from shards (a glob, a range, a list, s3://;
// dtactor/shards.hpp). The program is a complete dtactor binary with
// model.name = "tabular" added:
//   tabular_trainer local --nodes 2 --config tabular.toml
//   tabular_trainer --role coordinator --config tabular.toml ...
//   tabular_trainer --role node --coordinator tcp://HOST:29400
// See README.md next to this file.
#include <dtactor/dtactor.hpp>

#include "csv_rows.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace {

namespace F = torch::nn::functional;

// The rows of the CSV file or shards a data key names. Row i of the whole
// is row i - first(k) of shard k: shard k's rows follow those of shard
// k - 1. How many rows each shard holds is known before any is parsed: its
// lines from the shard index (`dtactor data index`), or counted in a local
// shard, less a header line when the shards have one (as the first shard
// does). A shard is parsed when a row of it is first asked for, and kept
// until keep_only() lets it go; a single file is parsed once and kept.
class csv_data {
 public:
  // Opens the key's file or shards; parses the first shard (its header and
  // width decide for the others). `features` = 0: any width (the training
  // data decides); else the width the rows must have.
  static dtactor::result<csv_data> open(const dtactor::config& cfg, const std::string& key, dtactor::shard_use use, int64_t classes,
                                        size_t features) {
    auto set = dtactor::shard_set::open(cfg, key, use);
    if (!set) return set.err();
    csv_data d;
    d.key_ = key;
    d.classes_ = classes;
    d.set_ = std::move(set.value());
    // Lines per shard first: an S3 shard the index does not count is
    // refused before anything is fetched.
    auto lines = d.set_->sharded() ? d.set_->all_records() : dtactor::result<std::vector<int64_t>>(std::vector<int64_t>{});
    if (!lines) return lines.err();
    auto first = d.set_->get(0);
    if (!first) return first.err();
    d.header_ = tabular::has_header(first->text());
    if (d.set_->sharded()) {
      for (size_t k = 0; k < lines->size(); ++k) {
        const int64_t rows = (*lines)[k] - (d.header_ ? 1 : 0);
        if (rows < 1) return dtactor::make_error(key + ": shard " + d.set_->shards()[k].url + " holds no rows");
        d.per_shard_.push_back(rows);
      }
    }
    try {
      const auto& rows = d.rows_of(0);  // the width, and a bad first shard fails here, before training
      if (!d.set_->sharded()) d.per_shard_ = {static_cast<int64_t>(rows.labels.size())};
      if (features && rows.columns - 1 != features)
        return dtactor::make_error(key + " has " + std::to_string(rows.columns - 1) + " feature columns, data.train_csv " + std::to_string(features));
    } catch (const dtactor::data_error& e) {
      return dtactor::make_error(e.what());
    }
    d.first_.push_back(0);
    for (int64_t n : d.per_shard_) d.first_.push_back(d.first_.back() + n);
    return dtactor::result<csv_data>(std::move(d));
  }

  int64_t size() const { return first_.back(); }
  size_t features() const { return columns_ - 1; }
  size_t shards() const { return per_shard_.size(); }
  int64_t first(size_t k) const { return first_[k]; }
  // Rows per shard for train_shard_samples(); empty for one file (the
  // engine then permutes all rows at once, as before shards existed).
  std::vector<int64_t> shard_rows() const { return set_->sharded() ? per_shard_ : std::vector<int64_t>{}; }

  // Features [n, features] (float32) and labels [n] (int64) of these rows.
  // Throws dtactor::data_error when a shard cannot be read or parsed.
  std::pair<torch::Tensor, torch::Tensor> batch(const std::vector<int64_t>& rows) {
    const auto n = static_cast<int64_t>(rows.size());
    auto x = torch::empty({n, static_cast<int64_t>(features())}, torch::kFloat);
    auto y = torch::empty({n}, torch::kLong);
    float* xp = x.data_ptr<float>();
    int64_t* yp = y.data_ptr<int64_t>();
    for (int64_t r = 0; r < n; ++r) {
      const int64_t i = rows[static_cast<size_t>(r)];
      const size_t k = static_cast<size_t>(std::upper_bound(first_.begin(), first_.end(), i) - first_.begin() - 1);
      const auto j = static_cast<size_t>(i - first_[k]);
      const tabular::csv_rows& t = rows_of(k);
      std::memcpy(xp + r * static_cast<int64_t>(features()), t.values.data() + j * features(), features() * sizeof(float));
      yp[r] = t.labels[j];
    }
    return {x, y};
  }

  // The engine's hint before a step (upcoming_shards): these shards are
  // read next, most urgent first. The set fetches those in S3 ahead; the
  // rows of every other shard are let go.
  void upcoming(const std::vector<int64_t>& ks) {
    set_->read_ahead(ks);
    keep_only(ks);
  }
  void read_ahead(const std::vector<int64_t>& ks) { set_->read_ahead(ks); }
  // Lets go of every parsed shard not in ks (one file stays).
  void keep_only(const std::vector<int64_t>& ks) {
    if (!set_->sharded()) return;
    const std::set<int64_t> keep(ks.begin(), ks.end());
    for (auto it = parsed_.begin(); it != parsed_.end();) it = keep.count(static_cast<int64_t>(it->first)) ? std::next(it) : parsed_.erase(it);
  }
  size_t parsed() const { return parsed_.size(); }

 private:
  const tabular::csv_rows& rows_of(size_t k) {
    if (auto it = parsed_.find(k); it != parsed_.end()) return it->second;
    const std::string& url = set_->shards()[k].url;
    auto bytes = set_->get(k);
    if (!bytes) throw dtactor::data_error(bytes.message());
    auto rows = tabular::parse_csv_text(bytes->text(), url, classes_);
    if (!rows) throw dtactor::data_error(key_ + ": " + rows.message());
    if (columns_ == 0) columns_ = rows->columns;
    if (rows->columns != columns_)
      throw dtactor::data_error(key_ + ": shard " + url + " has " + std::to_string(rows->columns) + " columns, the first shard " +
                                std::to_string(columns_));
    // The engine's order was built from the counted rows: a shard must hold exactly those.
    if (set_->sharded() && static_cast<int64_t>(rows->labels.size()) != per_shard_[k])
      throw dtactor::data_error(key_ + ": shard " + url + " holds " + std::to_string(rows->labels.size()) + " rows where " +
                                std::to_string(per_shard_[k]) + " were counted (its lines" +
                                (header_ ? ", less a header line as the first shard has" : "") +
                                "): a CSV shard may have no blank lines, and a header line only if the first shard has one; if it changed, "
                                "index it again (`dtactor data index`)");
    return parsed_.emplace(k, std::move(rows.value())).first->second;
  }

  std::string key_;
  int64_t classes_ = 0;
  std::unique_ptr<dtactor::shard_set> set_;
  bool header_ = false;
  size_t columns_ = 0;
  std::vector<int64_t> per_shard_, first_;
  std::map<size_t, tabular::csv_rows> parsed_;
};

class tabular_task : public dtactor::task {
 public:
  tabular_task(csv_data train, csv_data eval, int64_t hidden, int64_t depth, int64_t classes, double dropout)
      : train_(std::move(train)), eval_(std::move(eval)) {
    // Parameters come from torch's default generator, which the engine has
    // seeded: every rank builds the same initial model.
    auto width = static_cast<int64_t>(train_.features());
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
  int64_t train_size() const override { return train_.size(); }
  int64_t eval_size() const override { return eval_.size(); }

  // Shards: the engine permutes them per epoch and shuffles rows within
  // blocks of data.shuffle_block_shards of them (docs/data.md "The order").
  std::vector<int64_t> train_shard_samples() const override { return train_.shard_rows(); }
  void upcoming_shards(const std::vector<int64_t>& shards) override { train_.upcoming(shards); }

  // Sum of the samples' cross-entropies: the engine divides by the global batch.
  torch::Tensor loss_sum(const std::vector<int64_t>& indices) override {
    auto [x, y] = train_.batch(indices);
    return F::cross_entropy(net_->forward(x), y, F::CrossEntropyFuncOptions().reduction(torch::kSum));
  }

  // Shard after shard, the next ones read ahead; each let go once done.
  dtactor::eval_result evaluate(int64_t max_samples, int64_t batch_size) override {
    const int64_t n = max_samples > 0 ? std::min(max_samples, eval_size()) : eval_size();
    double loss = 0;
    int64_t correct = 0;
    for (size_t k = 0; k < eval_.shards() && eval_.first(k) < n; ++k) {
      eval_.read_ahead({static_cast<int64_t>(k + 1), static_cast<int64_t>(k + 2)});
      eval_.keep_only({static_cast<int64_t>(k)});
      const int64_t end = std::min(n, eval_.first(k + 1));
      for (int64_t i = eval_.first(k); i < end; i += batch_size) {
        std::vector<int64_t> rows(static_cast<size_t>(std::min(end, i + batch_size) - i));
        for (size_t r = 0; r < rows.size(); ++r) rows[r] = i + static_cast<int64_t>(r);
        auto [x, y] = eval_.batch(rows);
        auto logits = net_->forward(x);
        loss += F::cross_entropy(logits, y, F::CrossEntropyFuncOptions().reduction(torch::kSum)).item<double>();
        correct += logits.argmax(1).eq(y).sum().item<int64_t>();
      }
    }
    eval_.read_ahead({});
    eval_.keep_only({});
    dtactor::eval_result r;
    r.metrics["val_loss"] = loss / static_cast<double>(n);
    r.metrics["accuracy"] = static_cast<double>(correct) / static_cast<double>(n);
    return r;
  }

 private:
  csv_data train_, eval_;
  torch::nn::Sequential net_;
};

dtactor::task_registration tabular_registration() {
  using vk = dtactor::value_kind;
  dtactor::task_registration r;
  r.name = "tabular";
  r.description = "an MLP on CSV rows, examples/custom_task";
  r.main_metric = "accuracy";
  // model.classes (labels are 0 .. classes-1) is dtactor's own key: a task
  // may read every key, and declares only those that are new.
  r.keys = {
      {"model.hidden", vk::integer, "64", "tabular: width of each hidden layer.", 1},
      {"model.depth", vk::integer, "2", "tabular: number of hidden layers.", 1},
      {"data.train_csv", vk::string, "", "tabular: training rows, x1,...,xn,label: a file, or shards (data/train-*.csv, s3://...)."},
      {"data.eval_csv", vk::string, "", "tabular: held-out rows, same columns: a file, or shards."},
  };
  // Every node must hold these files (or shard sets) identically: checked
  // before training; relative paths are made absolute where dtactor starts.
  r.file_keys = {"data.train_csv", "data.eval_csv"};
  r.make = [](const dtactor::config& cfg) -> dtactor::result<std::unique_ptr<dtactor::task>> {
    const int64_t classes = cfg.get_int("model.classes");
    for (const char* key : {"data.train_csv", "data.eval_csv"})
      if (cfg.get_string(key).empty()) return dtactor::make_error(std::string("model.name = tabular needs ") + key);
    auto train = csv_data::open(cfg, "data.train_csv", dtactor::shard_use::train, classes, 0);
    if (!train) return train.err();
    auto eval = csv_data::open(cfg, "data.eval_csv", dtactor::shard_use::eval, classes, train->features());
    if (!eval) return eval.err();
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
