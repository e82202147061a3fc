#pragma once
// The job's config as one typed struct per section, each read ONCE from the
// config (include/dtactor/config.hpp) by its *_settings_of, so that no code
// outside the config code reads a key by its name. Each field names its key;
// the defaults here are the schema's (base/config.cpp; tests/settings_test.cpp
// checks that the two agree). Only the keys some converted code needs are
// here yet; a section grows as its readers move over.
//
// A parse function refuses what its section cannot take, with one line
// naming the key and what to do (the schema has already checked each key's
// type, bound and choices); job_settings_of adds the checks across sections
// and is what validate_training_config (job/job_config.hpp) runs.
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "data/data_shards.hpp"
#include "dtactor/config.hpp"
#include "dtactor/result.hpp"
#include "job/modes.hpp"

namespace dtactor {

// model.*: what the built-in models are built from.
struct model_settings {
  std::string name = "vit";                                  // model.name
  std::optional<builtin_model> builtin = builtin_model::vit;  // model.name's built-in model; none: a task the program registered
  std::string file;                                          // model.file (torchscript)
  int64_t vocab_size = 65536;                                // model.vocab_size
  int64_t dim = 64;                                          // model.dim
  int64_t layers = 4;                                        // model.layers
  int64_t heads = 4;                                         // model.heads
  double mlp_ratio = 4.0;                                    // model.mlp_ratio
  double dropout = 0.0;                                      // model.dropout
  int64_t patch_size = 7;                                    // model.patch_size
  int64_t classes = 10;                                      // model.classes
  int64_t context = 128;                                     // model.context
  double label_smoothing = 0.1;                              // model.label_smoothing
};
// Error: model.dropout >= 1, or (a built-in model other than torchscript)
// model.heads does not divide model.dim.
result<model_settings> model_settings_of(const config& cfg);

// How sharded data is read: the cache and the shuffle blocks.
struct shard_read_settings {
  // data.cache_dir, data.cache_bytes, and the S3 endpoint of s3:// data:
  // data.s3_endpoint, else checkpoint.s3_endpoint.
  shard_cache_options cache{"", uint64_t{4294967296}, ""};
  int64_t shuffle_block_shards = 4;  // data.shuffle_block_shards
  int64_t read_ahead_blocks = 1;     // data.read_ahead_blocks
};
// Nothing to refuse: the schema bounds each key.
shard_read_settings shard_read_settings_of(const config& cfg);

// data.*: the built-in data sets and a torchscript job's files.
struct data_settings {
  std::string fashion_mnist_dir = "/usr/share/datasets/fashion-mnist";  // data.fashion_mnist_dir
  std::string freedict_eng_ita = "/usr/share/dictd/freedict-eng-ita";   // data.freedict_eng_ita
  std::string gcide = "/usr/share/dictd/gcide";                         // data.gcide
  double val_fraction = 0.05;                                           // data.val_fraction
  int64_t max_text_bytes = 0;                                           // data.max_text_bytes
  std::string train_inputs, train_targets;                              // data.train_inputs, data.train_targets
  std::string eval_inputs, eval_targets;                                // data.eval_inputs, data.eval_targets
  std::string train_tokens, eval_tokens;                                // data.train_tokens, data.eval_tokens
  std::string train_shards, eval_shards;                                // data.train_shards, data.eval_shards
  std::string shard_inputs = "jpg;jpeg;png;npy";                        // data.shard_inputs
  std::string shard_targets = "cls";                                    // data.shard_targets
  std::string sample_log;                                               // data.sample_log
  shard_read_settings shards;
};
// Error: data.val_fraction >= 1.
result<data_settings> data_settings_of(const config& cfg);

// train.*: the optimizer, the schedule, precision and the sync.
struct train_settings {
  int64_t max_steps = 4000;                 // train.max_steps
  int64_t global_batch_size = 128;          // train.global_batch_size
  int64_t micro_batch_size = 0;             // train.micro_batch_size
  int64_t seed = 1234;                      // train.seed
  bool loss_is_nll = false;                 // train.loss_is_nll
  double lr = 0.002;                        // train.lr
  double min_lr = 0.00002;                  // train.min_lr
  double beta1 = 0.9, beta2 = 0.999;        // train.beta1, train.beta2
  double weight_decay = 0.05;               // train.weight_decay
  int64_t warmup_steps = 200;               // train.warmup_steps
  double grad_clip = 1.0;                   // train.grad_clip (0: off)
  bool bf16 = false;                        // train.bf16: forward passes under bf16 autocast
  precision_mode precision = precision_mode::fp32;  // train.precision
  int64_t zero = 0;                         // train.zero
  int64_t zero_replicas = 0;                // train.zero_replicas (0: 2 across nodes, else 1)
  int64_t sync_every = 50;                  // train.sync_every
  double outer_lr = 0.7;                    // train.outer_lr
  double outer_momentum = 0.9;              // train.outer_momentum
  int64_t sync_fragments = 1;               // train.sync_fragments
  int64_t sync_overlap = -1;                // train.sync_overlap (-1: 1 with several fragments, 0 with one)
  double sync_mix = 0.5;                    // train.sync_mix
  bool activation_checkpointing = false;    // train.activation_checkpointing
  int64_t threads = 0;                      // train.threads (0: the machine's cores)
  int64_t log_every_steps = 50;             // train.log_every_steps
};
// Error: a key out of its range or two that contradict each other (the
// checks that need train.sync are job_settings_of's).
result<train_settings> train_settings_of(const config& cfg);
// Whether the parameters' float32 values are sharded state, each rank
// keeping its shards' between steps: at train.zero = 3, and in mixed
// precision (train.precision = bf16) from train.zero = 1, where they are
// the optimizer's masters (sharded as DeepSpeed's bf16 optimizer shards
// them) and the module computes with a bf16 copy.
inline bool masters_sharded(const train_settings& t) { return t.zero >= 3 || (t.zero >= 1 && t.precision == precision_mode::bf16); }

// eval.*: when and how much held-out data is evaluated.
struct eval_settings {
  int64_t every_steps = 1000;  // eval.every_steps (0: only at the end)
  int64_t batch_size = 500;    // eval.batch_size
  int64_t max_samples = 0;     // eval.max_samples (0: all)
};
// Nothing to refuse: the schema bounds each key.
eval_settings eval_settings_of(const config& cfg);

// cluster.*: membership, the failure detector, collectives and exchanges.
struct cluster_settings {
  int32_t min_nodes = 1;                                        // cluster.min_nodes
  int32_t floor_nodes = 1;                                      // cluster.floor_nodes
  int32_t max_nodes = 64;                                       // cluster.max_nodes
  int32_t standby_nodes = 0;                                    // cluster.standby_nodes
  int32_t max_ranks_per_node = 256;                             // cluster.max_ranks_per_node (larger: INT32_MAX)
  std::chrono::milliseconds heartbeat_interval{100};            // cluster.heartbeat_interval_ms
  std::chrono::milliseconds heartbeat_timeout{1000};            // cluster.heartbeat_timeout_ms
  std::chrono::milliseconds suspect_timeout{300};               // cluster.suspect_timeout_ms
  int32_t relay_group_size = 64;                                // cluster.relay_group_size
  int32_t relay_from_nodes = 1000;                              // cluster.relay_from_nodes (0: never)
  std::chrono::milliseconds settle{300};                        // cluster.settle_ms
  int32_t flap_max_failures = 3;                                // cluster.flap_max_failures
  std::chrono::milliseconds flap_window{60000};                 // cluster.flap_window_ms
  std::chrono::milliseconds quarantine{10000};                  // cluster.quarantine_ms
  std::chrono::milliseconds collective_timeout{30000};          // cluster.collective_timeout_ms
  int64_t digest_every_steps = 100;                             // cluster.digest_every_steps (0: only at the end)
  int64_t rank_exit_limit = 5;                                  // cluster.rank_exit_limit (0: restart forever)
  int32_t spare_ranks = 0;                                      // cluster.spare_ranks (a node's --spares overrides it)
  // cluster.wire_dtype, "auto" resolved (comm/exchange_spec.hpp maps it to its codec);
  // quantized(wire): DiLoCo's pseudo-gradients only.
  wire_dtype wire = wire_dtype::fp32;
  int64_t bucket_kb = 128;                     // cluster.bucket_kb
  bool shm_allreduce = true;                   // cluster.shm_allreduce
  int64_t shm_ring_mb = 64;                    // cluster.shm_ring_mb
  bool heal_while_training = true;             // cluster.heal_while_training
  std::chrono::microseconds spin_wait{10000};  // cluster.spin_wait_us
};
// Error: a count (cluster.min_nodes, floor_nodes, max_nodes,
// flap_max_failures) beyond what a 32-bit count holds, or a wire_dtype
// this build does not know.
result<cluster_settings> cluster_settings_of(const config& cfg);

// checkpoint.*: where checkpoints go and which are kept.
struct checkpoint_settings {
  std::string dir;                 // checkpoint.dir (empty: RUN_DIR/checkpoints)
  int64_t keep_last = 3;           // checkpoint.keep_last
  bool keep_best = true;           // checkpoint.keep_best
  // checkpoint.best_metric, or, when it is empty, the main metric of
  // model.name (job_config.hpp main_metric_for).
  std::string best_metric = "accuracy";
  std::string s3_endpoint;         // checkpoint.s3_endpoint
  int64_t every_steps = 500;       // checkpoint.every_steps (0: only at the end)
  bool keep_buffer = true;         // checkpoint.keep_buffer
  bool defer_while_writing = true;  // checkpoint.defer_while_writing
};
// Nothing to refuse: the schema bounds each key.
checkpoint_settings checkpoint_settings_of(const config& cfg);

// Every section above and the modes, read once.
struct job_settings {
  job_modes modes;
  model_settings model;
  data_settings data;
  train_settings train;
  eval_settings eval;
  cluster_settings cluster;
  checkpoint_settings checkpoint;
};
// Each section's parse, then the checks across keys that need the modes
// (DiLoCo's keys, train.zero with DiLoCo, a quantized wire). Error: the
// first that fails, one line.
result<job_settings> job_settings_of(const config& cfg);

}  // namespace dtactor
