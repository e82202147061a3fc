#pragma once
// Checks and derived settings of a job's config that need no model: what
// the coordinator (and `dtactor config`) validate before any node trains,
// without LibTorch. The model-specific checks (shapes, data files) happen
// where the model is built (dtactor/task.hpp).
#include <map>
#include <string>
#include <vector>

#include "checkpoint.pb.h"
#include "storage/checkpoint_store.hpp"
#include "data/data_shards.hpp"
#include "dtactor/config.hpp"
#include "dtactor/result.hpp"
#include "job/settings.hpp"

namespace dtactor {

// Cross-key checks of train.*, model.*, data.* (one clear line each): that
// job_settings_of (job/settings.hpp) reads the config without an error.
status validate_training_config(const config& cfg);

// The most compute threads a process may be given (train.threads,
// --threads-per-rank): 4 x this machine's cores, at least 256 (a
// coordinator on a small machine checks a config meant for larger nodes).
// More is a mistake that would start thousands of threads.
int max_compute_threads();

// A checkpoint may only be resumed by a job with the same model and data
// order (model name and settings, global batch, seed).
status check_checkpoint_compatible(const pb::checkpoint_meta& meta, const config& cfg, const std::string& path);
// The same from the settings; `arch_digest`: the config's digest of model.*.
status check_checkpoint_compatible(const pb::checkpoint_meta& meta, const model_settings& model, const train_settings& train,
                                   const std::string& arch_digest, const std::string& path);

// Whether a larger value of this metric is better (accuracy: yes; losses: no).
bool higher_is_better(const std::string& metric);

// The metric that ranks checkpoints of a model by default (no task needed).
std::string main_metric_for(const std::string& model_name);

// checkpoint.dir, or RUN_DIR/checkpoints when it is empty.
std::string checkpoint_dir_of(const config& cfg, const std::string& run_dir);
std::string checkpoint_dir_of(const checkpoint_settings& c, const std::string& run_dir);

// The files a job trains from that every node must hold identically (the
// scripted module and the .npy / .bin data of a torchscript job; the
// built-in models read Debian's packaged data sets): path -> "<size>:<XXH3
// hex>" of those that exist here. `missing` (optional) gets the others.
std::map<std::string, std::string> data_file_digests(const config& cfg, std::vector<std::string>* missing = nullptr);
// Makes the job's file paths that a user gives relative to where they
// started dtactor (model.file, data.train_*/eval_* of a torchscript job)
// absolute, so that the config stored in the run directory and in every
// checkpoint names the same files from anywhere (eval, export, the ranks).
// Shard specs (data/data_shards: a glob, a range, a list, s3://) get
// each local item made absolute; their digest is the shard set's.
// data.sample_log (a directory the ranks write to) is made absolute too.
void absolutize_data_paths(config& cfg);

// Before training from shards: data.cache_bytes must hold what a step reads
// and what is fetched ahead of it, (1 + data.read_ahead_blocks) x
// data.shuffle_block_shards of the largest remote training shards.
// `remote_bytes`: each training shard's bytes in S3 (0 for a local one; the
// sum of its files for a shard of several). Error: one line saying which
// setting to change.
status check_training_cache(const config& cfg, std::vector<uint64_t> remote_bytes);
status check_training_cache(const shard_read_settings& r, std::vector<uint64_t> remote_bytes);
// One file's "<size>:<XXH3 hex>", or an error naming it.
result<std::string> file_digest(const std::string& path);

// checkpoint.keep_last, keep_best and best_metric (the model's main metric
// when empty) as a store policy.
checkpoint_policy checkpoint_policy_of(const config& cfg);
checkpoint_policy checkpoint_policy_of(const checkpoint_settings& c);

}  // namespace dtactor
