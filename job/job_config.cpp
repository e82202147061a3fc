#include "job/job_config.hpp"
#include "job/modes.hpp"
#include "job/settings.hpp"

#include "data/data_shards.hpp"

#include <algorithm>
#include <filesystem>
#include <numeric>
#include <thread>

#include "storage/fs.hpp"
#include "base/hash.hpp"
#include "base/task_catalog.hpp"

namespace dtactor {

int max_compute_threads() { return std::max(256, 4 * static_cast<int>(std::thread::hardware_concurrency())); }

status validate_training_config(const config& cfg) {
  auto s = job_settings_of(cfg);
  if (!s) return s.err();
  return {};
}

status check_checkpoint_compatible(const pb::checkpoint_meta& meta, const config& cfg, const std::string& path) {
  auto model = model_settings_of(cfg);
  if (!model) return model.err();
  auto train = train_settings_of(cfg);
  if (!train) return train.err();
  return check_checkpoint_compatible(meta, *model, *train, cfg.digest({"model."}), path);
}

status check_checkpoint_compatible(const pb::checkpoint_meta& meta, const model_settings& model, const train_settings& train,
                                   const std::string& arch_digest, const std::string& path) {
  if (meta.model() != model.name)
    return make_error("checkpoint '" + path + "' was written by model '" + meta.model() + "', but model.name is '" + model.name +
                      "' (use another --run-dir or checkpoint.dir)");
  if (meta.arch_digest() != arch_digest)
    return make_error("checkpoint '" + path + "' was written with different model.* settings; use the same model settings or another --run-dir");
  if (meta.global_batch_size() != train.global_batch_size)
    return make_error("checkpoint '" + path + "' was written with train.global_batch_size " + std::to_string(meta.global_batch_size()) + ", not " +
                      std::to_string(train.global_batch_size) + "; resuming needs the same global batch (the data order depends on it)");
  if (static_cast<int64_t>(meta.seed()) != train.seed)
    return make_error("checkpoint '" + path + "' was written with train.seed " + std::to_string(meta.seed()) + ", not " +
                      std::to_string(train.seed));
  return {};
}

bool higher_is_better(const std::string& metric) {
  return metric.find("loss") == std::string::npos && metric != "perplexity";
}

std::string main_metric_for(const std::string& model_name) {
  if (const auto* e = catalog_find(model_name)) return e->main_metric;
  const auto builtin = mode_from_string<builtin_model>(model_name);
  if (builtin == builtin_model::vit) return "accuracy";
  if (builtin == builtin_model::transformer) return "exact_match";
  return "val_loss";
}

std::string checkpoint_dir_of(const checkpoint_settings& c, const std::string& run_dir) { return c.dir.empty() ? run_dir + "/checkpoints" : c.dir; }

std::string checkpoint_dir_of(const config& cfg, const std::string& run_dir) { return checkpoint_dir_of(checkpoint_settings_of(cfg), run_dir); }

checkpoint_policy checkpoint_policy_of(const checkpoint_settings& c) {
  checkpoint_policy p;
  p.keep_last = static_cast<int>(c.keep_last);
  p.keep_best = c.keep_best;
  p.best_metric = c.best_metric;
  p.higher_is_better = higher_is_better(p.best_metric);
  return p;
}

checkpoint_policy checkpoint_policy_of(const config& cfg) { return checkpoint_policy_of(checkpoint_settings_of(cfg)); }

namespace {
// The keys of this job that name files every node must hold identically.
std::vector<std::string> file_keys_of(const config& cfg) {
  const auto builtin = builtin_model_of(cfg);
  if (builtin == builtin_model::torchscript)
    return {"model.file",        "data.train_inputs", "data.train_targets", "data.eval_inputs", "data.eval_targets",
            "data.train_tokens", "data.eval_tokens",  "data.train_shards",  "data.eval_shards"};
  if (builtin == builtin_model::vit) return {"data.train_shards", "data.eval_shards"};
  if (const auto* e = catalog_find(cfg.get_string("model.name"))) return e->file_keys;
  return {};
}
}  // namespace

status check_training_cache(const config& cfg, std::vector<uint64_t> remote_bytes) {
  return check_training_cache(shard_read_settings_of(cfg), std::move(remote_bytes));
}

status check_training_cache(const shard_read_settings& r, std::vector<uint64_t> remote_bytes) {
  const int64_t block = r.shuffle_block_shards;
  const int64_t blocks = 1 + r.read_ahead_blocks;
  remote_bytes.erase(std::remove(remote_bytes.begin(), remote_bytes.end(), uint64_t{0}), remote_bytes.end());
  std::sort(remote_bytes.rbegin(), remote_bytes.rend());
  const size_t needed_count = std::min(remote_bytes.size(), static_cast<size_t>(block * blocks));
  const uint64_t needed = std::accumulate(remote_bytes.begin(), remote_bytes.begin() + static_cast<std::ptrdiff_t>(needed_count), uint64_t{0});
  const uint64_t cache_bytes = r.cache.cache_bytes;
  if (needed > cache_bytes)
    return make_error("data.cache_bytes (" + std::to_string(cache_bytes) + ") cannot hold " + std::to_string(needed_count) +
                      " of the largest shards (" + std::to_string(needed) +
                      " bytes): (1 + data.read_ahead_blocks) x data.shuffle_block_shards shards are held at once; raise data.cache_bytes or lower those");
  return {};
}

void absolutize_data_paths(config& cfg) {
  auto absolute = [](const std::string& path) {
    if (path.empty() || path.front() == '/' || path.rfind("s3://", 0) == 0) return path;
    std::error_code ec;
    auto abs = std::filesystem::absolute(path, ec);
    return ec ? path : abs.lexically_normal().string();
  };
  for (const std::string& key : file_keys_of(cfg)) {
    const std::string path = cfg.get_string(key);
    if (!names_shards(path)) {
      (void)cfg.set(key, absolute(path));
      continue;
    }
    // A list of shard specs: each item on its own, without the spaces around
    // it (which resolve_shards drops; made absolute they would be inside).
    std::string out;
    size_t from = 0;
    for (;;) {
      const size_t comma = path.find(',', from);
      std::string item = path.substr(from, comma == std::string::npos ? std::string::npos : comma - from);
      item.erase(0, item.find_first_not_of(" \t\r\n"));
      item.erase(item.find_last_not_of(" \t\r\n") + 1);
      if (!item.empty()) out += (out.empty() ? "" : ",") + absolute(item);
      if (comma == std::string::npos) break;
      from = comma + 1;
    }
    (void)cfg.set(key, out);
  }
  // Not a data file (nothing to digest), but a path the ranks write to.
  (void)cfg.set("data.sample_log", absolute(cfg.get_string("data.sample_log")));
}

result<std::string> file_digest(const std::string& path) {
  auto m = mapped_file::open(path);
  if (!m) return m.err();
  return std::to_string(m->size()) + ":" + hex64(hash64(m->data(), m->size()));
}

std::map<std::string, std::string> data_file_digests(const config& cfg, std::vector<std::string>* missing) {
  std::map<std::string, std::string> out;
  const std::string endpoint = shard_read_settings_of(cfg).cache.s3_endpoint;
  for (const std::string& key : file_keys_of(cfg)) {
    const std::string& path = cfg.get_string(key);
    if (path.empty()) continue;
    if (names_shards(path)) {
      // Shards: the set's digest (names, sizes, the index's digests).
      auto shards = resolve_shards(path, endpoint);
      if (shards) out[path] = shard_set_digest(shards.value());
      else if (missing) missing->push_back(path);
      continue;
    }
    auto d = file_digest(path);
    if (d) out[path] = d.value();
    else if (missing) missing->push_back(path);
  }
  return out;
}

}  // namespace dtactor
