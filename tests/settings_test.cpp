// The typed settings (job/settings.hpp): the structs' defaults are the
// schema's, each field reads its own key, and a bad value is one line that
// names the key.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "dtactor/config.hpp"
#include "job/job_config.hpp"
#include "job/settings.hpp"

namespace dtactor {
namespace {

config with(const std::vector<std::pair<std::string, std::string>>& keys) {
  config c;
  for (const auto& [k, v] : keys) {
    auto st = c.set(k, v);
    EXPECT_TRUE(st) << k << ": " << (st ? "" : st.message());
  }
  return c;
}

// The error job_settings_of gives for these keys ("" when it reads them).
std::string refused(const std::vector<std::pair<std::string, std::string>>& keys) {
  auto s = job_settings_of(with(keys));
  if (s) return "";
  EXPECT_EQ(s.message().find('\n'), std::string::npos) << "one line: " << s.message();
  return s.message();
}

#define EXPECT_FIELD(section, field) EXPECT_EQ(parsed.section.field, defaults.section.field) << #section "." #field ": the struct's default is not the schema's"

// The config's defaults are the schema's: read into the structs, they are
// the structs' own defaults, field by field.
TEST(Settings, TheStructsDefaultsAreTheSchemas) {
  auto read = job_settings_of(config{});
  ASSERT_TRUE(read) << read.message();
  const job_settings& parsed = read.value();
  const job_settings defaults;
  for (auto f : {&model_settings::name, &model_settings::file}) EXPECT_EQ(parsed.model.*f, defaults.model.*f);
  EXPECT_FIELD(model, builtin);
  for (auto f : {&model_settings::vocab_size, &model_settings::dim, &model_settings::layers, &model_settings::heads, &model_settings::patch_size,
                 &model_settings::classes, &model_settings::context})
    EXPECT_EQ(parsed.model.*f, defaults.model.*f);
  for (auto f : {&model_settings::mlp_ratio, &model_settings::dropout, &model_settings::label_smoothing}) EXPECT_EQ(parsed.model.*f, defaults.model.*f);
  for (auto f : {&data_settings::fashion_mnist_dir, &data_settings::freedict_eng_ita, &data_settings::gcide, &data_settings::train_inputs,
                 &data_settings::train_targets, &data_settings::eval_inputs, &data_settings::eval_targets, &data_settings::train_tokens,
                 &data_settings::eval_tokens, &data_settings::train_shards, &data_settings::eval_shards, &data_settings::shard_inputs,
                 &data_settings::shard_targets, &data_settings::sample_log})
    EXPECT_EQ(parsed.data.*f, defaults.data.*f);
  EXPECT_FIELD(data, val_fraction);
  EXPECT_FIELD(data, max_text_bytes);
  EXPECT_FIELD(data, shards.cache.cache_dir);
  EXPECT_FIELD(data, shards.cache.cache_bytes);
  EXPECT_FIELD(data, shards.cache.s3_endpoint);
  EXPECT_FIELD(data, shards.shuffle_block_shards);
  EXPECT_FIELD(data, shards.read_ahead_blocks);
  for (auto f : {&train_settings::max_steps, &train_settings::global_batch_size, &train_settings::micro_batch_size, &train_settings::seed,
                 &train_settings::zero, &train_settings::sync_every, &train_settings::sync_fragments, &train_settings::sync_overlap,
                 &train_settings::threads, &train_settings::warmup_steps, &train_settings::zero_replicas, &train_settings::log_every_steps})
    EXPECT_EQ(parsed.train.*f, defaults.train.*f);
  for (auto f : {&train_settings::lr, &train_settings::min_lr, &train_settings::beta1, &train_settings::beta2, &train_settings::outer_momentum,
                 &train_settings::sync_mix, &train_settings::weight_decay, &train_settings::grad_clip, &train_settings::outer_lr})
    EXPECT_EQ(parsed.train.*f, defaults.train.*f);
  EXPECT_FIELD(train, loss_is_nll);
  EXPECT_FIELD(train, activation_checkpointing);
  EXPECT_FIELD(train, bf16);
  EXPECT_FIELD(train, precision);
  for (auto f : {&eval_settings::every_steps, &eval_settings::batch_size, &eval_settings::max_samples}) EXPECT_EQ(parsed.eval.*f, defaults.eval.*f);
  for (auto f : {&cluster_settings::min_nodes, &cluster_settings::floor_nodes, &cluster_settings::max_nodes, &cluster_settings::max_ranks_per_node,
                 &cluster_settings::flap_max_failures})
    EXPECT_EQ(parsed.cluster.*f, defaults.cluster.*f);
  for (auto f : {&cluster_settings::heartbeat_interval, &cluster_settings::heartbeat_timeout, &cluster_settings::suspect_timeout, &cluster_settings::settle,
                 &cluster_settings::flap_window, &cluster_settings::quarantine, &cluster_settings::collective_timeout})
    EXPECT_EQ(parsed.cluster.*f, defaults.cluster.*f);
  for (auto f : {&cluster_settings::digest_every_steps, &cluster_settings::rank_exit_limit, &cluster_settings::bucket_kb, &cluster_settings::shm_ring_mb})
    EXPECT_EQ(parsed.cluster.*f, defaults.cluster.*f);
  EXPECT_FIELD(cluster, wire);
  EXPECT_FIELD(cluster, shm_allreduce);
  EXPECT_FIELD(cluster, spin_wait);
  for (auto f : {&checkpoint_settings::dir, &checkpoint_settings::best_metric, &checkpoint_settings::s3_endpoint})
    EXPECT_EQ(parsed.checkpoint.*f, defaults.checkpoint.*f);
  EXPECT_FIELD(checkpoint, keep_last);
  EXPECT_FIELD(checkpoint, keep_best);
  EXPECT_FIELD(checkpoint, every_steps);
  EXPECT_FIELD(checkpoint, keep_buffer);
  EXPECT_FIELD(modes, sync);
  EXPECT_FIELD(modes, loss);
  EXPECT_FIELD(modes, backend);
}

TEST(Settings, EachFieldReadsItsKey) {
  auto s = job_settings_of(with({{"model.name", "gpt"},
                                 {"model.dim", "96"},
                                 {"model.heads", "3"},
                                 {"model.context", "64"},
                                 {"data.gcide", "/tmp/gcide"},
                                 {"data.cache_bytes", "1000"},
                                 {"checkpoint.s3_endpoint", "http://10.0.0.5:7480"},
                                 {"train.max_steps", "7"},
                                 {"train.sync", "diloco"},
                                 {"cluster.wire_dtype", "int8"},
                                 {"cluster.heartbeat_timeout_ms", "700"},
                                 {"cluster.max_ranks_per_node", "99999999999"}}));
  ASSERT_TRUE(s) << s.message();
  EXPECT_EQ(s->model.builtin, builtin_model::gpt);
  EXPECT_EQ(s->model.dim, 96);
  EXPECT_EQ(s->model.heads, 3);
  EXPECT_EQ(s->model.context, 64);
  EXPECT_EQ(s->data.gcide, "/tmp/gcide");
  EXPECT_EQ(s->data.shards.cache.cache_bytes, 1000u);
  EXPECT_EQ(s->data.shards.cache.s3_endpoint, "http://10.0.0.5:7480") << "data.s3_endpoint empty: checkpoint.s3_endpoint's";
  EXPECT_EQ(s->checkpoint.best_metric, "val_loss") << "checkpoint.best_metric empty: the model's main metric";
  EXPECT_EQ(s->train.max_steps, 7);
  EXPECT_EQ(s->modes.sync, sync_mode::diloco);
  EXPECT_EQ(s->cluster.wire, wire_dtype::int8);
  EXPECT_TRUE(quantized(s->cluster.wire));
  EXPECT_EQ(s->cluster.heartbeat_timeout, std::chrono::milliseconds(700));
  EXPECT_EQ(s->cluster.max_ranks_per_node, 2147483647) << "a larger value is held at the most a 32-bit count holds";
}

// The keys the training state, the step loop and the exchanges read.
TEST(Settings, TheTrainingAndExchangeFieldsReadTheirKeys) {
  auto s = job_settings_of(with({{"train.weight_decay", "0.01"},
                                 {"train.warmup_steps", "7"},
                                 {"train.grad_clip", "0"},
                                 {"train.bf16", "true"},
                                 {"train.precision", "fp32"},
                                 {"train.zero", "1"},
                                 {"train.zero_replicas", "3"},
                                 {"train.outer_lr", "0.5"},
                                 {"train.log_every_steps", "9"},
                                 {"eval.every_steps", "11"},
                                 {"eval.batch_size", "13"},
                                 {"eval.max_samples", "17"},
                                 {"checkpoint.every_steps", "19"},
                                 {"checkpoint.keep_buffer", "false"},
                                 {"cluster.digest_every_steps", "23"},
                                 {"cluster.rank_exit_limit", "0"},
                                 {"cluster.wire_dtype", "bf16"},
                                 {"cluster.bucket_kb", "29"},
                                 {"cluster.shm_allreduce", "false"},
                                 {"cluster.shm_ring_mb", "31"},
                                 {"cluster.spin_wait_us", "37"}}));
  ASSERT_TRUE(s) << s.message();
  EXPECT_EQ(s->train.weight_decay, 0.01);
  EXPECT_EQ(s->train.warmup_steps, 7);
  EXPECT_EQ(s->train.grad_clip, 0.0);
  EXPECT_TRUE(s->train.bf16);
  EXPECT_EQ(s->train.precision, precision_mode::fp32);
  auto b = job_settings_of(with({{"train.precision", "bf16"}, {"train.zero", "2"}}));
  ASSERT_TRUE(b) << b.message();
  EXPECT_EQ(b->train.precision, precision_mode::bf16);
  EXPECT_EQ(s->train.zero_replicas, 3);
  EXPECT_EQ(s->train.outer_lr, 0.5);
  EXPECT_EQ(s->train.log_every_steps, 9);
  EXPECT_EQ(s->eval.every_steps, 11);
  EXPECT_EQ(s->eval.batch_size, 13);
  EXPECT_EQ(s->eval.max_samples, 17);
  EXPECT_EQ(s->checkpoint.every_steps, 19);
  EXPECT_FALSE(s->checkpoint.keep_buffer);
  EXPECT_EQ(s->cluster.digest_every_steps, 23);
  EXPECT_EQ(s->cluster.rank_exit_limit, 0);
  EXPECT_EQ(s->cluster.wire, wire_dtype::bf16);
  EXPECT_FALSE(quantized(s->cluster.wire));
  EXPECT_EQ(s->cluster.bucket_kb, 29);
  EXPECT_FALSE(s->cluster.shm_allreduce);
  EXPECT_EQ(s->cluster.shm_ring_mb, 31);
  EXPECT_EQ(s->cluster.spin_wait, std::chrono::microseconds(37));
}

// cluster.wire_dtype = auto (the default): the gradients of a bf16 job
// cross hosts in bf16, an fp32 job's in fp32; a value set wins.
TEST(Settings, TheWireFollowsThePrecisionUnlessSet) {
  auto wire = [](const std::vector<std::pair<std::string, std::string>>& keys) {
    auto s = job_settings_of(with(keys));
    EXPECT_TRUE(s) << s.message();
    return s ? s->cluster.wire : wire_dtype::automatic;
  };
  EXPECT_EQ(wire({}), wire_dtype::fp32);
  EXPECT_EQ(wire({{"train.precision", "bf16"}}), wire_dtype::bf16);
  EXPECT_EQ(wire({{"train.precision", "bf16"}, {"cluster.wire_dtype", "fp32"}}), wire_dtype::fp32);
  EXPECT_EQ(wire({{"train.precision", "fp32"}, {"cluster.wire_dtype", "bf16"}}), wire_dtype::bf16);
  EXPECT_EQ(wire({{"cluster.wire_dtype", "auto"}}), wire_dtype::fp32);
}

TEST(Settings, ABadValueIsOneLineNamingTheKey) {
  EXPECT_EQ(refused({{"model.heads", "3"}}), "model.heads (3) must divide model.dim (64)");
  EXPECT_EQ(refused({{"model.name", "torchscript"}, {"model.heads", "3"}}), "") << "a scripted module has its own shapes";
  EXPECT_EQ(refused({{"model.dropout", "1"}}), "model.dropout must be below 1");
  EXPECT_EQ(refused({{"data.val_fraction", "1.5"}}), "data.val_fraction must be below 1");
  EXPECT_EQ(refused({{"train.micro_batch_size", "200"}}), "train.micro_batch_size (200) cannot exceed train.global_batch_size (128)");
  EXPECT_EQ(refused({{"train.zero", "4"}}).rfind("train.zero = 4 is not a ZeRO stage", 0), 0u);
  EXPECT_EQ(refused({{"train.precision", "bf16"}, {"train.bf16", "true"}}),
            "train.precision = bf16 computes in bf16 already; train.bf16 autocasts an fp32 model: set one of them");
  EXPECT_EQ(refused({{"train.precision", "bf16"}, {"train.zero", "3"}}), "");
  EXPECT_EQ(refused({{"train.precision", "bf16"}, {"train.sync", "diloco"}}).rfind("train.sync = diloco keeps its outer state", 0), 0u);
  EXPECT_EQ(refused({{"cluster.min_nodes", "3000000000"}}), "cluster.min_nodes = 3000000000 is more than dtactor counts (at most 2147483647)");
  EXPECT_EQ(refused({{"cluster.wire_dtype", "int4"}}).rfind("cluster.wire_dtype = int4 quantizes DiLoCo's pseudo-gradients only", 0), 0u);
  EXPECT_EQ(refused({{"train.sync", "diloco"}, {"train.sync_every", "4"}, {"train.sync_fragments", "5"}}),
            "train.sync_fragments (5) cannot exceed train.sync_every (4): each fragment synchronises at its own step of the window");
  EXPECT_EQ(refused({{"train.sync", "diloco"}, {"train.sync_every", "524288"}}),
            "train.sync_every (524288) must be below 524288: a DiLoCo window longer than that cannot be agreed when a worker is lost");
  EXPECT_EQ(refused({{"train.sync", "diloco"}, {"train.sync_every", "524287"}}), "");
  // Each section's own parse gives the same line.
  EXPECT_EQ(model_settings_of(with({{"model.dropout", "1"}})).message(), "model.dropout must be below 1");
  EXPECT_EQ(train_settings_of(with({{"train.beta2", "1"}})).message(), "train.beta1 and train.beta2 must be below 1");
  EXPECT_EQ(cluster_settings_of(with({{"cluster.flap_max_failures", "2147483648"}})).message(),
            "cluster.flap_max_failures = 2147483648 is more than dtactor counts (at most 2147483647)");
  // validate_training_config is job_settings_of's verdict.
  EXPECT_EQ(validate_training_config(with({{"model.heads", "3"}})).message(), "model.heads (3) must divide model.dim (64)");
  EXPECT_TRUE(validate_training_config(config{}));
}

}  // namespace
}  // namespace dtactor
