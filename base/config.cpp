#include "dtactor/config.hpp"

#include <toml++/toml.h>

#include <algorithm>
#include <iterator>
#include <optional>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sys/stat.h>
#include <fstream>
#include <sstream>

#include "base/hash.hpp"
#include "base/task_catalog.hpp"

namespace dtactor {

namespace {

using vk = value_kind;

// model.*: which model and its shape.
std::vector<config_key> model_keys() {
  return {
    {"model.name", vk::string, "vit", "Model to train: vit (Fashion-MNIST, or image tar shards: data.train_shards), transformer (English->Italian), gpt (GCIDE text), torchscript (your PyTorch module, model.file, on .npy data).", -1e300, {"vit", "transformer", "gpt", "torchscript"}},
    {"model.vocab_size", vk::integer, "65536", "torchscript with token streams: every token id must be below it (checked when the files are opened).", 1, {}},
    {"model.file", vk::string, "", "torchscript: the file torch.jit.script(module).save(PATH) wrote."},
    {"model.dim", vk::integer, "64", "Width of the model (embedding size).", 8},
    {"model.layers", vk::integer, "4", "Number of blocks (encoder and decoder each, for transformer).", 1},
    {"model.heads", vk::integer, "4", "Attention heads; must divide model.dim.", 1},
    {"model.mlp_ratio", vk::floating, "4.0", "Hidden size of each MLP as a multiple of model.dim.", 0.25},
    {"model.dropout", vk::floating, "0.0", "Dropout probability in attention and MLP outputs.", 0.0},
    {"model.patch_size", vk::integer, "7", "vit: side of the square patches; must divide the image side (28 for Fashion-MNIST).", 1},
    {"model.classes", vk::integer, "10", "The number of classes of a classifier: vit on tar shards (data.train_shards), where every .cls id must be below it (Fashion-MNIST has 10), and tasks of your own that read it (examples/custom_task).", 2},
    {"model.context", vk::integer, "128", "gpt, torchscript token streams: tokens per training sequence; transformer: longest word kept.", 8},
    {"model.label_smoothing", vk::floating, "0.1", "transformer: label smoothing of the cross-entropy.", 0.0},
  };
}

// data.*: where the data is, and how sharded data is read and cached.
std::vector<config_key> data_keys() {
  return {
    {"data.fashion_mnist_dir", vk::string, "/usr/share/datasets/fashion-mnist", "Folder with the Fashion-MNIST IDX .gz files (Debian: dataset-fashion-mnist)."},
    {"data.freedict_eng_ita", vk::string, "/usr/share/dictd/freedict-eng-ita", "FreeDict English-Italian dictd files, without .index/.dict.dz (Debian: dict-freedict-eng-ita)."},
    {"data.gcide", vk::string, "/usr/share/dictd/gcide", "GCIDE dictd files, without .index/.dict.dz (Debian: dict-gcide)."},
    {"data.val_fraction", vk::floating, "0.05", "transformer, gpt: share of the data held out for evaluation.", 0.0},
    {"data.train_inputs", vk::string, "", "torchscript: training inputs, a NumPy .npy array (first axis = samples), memory-mapped; or .npy shards (a glob, a range, a list, s3://...), paired in order with those of data.train_targets."},
    {"data.train_targets", vk::string, "", "torchscript: training targets, .npy (class ids for cross_entropy, values for mse)."},
    {"data.eval_inputs", vk::string, "", "torchscript: held-out inputs, .npy (empty: data.val_fraction of the training arrays)."},
    {"data.eval_targets", vk::string, "", "torchscript: held-out targets, .npy."},
    {"data.train_tokens", vk::string, "", "torchscript: a token stream in nanoGPT's .bin format (flat uint16 ids); a sample is a window of model.context + 1 tokens. Shards: a glob, a {000..127} range, a comma list, or s3://bucket/prefix/train-*.bin (docs/data.md)."},
    {"data.eval_tokens", vk::string, "", "torchscript: held-out token stream, .bin, or shards as data.train_tokens (empty: the last data.val_fraction of data.train_tokens; of sharded tokens, its last shards)."},
    {"data.train_shards", vk::string, "", "torchscript, vit: WebDataset-style tar shards (a glob, a {000000..001023} range, a comma list, or s3://bucket/prefix/train-*.tar): the files of a sample share a key, its input is the first of data.shard_inputs it has, its target the first of data.shard_targets (docs/data.md)."},
    {"data.eval_shards", vk::string, "", "torchscript, vit: held-out tar shards (empty: the last data.val_fraction of data.train_shards' shards)."},
    {"data.shard_inputs", vk::string, "jpg;jpeg;png;npy", "Tar shards: the member that is a sample's input, the first present of these extensions (images become float [channels, height, width] in [0, 1], .npy arrays stay as they are)."},
    {"data.shard_targets", vk::string, "cls", "Tar shards: the member that is a sample's target, the first present of these extensions (.cls: a class id as decimal text; .npy: an array)."},
    {"data.shuffle_block_shards", vk::integer, "4", "Sharded data: samples are shuffled within blocks of this many shards (shards are permuted every epoch); the cache holds this many shards per block.", 1},
    {"data.read_ahead_blocks", vk::integer, "1", "Sharded data: blocks of shards fetched ahead of the one being trained on.", 0},
    {"data.cache_dir", vk::string, "", "Sharded data from S3: the local cache the ranks of a node share (empty: $TMPDIR/dtactor-data-cache)."},
    {"data.cache_bytes", vk::integer, "4294967296", "Sharded data from S3: the most the cache holds; at least (1 + data.read_ahead_blocks) x data.shuffle_block_shards of the largest shards.", 1},
    {"data.s3_endpoint", vk::string, "", "S3-compatible server for s3:// data (empty: checkpoint.s3_endpoint, else AWS_ENDPOINT_URL, else AWS)."},
    {"data.sample_log", vk::string, "", "Audit of the data order: a directory where every training process appends, per step whose update it applied, one tab-separated line: step, generation, global rank, world size, the sample indices it trained on (files samples-<process>-<pid>.tsv; bench/check_sample_log.py checks them: every index once per epoch). Made absolute where dtactor starts; empty = off (no cost)."},
    {"data.max_text_bytes", vk::integer, "0", "gpt: use at most this many bytes of GCIDE text (0 = all).", 0},
  };
}

// train.*: the optimizer, the batch, sharding (ZeRO) and the sync mode.
std::vector<config_key> train_keys() {
  return {
    {"train.max_steps", vk::integer, "4000", "Optimizer steps to train.", 1},
    {"train.global_batch_size", vk::integer, "128", "Samples per optimizer step, summed over all ranks; independent of the world size.", 1},
    {"train.micro_batch_size", vk::integer, "0", "Samples per forward/backward pass on a rank; smaller than the rank's share means gradient accumulation (0 = the whole share).", 0},
    {"train.seed", vk::integer, "1234", "Seed of initialisation, data order and dropout.", 0},
    {"train.loss", vk::string, "cross_entropy", "torchscript without a loss() method: the loss of forward's output.", -1e300, {"cross_entropy", "mse"}},
    {"train.loss_is_nll", vk::boolean, "false", "torchscript: the loss is a negative log-likelihood (evaluation adds perplexity)."},
    {"train.lr", vk::floating, "0.002", "Peak learning rate (AdamW).", 0.0},
    {"train.min_lr", vk::floating, "0.00002", "Learning rate at the end of the cosine decay.", 0.0},
    {"train.warmup_steps", vk::integer, "200", "Steps of linear warm-up from 0 to train.lr.", 0},
    {"train.weight_decay", vk::floating, "0.05", "AdamW decoupled weight decay.", 0.0},
    {"train.beta1", vk::floating, "0.9", "AdamW beta1.", 0.0},
    {"train.beta2", vk::floating, "0.999", "AdamW beta2.", 0.0},
    {"train.grad_clip", vk::floating, "1.0", "Clip the global gradient norm to this value (0 = off).", 0.0},
    {"train.zero", vk::integer, "0", "Shard the training state across the ranks (ZeRO): 0 = every rank holds all of it; 1 = each rank keeps and updates only its shards of the AdamW moments (and their replicas), then the updated parameters are all-gathered; 2 = the gradients are reduce-scattered as well, so each rank receives and keeps only its shards' summed gradients; 3 = the parameters too: between uses a rank keeps only its shards' (and those of no unit: embeddings, heads), and each unit (a block of the built-in models) is gathered right before it runs. Parameters come out bit for bit as with 0 (2 and 3: where the reduction order is kept, see docs/zero.md).", 0},
    {"train.zero_replicas", vk::integer, "0", "train.zero >= 1: ranks holding each shard of the optimizer state, kept current every step, so that a lost rank or machine loses none of it (0 = 2 when the job spans more than one node, else 1).", 0},
    {"train.sync", vk::string, "every_step", "How the ranks' work is combined: every_step = the gradients are summed every step (synchronous data parallelism); diloco = each rank takes train.sync_every steps of its own AdamW on its share of the data, then the ranks average the change of their parameters and apply an outer Nesterov step (DiLoCo: far fewer bytes on the wire, for thin links; docs/diloco.md).", -1e300, {"every_step", "diloco"}},
    {"train.sync_every", vk::integer, "50", "train.sync = diloco: inner steps between two synchronisations (DiLoCo's H); boundaries fall at multiples of it and at train.max_steps.", 1},
    {"train.outer_lr", vk::floating, "0.7", "train.sync = diloco: learning rate of the outer Nesterov step (the DiLoCo paper's 0.7).", 0.0},
    {"train.outer_momentum", vk::floating, "0.9", "train.sync = diloco: momentum of the outer Nesterov step (the DiLoCo paper's 0.9).", 0.0},
    {"train.diloco_worker", vk::string, "rank", "train.sync = diloco: what one DiLoCo worker is. rank = every rank trains alone between synchronisations; host = the ranks of one host (machine) are one worker, synchronous inside (their gradients summed every step through shared memory, cluster.shm_allreduce), and only the hosts' pseudo-gradients cross the links between hosts (hierarchically: one rank per host sends).", -1e300, {"rank", "host"}},
    {"train.sync_fragments", vk::integer, "1", "train.sync = diloco: Streaming DiLoCo's fragments. The parameters (in module order) are cut into this many fragments of about equal size, synchronised at staggered steps (fragment f at (f+1)*H/F + k*H), so 1/F of the model crosses the link every H/F steps instead of all of it every H (docs/diloco.md).", 1},
    {"train.sync_overlap", vk::integer, "-1", "train.sync = diloco: inner steps a fragment's exchange overlaps (Streaming DiLoCo's tau): it leaves at its step and lands this many steps later while the workers train on; below train.sync_every / train.sync_fragments. -1 = 1 with several fragments, 0 with one.", -1},
    {"train.sync_mix", vk::floating, "0.5", "train.sync = diloco with an overlap: after a fragment's exchange lands, its local parameters become mix * local + (1 - mix) * global (Streaming DiLoCo's merge; 0 = take the global ones).", 0.0},
    {"train.bf16", vk::boolean, "false", "Run forward passes under bf16 autocast (CPU autocast of LibTorch)."},
    {"train.precision", vk::string, "fp32", "What the parameters are while a forward and backward run: fp32, or bf16 (the model's parameters and their gradients in bf16, fp32 master weights and AdamW moments in the optimizer, updated in fp32 and rounded to bf16 before each forward, the masters sharded with the moments from train.zero = 1 on; checkpoints hold the fp32 masters). Every train.zero level; not with train.bf16 (autocast of an fp32 model) or train.sync = diloco.", -1e300, {"fp32", "bf16"}},
    {"train.activation_checkpointing", vk::boolean, "false", "Recompute each block's activations in backward instead of storing them."},
    {"train.threads", vk::integer, "0", "Compute threads per process (0 = the machine's cores, split between the ranks a generation runs on it); they go to OpenBLAS, whose idle workers sleep at once (OPENBLAS_THREAD_TIMEOUT=4 unless set), and LibTorch's own pool is kept at 1 to avoid oversubscription. At most 4 x the machine's cores (256 on smaller machines).", 0},
    {"train.log_every_steps", vk::integer, "50", "Write a `step` journal event and a log line every N steps.", 1},
  };
}

// eval.*: held-out evaluation.
std::vector<config_key> eval_keys() {
  return {
    {"eval.every_steps", vk::integer, "1000", "Evaluate on held-out data every N steps (0 = only at the end).", 0},
    {"eval.batch_size", vk::integer, "500", "Samples per evaluation batch.", 1},
    {"eval.max_samples", vk::integer, "0", "Evaluate on at most this many held-out samples (0 = all).", 0},
  };
}

// checkpoint.*: what is saved, when and where.
std::vector<config_key> checkpoint_keys() {
  return {
    {"checkpoint.every_steps", vk::integer, "500", "Save a checkpoint every N steps (0 = only at the end).", 0},
    {"checkpoint.keep_last", vk::integer, "3", "Keep the newest N checkpoints.", 1},
    {"checkpoint.keep_buffer", vk::boolean, "true",
     "Keep the host buffer of this rank's checkpoint part (its share of the state) between checkpoints, so that a checkpoint holds training up for a copy only; false: allocated at each checkpoint and freed once stored (less memory, a longer stall)."},
    {"checkpoint.direct", vk::string, "auto",
     "true: write this rank's checkpoint part straight from the training state, 8 MB at a time, while the next step computes its gradients (its update waits for the write): no part-sized host buffer (12 bytes a parameter / world less at the memory peak, which binds for the largest model a job fits), for a stall of the write's part that the forward and backward do not cover. false: copied into a host buffer (checkpoint.keep_buffer) and written in the background. auto: the buffer when this host has room for one per rank beside each rank's step peak, else straight from the state (decided at each checkpoint; a buffer once made is used).", -1e300, {"auto", "true", "false"}},
    {"checkpoint.defer_while_writing", vk::boolean, "true",
     "true: a checkpoint that falls due while a rank still stores the previous one is taken at the first step boundary after every rank's writer is done (the ranks agree through the step's control words), instead of holding training up until that write ends; checkpoints then come as often as the store takes them. The last step's checkpoint and a stop's are never deferred. false: training waits for the previous write."},
    {"checkpoint.keep_best", vk::boolean, "true", "Also keep the checkpoint with the best evaluation metric."},
    {"checkpoint.best_metric", vk::string, "", "Metric that ranks checkpoints (empty = the model's main metric: accuracy for vit, exact_match for transformer, val_loss for gpt)."},
    {"checkpoint.dir", vk::string, "", "Where checkpoints go: a directory every node and the coordinator reach, or s3://bucket/prefix (empty = RUN_DIR/checkpoints)."},
    {"checkpoint.diloco_workers", vk::string, "all", "train.sync = diloco: whose inner state a checkpoint holds. all = every worker's own parameters, buffers and inner optimizer moments (global rank 0's as the state, the others' as sections of their own: the checkpoint is about the workers' count times the inner state), so a resume at the same world size is exact; first = global rank 0's alone (one worker's size), and every worker resumes with rank 0's.", -1e300, {"all", "first"}},
    {"checkpoint.s3_endpoint", vk::string, "", "S3-compatible server for s3:// checkpoint dirs, e.g. http://10.0.0.5:7480 (empty: AWS_ENDPOINT_URL, else AWS)."},
  };
}

// cluster.*: the coordinator, nodes and ranks: membership, liveness, collectives.
std::vector<config_key> cluster_keys() {
  return {
    {"cluster.min_nodes", vk::integer, "1", "Nodes (with a ready rank) the coordinator waits for before the job's first generation: the start gate, like torchrun's --nnodes MIN. Not a floor: see cluster.floor_nodes.", 1},
    {"cluster.floor_nodes", vk::integer, "1", "Once the job has started, the fewest nodes it keeps training with after losses; below it, it waits for nodes (journal: job_waiting). At most cluster.min_nodes.", 1},
    {"cluster.max_nodes", vk::integer, "64", "Most nodes planned into the world; further nodes wait outside as standbys (cluster.standby_nodes), and beyond those, registrations are refused (the node keeps asking).", 1},
    {"cluster.standby_nodes", vk::integer, "0",
     "Nodes admitted beyond cluster.max_nodes that wait outside the world as warm standbys (ranks started, model built, data opened, not counted in the world): when a member node is lost, the coordinator plans the first standby in at once, in the same re-plan, so the world keeps its size without waiting for cluster.settle_ms. Each standby costs a node's ranks' memory (at most 1024).", 0},
    {"cluster.max_ranks_per_node", vk::integer, "256",
     "Most rank processes one node may register with (its --nproc-per-node); a registration claiming more is refused, so that no "
     "one node can make the coordinator plan a world it cannot run.", 1},
    {"cluster.heartbeat_interval_ms", vk::integer, "100", "Heartbeat period on every link (coordinator<->node, node<->rank).", 1},
    {"cluster.heartbeat_timeout_ms", vk::integer, "1000", "Silence after which a peer is declared lost.", 1},
    {"cluster.backend", vk::string, "auto", "Collectives: auto (NCCL for CUDA tensors in CUDA builds, else Gloo), gloo or nccl.", -1e300, {"auto", "gloo", "nccl"}},
    {"cluster.bucket_kb", vk::integer, "128", "Gradient bucket size for allreduce; buckets are reduced while backward still runs (the smaller the last bucket, the less of the exchange waits after backward).", 1},
    {"cluster.shm_allreduce", vk::boolean, "true", "Exchange gradient buckets through shared memory between the ranks of one host instead of Gloo over loopback TCP; with ranks on several hosts and several on a host, hierarchically (each host sums through shared memory, one rank per host allreduces across hosts). Falls back to Gloo for every rank when /dev/shm cannot hold them."},
    {"cluster.heal_while_training", vk::boolean, "true",
     "A rank that joins without the current state (a replacement, a standby or a new node) receives it while the generation's first "
     "step trains: it starts its forward once the parameters have landed and takes the optimizer's moments at its update, so that the "
     "others wait for the parameters only, not the whole state. Applies to train.sync = every_step at train.zero = 0, 1 and 2, in fp32 "
     "and bf16: at 1 and 2 the moments (in bf16 with their fp32 masters) are resharded while the step trains too; at train.zero = 3, "
     "under DiLoCo, or when false, the whole state is sent before the first step."},
    {"cluster.shm_ring_mb", vk::integer, "64", "Bound of a rank's slot in the shared-memory segment (MB): gradient buckets, ZeRO's parameter all-gather and DiLoCo's exchanges pass through it as a ring, a rank running at most this far ahead of the slowest reader. A model whose step needs under half of it never waits (the slot then holds two steps); the largest bucket always fits.", 1},
    {"cluster.wire_dtype", vk::string, "auto", "Gradients that cross hosts (Gloo, not shared memory): auto (bf16 with train.precision = bf16, else fp32), fp32 (exact), bf16 (half the bytes; each rank's gradient rounded to bf16, summed in fp32), or int8 (train.sync = diloco only: a quarter of the bytes at 2 ranks; each rank's pseudo-gradient in int8 with one fp32 scale per 256 values, all-gathered and summed in fp32), or int4 (train.sync = diloco only: 4 bits a value with one fp32 scale per 64 values, 0.56 bytes a value).", -1e300, {"auto", "fp32", "bf16", "int8", "int4"}},
    {"cluster.spin_wait_us", vk::integer, "10000", "A rank waiting for its gradient allreduce polls (yielding the core) this long before it sleeps; keeps virtual CPUs from halting mid-collective (0 = sleep at once).", 0},
    {"cluster.collective_timeout_ms", vk::integer, "30000", "Upper bound of one collective (a dead peer is normally noticed much sooner).", 100},
    {"cluster.digest_every_steps", vk::integer, "100", "Every N steps all ranks compare a checksum of their parameters; a mismatch stops the job.", 0},
    {"cluster.suspect_timeout_ms", vk::integer, "300", "After a rank reports a failed collective, a node silent this long is declared lost (a live node heartbeats every interval).", 1},
    {"cluster.relay_from_nodes", vk::integer, "1000",
     "From this many member nodes on, nodes heartbeat through relays instead of the coordinator: groups of cluster.relay_group_size nodes by node rank, "
     "whose lowest-ranked member takes its group's heartbeats and passes them on in one message an interval, so that the coordinator's load grows with "
     "the number of groups, not of nodes. A loss is still detected cluster.heartbeat_timeout_ms after the node's last heartbeat (0 = never relay).", 0},
    {"cluster.relay_group_size", vk::integer, "64", "Nodes a heartbeat relay speaks for, counting itself (cluster.relay_from_nodes; at most 4096).", 2},
    {"cluster.settle_ms", vk::integer, "300", "After nodes or ranks join, wait this long after the last one for more before re-planning, so that a wave of joins lands in one generation. Losses are re-planned at once, and so is a join that only refills the world: one that brings it back to at most the largest size the job has had (a replacement for a lost or departed node, a restarted rank) once all the new node's ranks are ready.", 0},
    {"cluster.flap_max_failures", vk::integer, "3", "A node lost this many times within cluster.flap_window_ms is quarantined.", 1},
    {"cluster.flap_window_ms", vk::integer, "60000", "Window in which a node's losses count towards quarantine.", 1},
    {"cluster.quarantine_ms", vk::integer, "10000", "First quarantine of a flapping node; doubles on each repeat, at most 5 minutes.", 0},
    {"cluster.spare_ranks", vk::integer, "0",
     "Spare rank processes each node keeps started and warmed up (LibTorch loaded, model built, data opened), waiting: when a rank process of the node exits, a spare takes its place at once and the world is back at full size at the next generation, without a process start; the node then starts a new spare in the background. Each spare costs a rank's memory. A node's --spares overrides it (0 = none; at most 64).", 0},
    {"cluster.rank_exit_limit", vk::integer, "5", "A node whose rank processes exited (non-zero) this many times in a row, with no step completed beyond those completed before, stops restarting the rank that exited last (out of memory at that step, or broken there); the job goes on with the other ranks, and a node left with none leaves the job (0 = restart forever).", 0},
  };
}

// The one place where every key, its default and its meaning are written
// (one function per section, in the order `dtactor config --reference`
// lists them). docs/config.md is checked against this table by a test.
std::vector<config_key> make_schema() {
  std::vector<config_key> schema;
  for (auto section : {model_keys, data_keys, train_keys, eval_keys, checkpoint_keys, cluster_keys}) {
    auto keys = section();
    schema.insert(schema.end(), std::make_move_iterator(keys.begin()), std::make_move_iterator(keys.end()));
  }
  return schema;
}

std::string kind_name(value_kind k) {
  switch (k) {
    case vk::integer: return "an integer";
    case vk::floating: return "a number";
    case vk::boolean: return "true or false";
    case vk::string: return "a string";
  }
  return "?";
}

const config_key* find_key(const std::string& name) {
  for (const auto& k : config_schema())
    if (k.name == name) return &k;
  return nullptr;
}

// Damerau-Levenshtein distance (optimal string alignment): typos are
// dropped, doubled, swapped or wrong letters.
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i)
    for (size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

std::string unknown_key_message(const std::string& key, const std::string& origin) {
  std::string msg = origin + ": unknown config key '" + key + "'";
  // The closest key by edit distance (train.max_step, trian.max_steps,
  // checkpoint.keep), else one with the same last component (a key put in
  // the wrong section).
  const config_key* best = nullptr;
  size_t best_d = std::string::npos;
  for (const auto& k : config_schema()) {
    size_t d = edit_distance(key, k.name);
    if (d < best_d) best_d = d, best = &k;
  }
  auto dot = key.rfind('.');
  const std::string last = dot == std::string::npos ? key : key.substr(dot + 1);
  const size_t allowed = std::max<size_t>(2, key.size() / 4);
  if (!best || best_d > allowed) {
    best = nullptr;
    for (const auto& k : config_schema())
      if (k.name.substr(k.name.rfind('.') + 1) == last) best = &k;
  }
  // A prefix of a key (checkpoint.keep -> checkpoint.keep_last).
  if (!best)
    for (const auto& k : config_schema())
      if (k.name.compare(0, key.size(), key) == 0) {
        best = &k;
        break;
      }
  if (best) msg += " (did you mean '" + best->name + "'?";
  else msg += " (";
  return msg + (best ? "; " : "") + "`dtactor config --reference` lists every key)";
}

result<config_value> parse_text(const config_key& k, const std::string& text) {
  auto bad = [&] { return make_error("config key '" + k.name + "' must be " + kind_name(k.kind) + ", got '" + text + "'"); };
  switch (k.kind) {
    case vk::integer: {
      if (text.empty()) return bad();
      errno = 0;
      char* end = nullptr;
      long long v = std::strtoll(text.c_str(), &end, 10);
      if (errno != 0 || *end != '\0') return bad();
      return config_value{static_cast<int64_t>(v)};
    }
    case vk::floating: {
      if (text.empty()) return bad();
      errno = 0;
      char* end = nullptr;
      double v = std::strtod(text.c_str(), &end);
      if (errno != 0 || *end != '\0' || !std::isfinite(v)) return bad();
      return config_value{v};
    }
    case vk::boolean:
      if (text == "true" || text == "1") return config_value{true};
      if (text == "false" || text == "0") return config_value{false};
      return bad();
    case vk::string:
      return config_value{text};
  }
  return bad();
}

void flatten(const toml::table& t, const std::string& prefix, std::vector<std::pair<std::string, const toml::node*>>& out) {
  for (auto&& [k, v] : t) {
    std::string name = prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    if (auto* sub = v.as_table())
      flatten(*sub, name, out);
    else
      out.emplace_back(name, &v);
  }
}

}  // namespace

namespace {
std::vector<config_key>& schema_storage() {
  static std::vector<config_key> schema = make_schema();
  return schema;
}
}  // namespace

const std::vector<config_key>& config_schema() { return schema_storage(); }

status extend_config_schema(const std::string& model_name, const std::string& description, const std::vector<config_key>& keys) {
  auto& schema = schema_storage();
  for (size_t i = 0; i < keys.size(); ++i) {
    const auto& k = keys[i];
    if (k.name.rfind("model.", 0) != 0 && k.name.rfind("data.", 0) != 0)
      return make_error("config key '" + k.name + "' must be under model. or data. (model.* settings are part of the checkpoint's architecture check)");
    if (k.name.find_first_of(" \t\"'=[]") != std::string::npos || k.name.back() == '.')
      return make_error("config key '" + k.name + "' is not a valid name");
    if (find_key(k.name)) return make_error("config key '" + k.name + "' already exists");
    for (size_t j = 0; j < i; ++j)
      if (keys[j].name == k.name) return make_error("config key '" + k.name + "' is declared twice");
    auto v = parse_text(k, k.default_value);
    if (!v) return make_error("default of " + v.message());
    if (k.kind == vk::string && !k.choices.empty() &&
        std::find(k.choices.begin(), k.choices.end(), k.default_value) == k.choices.end())
      return make_error("default '" + k.default_value + "' of config key '" + k.name + "' is not one of its choices");
    if ((k.kind == vk::integer && static_cast<double>(std::get<int64_t>(v.value())) < k.min) ||
        (k.kind == vk::floating && std::get<double>(v.value()) < k.min))
      return make_error("default of config key '" + k.name + "' is below its minimum");
  }
  // After the model keys, so that `config --reference` keeps sections together.
  auto model_end = schema.begin();
  for (auto it = schema.begin(); it != schema.end(); ++it)
    if (it->name.rfind("model.", 0) == 0) model_end = it + 1;
  auto data_end = schema.begin();
  for (auto it = schema.begin(); it != schema.end(); ++it)
    if (it->name.rfind("data.", 0) == 0) data_end = it + 1;
  std::vector<config_key> model_keys, data_keys;
  for (const auto& k : keys) (k.name.rfind("model.", 0) == 0 ? model_keys : data_keys).push_back(k);
  const auto data_pos = data_end - schema.begin() + static_cast<std::ptrdiff_t>(model_keys.size());
  schema.insert(model_end, model_keys.begin(), model_keys.end());
  schema.insert(schema.begin() + data_pos, data_keys.begin(), data_keys.end());
  for (auto& k : schema)
    if (k.name == "model.name") {
      k.choices.push_back(model_name);
      k.doc += " Registered here: " + model_name + (description.empty() ? std::string() : " (" + description + ")") + ".";
    }
  return {};
}

std::string to_string(const config_value& v) {
  if (auto* i = std::get_if<int64_t>(&v)) return std::to_string(*i);
  if (auto* d = std::get_if<double>(&v)) {
    std::ostringstream os;
    os.precision(17);
    os << *d;
    std::string s = os.str();
    if (s.find_first_of(".eE") == std::string::npos && s.find("inf") == std::string::npos) s += ".0";
    return s;
  }
  if (auto* b = std::get_if<bool>(&v)) return *b ? "true" : "false";
  return std::get<std::string>(v);
}

config::config() {
  for (const auto& k : config_schema()) values_[k.name] = parse_text(k, k.default_value).value();
}

namespace {

// Durations (integer keys in milliseconds or microseconds) are at most a
// week. The actors add them to steady-clock times in nanoseconds, where
// anything beyond 2^63 ns (292 years) overflows: 9.3e15 ms did (undefined
// behaviour; a node took it from register_ack unchecked).
constexpr int64_t max_duration_ms = int64_t{7} * 24 * 3600 * 1000;

std::optional<int64_t> duration_limit(const std::string& key) {
  auto ends_with = [&](const char* suffix) {
    const std::string s(suffix);
    return key.size() > s.size() && key.compare(key.size() - s.size(), s.size(), s) == 0;
  };
  if (ends_with("_ms")) return max_duration_ms;
  if (ends_with("_us")) return max_duration_ms * 1000;
  return std::nullopt;
}

}  // namespace

status config::set_value(const std::string& key, config_value v, const std::string& origin) {
  const config_key* k = find_key(key);
  if (!k) return make_error(unknown_key_message(key, origin));
  if (k->kind == vk::integer || k->kind == vk::floating) {
    double num = k->kind == vk::integer ? static_cast<double>(std::get<int64_t>(v)) : std::get<double>(v);
    if (num < k->min) {
      std::ostringstream least;
      if (k->kind == vk::integer) least << static_cast<int64_t>(k->min);
      else least << k->min;
      return make_error(origin + ": config key '" + key + "' must be at least " + least.str() + ", got " + to_string(v));
    }
  }
  if (k->kind == vk::integer)
    if (auto limit = duration_limit(key); limit && std::get<int64_t>(v) > *limit)
      return make_error(origin + ": config key '" + key + "' must be at most " + std::to_string(*limit) + " (a week), got " + to_string(v));
  if (k->kind == vk::string && !k->choices.empty()) {
    const auto& s = std::get<std::string>(v);
    bool found = false;
    std::string list;
    for (const auto& c : k->choices) {
      found = found || c == s;
      list += (list.empty() ? "" : ", ") + c;
    }
    if (!found) return make_error(origin + ": config key '" + key + "' must be one of " + list + ", got '" + s + "'");
  }
  values_[key] = std::move(v);
  return {};
}

status config::set(const std::string& key, const std::string& text) {
  const config_key* k = find_key(key);
  if (!k) return make_error(unknown_key_message(key, "--set"));
  auto v = parse_text(*k, text);
  if (!v) return make_error("--set: " + v.message());
  return set_value(key, std::move(v.value()), "--set");
}

result<config> config::parse_toml(const std::string& text, const std::string& origin) {
  toml::table tbl;
  try {
    tbl = toml::parse(text, origin);
  } catch (const toml::parse_error& e) {
    const auto& src = e.source();
    return make_error(origin + ":" + std::to_string(src.begin.line) + ":" + std::to_string(src.begin.column) + ": malformed TOML: " + std::string(e.description()));
  }
  config cfg;
  std::vector<std::pair<std::string, const toml::node*>> items;
  flatten(tbl, "", items);
  for (const auto& item : items) {
    // Not a structured binding: clang before 16 cannot capture one (the fuzz build).
    const std::string& name = item.first;
    const toml::node* node = item.second;
    const config_key* k = find_key(name);
    std::string where = origin + ":" + std::to_string(node->source().begin.line);
    if (!k) return make_error(unknown_key_message(name, where));
    auto wrong = [&] {
      // A key with choices names them (a TOML boolean is taken where true and false are among them).
      std::string what = kind_name(k->kind);
      if (!k->choices.empty()) {
        what = "one of";
        for (size_t i = 0; i < k->choices.size(); ++i) what += (i ? ", " : " ") + k->choices[i];
      }
      return make_error(where + ": config key '" + name + "' must be " + what);
    };
    config_value v;
    switch (k->kind) {
      case vk::integer:
        if (!node->is_integer()) return wrong();
        v = node->as_integer()->get();
        break;
      case vk::floating:
        if (node->is_integer())
          v = static_cast<double>(node->as_integer()->get());
        else if (node->is_floating_point())
          v = node->as_floating_point()->get();
        else
          return wrong();
        if (!std::isfinite(std::get<double>(v))) return wrong();
        break;
      case vk::boolean:
        if (!node->is_boolean()) return wrong();
        v = node->as_boolean()->get();
        break;
      case vk::string:
        // A key whose choices are true and false (and more, such as auto)
        // takes a TOML boolean too.
        if (node->is_boolean() && std::find(k->choices.begin(), k->choices.end(), "true") != k->choices.end()) {
          v = std::string(node->as_boolean()->get() ? "true" : "false");
          break;
        }
        if (!node->is_string()) return wrong();
        v = node->as_string()->get();
        break;
    }
    if (auto st = cfg.set_value(name, std::move(v), where); !st) return st.err();
  }
  return cfg;
}

namespace {

// A config file's text: a regular file (a directory reads as nothing, and
// /dev/zero never ends) of at most max_config_bytes, read no further.
result<std::string> read_config_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return make_error("cannot read config file '" + path + "': " + std::strerror(errno));
  if (!S_ISREG(st.st_mode))
    return make_error("config file '" + path + "' is not a regular file (" + (S_ISDIR(st.st_mode) ? "a directory" : "a device, pipe or socket") +
                      "); give --config a TOML file");
  if (static_cast<uint64_t>(st.st_size) > max_config_bytes)
    return make_error("config file '" + path + "' is " + std::to_string(st.st_size) + " bytes, over the limit of " + std::to_string(max_config_bytes) +
                      " bytes; a job config is a few KB");
  std::ifstream in(path, std::ios::binary);
  if (!in) return make_error("cannot read config file '" + path + "': " + std::strerror(errno));
  std::string text(max_config_bytes + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<std::size_t>(in.gcount()));
  if (text.size() > max_config_bytes)
    return make_error("config file '" + path + "' grew over the limit of " + std::to_string(max_config_bytes) + " bytes while it was read");
  return text;
}

}  // namespace

result<config> config::load(const std::string& path, const std::vector<std::string>& overrides) {
  result<config> cfg = config{};
  if (!path.empty()) {
    auto text = read_config_file(path);
    if (!text) return text.err();
    cfg = parse_toml(text.value(), path);
    if (!cfg) return cfg;
  }
  for (const auto& o : overrides) {
    auto eq = o.find('=');
    if (eq == std::string::npos || eq == 0) return make_error("--set expects key=value, got '" + o + "'");
    if (auto st = cfg->set(o.substr(0, eq), o.substr(eq + 1)); !st) return st.err();
  }
  return cfg;
}

int64_t config::get_int(const std::string& key) const { return std::get<int64_t>(values_.at(key)); }
double config::get_double(const std::string& key) const { return std::get<double>(values_.at(key)); }
bool config::get_bool(const std::string& key) const { return std::get<bool>(values_.at(key)); }
const std::string& config::get_string(const std::string& key) const { return std::get<std::string>(values_.at(key)); }

std::string config::to_toml() const {
  std::ostringstream os;
  std::string section;
  for (const auto& k : config_schema()) {
    auto dot = k.name.find('.');
    std::string sec = k.name.substr(0, dot);
    if (sec != section) {
      os << (section.empty() ? "" : "\n") << "[" << sec << "]\n";
      section = sec;
    }
    const auto& v = values_.at(k.name);
    os << k.name.substr(dot + 1) << " = ";
    if (auto* s = std::get_if<std::string>(&v)) {
      os << toml::value<std::string>(*s);
    } else {
      os << to_string(v);
    }
    os << "\n";
  }
  return os.str();
}

std::string config::digest(const std::vector<std::string>& prefixes) const {
  std::string text;
  for (const auto& [k, v] : values_) {
    bool take = prefixes.empty();
    for (const auto& p : prefixes) take = take || k.rfind(p, 0) == 0;
    if (take) text += k + "=" + to_string(v) + "\n";
  }
  return hex64(hash64(text.data(), text.size()));
}

}  // namespace dtactor
