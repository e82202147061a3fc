#include "job/job_config.hpp"
#include "job/modes.hpp"

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
  const auto modes = job_modes_of(cfg);
  if (!modes) return modes.err();
  const bool diloco = modes->sync == sync_mode::diloco;
  if (cfg.get_int("train.threads") > max_compute_threads())
    return make_error("train.threads = " + std::to_string(cfg.get_int("train.threads")) + " is more than this machine can use (at most " +
                      std::to_string(max_compute_threads()) + ": 4 x its cores, at least 256); 0 takes the machine's cores");
  const int64_t b = cfg.get_int("train.global_batch_size"), mb = cfg.get_int("train.micro_batch_size");
  if (mb > b)
    return make_error("train.micro_batch_size (" + std::to_string(mb) + ") cannot exceed train.global_batch_size (" + std::to_string(b) + ")");
  const auto builtin = builtin_model_of(cfg);
  if (builtin && *builtin != builtin_model::torchscript && cfg.get_int("model.dim") % cfg.get_int("model.heads") != 0)
    return make_error("model.heads (" + std::to_string(cfg.get_int("model.heads")) + ") must divide model.dim (" +
                      std::to_string(cfg.get_int("model.dim")) + ")");
  if (cfg.get_double("train.min_lr") > cfg.get_double("train.lr"))
    return make_error("train.min_lr (" + to_string(cfg.values().at("train.min_lr")) + ") cannot exceed train.lr (" +
                      to_string(cfg.values().at("train.lr")) + ")");
  if (cfg.get_double("model.dropout") >= 1.0) return make_error("model.dropout must be below 1");
  if (cfg.get_double("data.val_fraction") >= 1.0) return make_error("data.val_fraction must be below 1");
  if (cfg.get_double("train.beta1") >= 1.0 || cfg.get_double("train.beta2") >= 1.0) return make_error("train.beta1 and train.beta2 must be below 1");
  if (cfg.get_int("train.zero") > 2)
    return make_error("train.zero = " + std::to_string(cfg.get_int("train.zero")) +
                      " is not a ZeRO stage dtactor has: 0 (every rank holds the whole state), 1 (sharded optimizer state) or 2 (sharded optimizer state and gradients)");
  if (diloco && cfg.get_int("train.zero") > 0)
    return make_error("train.sync = diloco keeps every worker's own optimizer state whole; it does not combine with train.zero = " +
                      std::to_string(cfg.get_int("train.zero")) + " (use train.zero = 0)");
  if ((cfg.get_string("cluster.wire_dtype") == "int8" || cfg.get_string("cluster.wire_dtype") == "int4") && !diloco)
    return make_error("cluster.wire_dtype = " + cfg.get_string("cluster.wire_dtype") +
                      " quantizes DiLoCo's pseudo-gradients only (train.sync = diloco); for gradients every step use fp32 or bf16");
  if (cfg.get_double("train.outer_momentum") >= 1.0) return make_error("train.outer_momentum must be below 1");
  {
    const int64_t fragments = cfg.get_int("train.sync_fragments"), every = cfg.get_int("train.sync_every");
    const int64_t overlap = cfg.get_int("train.sync_overlap") >= 0 ? cfg.get_int("train.sync_overlap") : (fragments > 1 ? 1 : 0);
    if (!diloco && (fragments > 1 || cfg.get_int("train.sync_overlap") > 0))
      return make_error("train.sync_fragments and train.sync_overlap are Streaming DiLoCo's (train.sync = diloco); with train.sync = every_step leave them out");
    if (diloco && fragments > every)
      return make_error("train.sync_fragments (" + std::to_string(fragments) + ") cannot exceed train.sync_every (" + std::to_string(every) +
                        "): each fragment synchronises at its own step of the window");
    if (diloco && overlap * fragments >= every)
      return make_error("train.sync_overlap (" + std::to_string(overlap) + ") must stay below train.sync_every / train.sync_fragments (" + std::to_string(every) + "/" +
                        std::to_string(fragments) + "): a fragment's exchange lands before the next fragment's leaves");
    if (cfg.get_double("train.sync_mix") > 1.0) return make_error("train.sync_mix must be between 0 and 1");
    if (!diloco && modes->diloco_worker == diloco_worker_kind::host)
      return make_error("train.diloco_worker = host makes a host's ranks one DiLoCo worker; it needs train.sync = diloco");
  }
  return {};
}

status check_checkpoint_compatible(const pb::checkpoint_meta& meta, const config& cfg, const std::string& path) {
  if (meta.model() != cfg.get_string("model.name"))
    return make_error("checkpoint '" + path + "' was written by model '" + meta.model() + "', but model.name is '" + cfg.get_string("model.name") +
                      "' (use another --run-dir or checkpoint.dir)");
  if (meta.arch_digest() != cfg.digest({"model."}))
    return make_error("checkpoint '" + path + "' was written with different model.* settings; use the same model settings or another --run-dir");
  if (meta.global_batch_size() != cfg.get_int("train.global_batch_size"))
    return make_error("checkpoint '" + path + "' was written with train.global_batch_size " + std::to_string(meta.global_batch_size()) + ", not " +
                      std::to_string(cfg.get_int("train.global_batch_size")) + "; resuming needs the same global batch (the data order depends on it)");
  if (static_cast<int64_t>(meta.seed()) != cfg.get_int("train.seed"))
    return make_error("checkpoint '" + path + "' was written with train.seed " + std::to_string(meta.seed()) + ", not " +
                      std::to_string(cfg.get_int("train.seed")));
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

std::string checkpoint_dir_of(const config& cfg, const std::string& run_dir) {
  const auto& d = cfg.get_string("checkpoint.dir");
  return d.empty() ? run_dir + "/checkpoints" : d;
}

checkpoint_policy checkpoint_policy_of(const config& cfg) {
  checkpoint_policy p;
  p.keep_last = static_cast<int>(cfg.get_int("checkpoint.keep_last"));
  p.keep_best = cfg.get_bool("checkpoint.keep_best");
  p.best_metric = cfg.get_string("checkpoint.best_metric").empty() ? main_metric_for(cfg.get_string("model.name")) : cfg.get_string("checkpoint.best_metric");
  p.higher_is_better = higher_is_better(p.best_metric);
  return p;
}

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

std::string data_s3_endpoint(const config& cfg) {
  const std::string& e = cfg.get_string("data.s3_endpoint");
  return e.empty() ? cfg.get_string("checkpoint.s3_endpoint") : e;
}

shard_cache_options shard_cache_options_of(const config& cfg) {
  shard_cache_options o;
  o.cache_dir = cfg.get_string("data.cache_dir");
  o.cache_bytes = static_cast<uint64_t>(cfg.get_int("data.cache_bytes"));
  o.s3_endpoint = data_s3_endpoint(cfg);
  return o;
}

status check_training_cache(const config& cfg, std::vector<uint64_t> remote_bytes) {
  const int64_t block = cfg.get_int("data.shuffle_block_shards");
  const int64_t blocks = 1 + cfg.get_int("data.read_ahead_blocks");
  remote_bytes.erase(std::remove(remote_bytes.begin(), remote_bytes.end(), uint64_t{0}), remote_bytes.end());
  std::sort(remote_bytes.rbegin(), remote_bytes.rend());
  const size_t needed_count = std::min(remote_bytes.size(), static_cast<size_t>(block * blocks));
  const uint64_t needed = std::accumulate(remote_bytes.begin(), remote_bytes.begin() + static_cast<std::ptrdiff_t>(needed_count), uint64_t{0});
  const auto cache_bytes = static_cast<uint64_t>(cfg.get_int("data.cache_bytes"));
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
  for (const std::string& key : file_keys_of(cfg)) {
    const std::string& path = cfg.get_string(key);
    if (path.empty()) continue;
    if (names_shards(path)) {
      // Shards: the set's digest (names, sizes, the index's digests).
      auto shards = resolve_shards(path, data_s3_endpoint(cfg));
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
