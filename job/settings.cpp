#include "job/settings.hpp"

#include <limits>

#include "job/job_config.hpp"

namespace dtactor {

namespace {

using ms = std::chrono::milliseconds;

// A count the membership keeps in 32 bits: the key's value, or an error.
result<int32_t> count_of(const config& cfg, const std::string& key) {
  const int64_t v = cfg.get_int(key);
  if (v > std::numeric_limits<int32_t>::max())
    return make_error(key + " = " + std::to_string(v) + " is more than dtactor counts (at most " + std::to_string(std::numeric_limits<int32_t>::max()) + ")");
  return static_cast<int32_t>(v);
}

// The checks of train.* that need no mode, in validate_training_config's order.
status check_train(const train_settings& t) {
  if (t.threads > max_compute_threads())
    return make_error("train.threads = " + std::to_string(t.threads) + " is more than this machine can use (at most " +
                      std::to_string(max_compute_threads()) + ": 4 x its cores, at least 256); 0 takes the machine's cores");
  if (t.micro_batch_size > t.global_batch_size)
    return make_error("train.micro_batch_size (" + std::to_string(t.micro_batch_size) + ") cannot exceed train.global_batch_size (" +
                      std::to_string(t.global_batch_size) + ")");
  if (t.min_lr > t.lr)
    return make_error("train.min_lr (" + to_string(config_value{t.min_lr}) + ") cannot exceed train.lr (" + to_string(config_value{t.lr}) + ")");
  if (t.beta1 >= 1.0 || t.beta2 >= 1.0) return make_error("train.beta1 and train.beta2 must be below 1");
  if (t.zero > 3)
    return make_error("train.zero = " + std::to_string(t.zero) +
                      " is not a ZeRO stage dtactor has: 0 (every rank holds the whole state), 1 (sharded optimizer state), 2 (sharded optimizer "
                      "state and gradients) or 3 (parameters too)");
  if (t.precision == precision_mode::bf16 && t.bf16)
    return make_error("train.precision = bf16 computes in bf16 already; train.bf16 autocasts an fp32 model: set one of them");
  if (t.outer_momentum >= 1.0) return make_error("train.outer_momentum must be below 1");
  if (t.sync_mix > 1.0) return make_error("train.sync_mix must be between 0 and 1");
  return {};
}

// The checks that need train.sync or train.diloco_worker.
status check_sync(const job_settings& s) {
  const train_settings& t = s.train;
  const bool diloco = s.modes.sync == sync_mode::diloco;
  if (diloco && t.zero > 0)
    return make_error("train.sync = diloco keeps every worker's own optimizer state whole; it does not combine with train.zero = " +
                      std::to_string(t.zero) + " (use train.zero = 0)");
  if (diloco && t.precision == precision_mode::bf16)
    return make_error("train.sync = diloco keeps its outer state beside fp32 parameters; train.precision = bf16 does not combine with it (use fp32)");
  if (quantized(s.cluster.wire) && !diloco)
    return make_error("cluster.wire_dtype = " + std::string(to_string(s.cluster.wire)) +
                      " quantizes DiLoCo's pseudo-gradients only (train.sync = diloco); for gradients every step use fp32 or bf16");
  const int64_t fragments = t.sync_fragments, every = t.sync_every;
  const int64_t overlap = t.sync_overlap >= 0 ? t.sync_overlap : (fragments > 1 ? 1 : 0);
  if (!diloco && (fragments > 1 || t.sync_overlap > 0))
    return make_error("train.sync_fragments and train.sync_overlap are Streaming DiLoCo's (train.sync = diloco); with train.sync = every_step leave them out");
  // A window is agreed at a new generation as an offset of 20 bits from
  // its anchor (rank/agreement.hpp, window_word); half that leaves room for
  // a window's overlapped steps.
  constexpr int64_t max_every = int64_t{1} << 19;
  if (diloco && every >= max_every)
    return make_error("train.sync_every (" + std::to_string(every) + ") must be below " + std::to_string(max_every) +
                      ": a DiLoCo window longer than that cannot be agreed when a worker is lost");
  if (diloco && fragments > every)
    return make_error("train.sync_fragments (" + std::to_string(fragments) + ") cannot exceed train.sync_every (" + std::to_string(every) +
                      "): each fragment synchronises at its own step of the window");
  if (diloco && overlap * fragments >= every)
    return make_error("train.sync_overlap (" + std::to_string(overlap) + ") must stay below train.sync_every / train.sync_fragments (" +
                      std::to_string(every) + "/" + std::to_string(fragments) + "): a fragment's exchange lands before the next fragment's leaves");
  if (!diloco && s.modes.diloco_worker == diloco_worker_kind::host)
    return make_error("train.diloco_worker = host makes a host's ranks one DiLoCo worker; it needs train.sync = diloco");
  return {};
}

}  // namespace

result<model_settings> model_settings_of(const config& cfg) {
  model_settings m;
  m.name = cfg.get_string("model.name");
  m.builtin = mode_from_string<builtin_model>(m.name);
  m.file = cfg.get_string("model.file");
  m.vocab_size = cfg.get_int("model.vocab_size");
  m.dim = cfg.get_int("model.dim");
  m.layers = cfg.get_int("model.layers");
  m.heads = cfg.get_int("model.heads");
  m.mlp_ratio = cfg.get_double("model.mlp_ratio");
  m.dropout = cfg.get_double("model.dropout");
  m.patch_size = cfg.get_int("model.patch_size");
  m.classes = cfg.get_int("model.classes");
  m.context = cfg.get_int("model.context");
  m.label_smoothing = cfg.get_double("model.label_smoothing");
  if (m.builtin && *m.builtin != builtin_model::torchscript && m.dim % m.heads != 0)
    return make_error("model.heads (" + std::to_string(m.heads) + ") must divide model.dim (" + std::to_string(m.dim) + ")");
  if (m.dropout >= 1.0) return make_error("model.dropout must be below 1");
  return m;
}

shard_read_settings shard_read_settings_of(const config& cfg) {
  shard_read_settings r;
  r.cache.cache_dir = cfg.get_string("data.cache_dir");
  r.cache.cache_bytes = static_cast<uint64_t>(cfg.get_int("data.cache_bytes"));
  const std::string& endpoint = cfg.get_string("data.s3_endpoint");
  r.cache.s3_endpoint = endpoint.empty() ? cfg.get_string("checkpoint.s3_endpoint") : endpoint;
  r.shuffle_block_shards = cfg.get_int("data.shuffle_block_shards");
  r.read_ahead_blocks = cfg.get_int("data.read_ahead_blocks");
  return r;
}

result<data_settings> data_settings_of(const config& cfg) {
  data_settings d;
  d.fashion_mnist_dir = cfg.get_string("data.fashion_mnist_dir");
  d.freedict_eng_ita = cfg.get_string("data.freedict_eng_ita");
  d.gcide = cfg.get_string("data.gcide");
  d.val_fraction = cfg.get_double("data.val_fraction");
  d.max_text_bytes = cfg.get_int("data.max_text_bytes");
  d.train_inputs = cfg.get_string("data.train_inputs");
  d.train_targets = cfg.get_string("data.train_targets");
  d.eval_inputs = cfg.get_string("data.eval_inputs");
  d.eval_targets = cfg.get_string("data.eval_targets");
  d.train_tokens = cfg.get_string("data.train_tokens");
  d.eval_tokens = cfg.get_string("data.eval_tokens");
  d.train_shards = cfg.get_string("data.train_shards");
  d.eval_shards = cfg.get_string("data.eval_shards");
  d.shard_inputs = cfg.get_string("data.shard_inputs");
  d.shard_targets = cfg.get_string("data.shard_targets");
  d.sample_log = cfg.get_string("data.sample_log");
  d.shards = shard_read_settings_of(cfg);
  if (d.val_fraction >= 1.0) return make_error("data.val_fraction must be below 1");
  return d;
}

result<train_settings> train_settings_of(const config& cfg) {
  train_settings t;
  t.max_steps = cfg.get_int("train.max_steps");
  t.global_batch_size = cfg.get_int("train.global_batch_size");
  t.micro_batch_size = cfg.get_int("train.micro_batch_size");
  t.seed = cfg.get_int("train.seed");
  t.loss_is_nll = cfg.get_bool("train.loss_is_nll");
  t.lr = cfg.get_double("train.lr");
  t.min_lr = cfg.get_double("train.min_lr");
  t.beta1 = cfg.get_double("train.beta1");
  t.beta2 = cfg.get_double("train.beta2");
  t.weight_decay = cfg.get_double("train.weight_decay");
  t.warmup_steps = cfg.get_int("train.warmup_steps");
  t.grad_clip = cfg.get_double("train.grad_clip");
  t.bf16 = cfg.get_bool("train.bf16");
  auto precision = mode_of<precision_mode>(cfg);
  if (!precision) return precision.err();
  t.precision = precision.value();
  t.zero = cfg.get_int("train.zero");
  t.zero_replicas = cfg.get_int("train.zero_replicas");
  t.sync_every = cfg.get_int("train.sync_every");
  t.outer_lr = cfg.get_double("train.outer_lr");
  t.outer_momentum = cfg.get_double("train.outer_momentum");
  t.sync_fragments = cfg.get_int("train.sync_fragments");
  t.sync_overlap = cfg.get_int("train.sync_overlap");
  t.sync_mix = cfg.get_double("train.sync_mix");
  t.activation_checkpointing = cfg.get_bool("train.activation_checkpointing");
  t.threads = cfg.get_int("train.threads");
  t.log_every_steps = cfg.get_int("train.log_every_steps");
  if (auto st = check_train(t); !st) return st.err();
  return t;
}

eval_settings eval_settings_of(const config& cfg) {
  eval_settings e;
  e.every_steps = cfg.get_int("eval.every_steps");
  e.batch_size = cfg.get_int("eval.batch_size");
  e.max_samples = cfg.get_int("eval.max_samples");
  return e;
}

result<cluster_settings> cluster_settings_of(const config& cfg) {
  cluster_settings c;
  for (auto [key, field] : {std::pair{"cluster.min_nodes", &c.min_nodes}, std::pair{"cluster.floor_nodes", &c.floor_nodes},
                            std::pair{"cluster.max_nodes", &c.max_nodes}, std::pair{"cluster.flap_max_failures", &c.flap_max_failures}}) {
    auto n = count_of(cfg, key);
    if (!n) return n.err();
    *field = n.value();
  }
  c.max_ranks_per_node = static_cast<int32_t>(std::min<int64_t>(cfg.get_int("cluster.max_ranks_per_node"), std::numeric_limits<int32_t>::max()));
  c.heartbeat_interval = ms(cfg.get_int("cluster.heartbeat_interval_ms"));
  c.heartbeat_timeout = ms(cfg.get_int("cluster.heartbeat_timeout_ms"));
  c.suspect_timeout = ms(cfg.get_int("cluster.suspect_timeout_ms"));
  c.relay_group_size = static_cast<int32_t>(std::min<int64_t>(cfg.get_int("cluster.relay_group_size"), 4096));
  c.relay_from_nodes = static_cast<int32_t>(std::min<int64_t>(cfg.get_int("cluster.relay_from_nodes"), std::numeric_limits<int32_t>::max()));
  c.settle = ms(cfg.get_int("cluster.settle_ms"));
  c.flap_window = ms(cfg.get_int("cluster.flap_window_ms"));
  c.quarantine = ms(cfg.get_int("cluster.quarantine_ms"));
  c.collective_timeout = ms(cfg.get_int("cluster.collective_timeout_ms"));
  c.digest_every_steps = cfg.get_int("cluster.digest_every_steps");
  c.rank_exit_limit = cfg.get_int("cluster.rank_exit_limit");
  c.spare_ranks = static_cast<int32_t>(std::min<int64_t>(cfg.get_int("cluster.spare_ranks"), 64));
  c.standby_nodes = static_cast<int32_t>(std::min<int64_t>(cfg.get_int("cluster.standby_nodes"), 1024));
  auto wire = mode_of<wire_dtype>(cfg);
  if (!wire) return wire.err();
  c.wire = wire.value();
  if (c.wire == wire_dtype::automatic) {  // bf16 gradients cross hosts as bf16
    auto precision = mode_of<precision_mode>(cfg);
    if (!precision) return precision.err();
    c.wire = precision.value() == precision_mode::bf16 ? wire_dtype::bf16 : wire_dtype::fp32;
  }
  c.bucket_kb = cfg.get_int("cluster.bucket_kb");
  c.shm_allreduce = cfg.get_bool("cluster.shm_allreduce");
  c.shm_ring_mb = cfg.get_int("cluster.shm_ring_mb");
  c.heal_while_training = cfg.get_bool("cluster.heal_while_training");
  c.spin_wait = std::chrono::microseconds(cfg.get_int("cluster.spin_wait_us"));
  return c;
}

checkpoint_settings checkpoint_settings_of(const config& cfg) {
  checkpoint_settings c;
  c.dir = cfg.get_string("checkpoint.dir");
  c.keep_last = cfg.get_int("checkpoint.keep_last");
  c.keep_best = cfg.get_bool("checkpoint.keep_best");
  const std::string& metric = cfg.get_string("checkpoint.best_metric");
  c.best_metric = metric.empty() ? main_metric_for(cfg.get_string("model.name")) : metric;
  c.s3_endpoint = cfg.get_string("checkpoint.s3_endpoint");
  c.every_steps = cfg.get_int("checkpoint.every_steps");
  c.keep_buffer = cfg.get_bool("checkpoint.keep_buffer");
  c.defer_while_writing = cfg.get_bool("checkpoint.defer_while_writing");
  return c;
}

result<job_settings> job_settings_of(const config& cfg) {
  job_settings s;
  auto modes = job_modes_of(cfg);
  if (!modes) return modes.err();
  s.modes = modes.value();
  auto train = train_settings_of(cfg);
  if (!train) return train.err();
  s.train = std::move(train.value());
  auto model = model_settings_of(cfg);
  if (!model) return model.err();
  s.model = std::move(model.value());
  auto data = data_settings_of(cfg);
  if (!data) return data.err();
  s.data = std::move(data.value());
  s.eval = eval_settings_of(cfg);
  auto cluster = cluster_settings_of(cfg);
  if (!cluster) return cluster.err();
  s.cluster = std::move(cluster.value());
  s.checkpoint = checkpoint_settings_of(cfg);
  if (auto st = check_sync(s); !st) return st.err();
  return s;
}

}  // namespace dtactor
