#pragma once
// The journal's schema: every event a run's journal.jsonl holds, one type
// each, with its name on disk and its fields, and the one JSON codec over
// them (job/journal_events.cpp). The coordinator's sink, `dtactor train`,
// `dtactor tune-batch`, the report and the tests all read and write the
// journal through these types; no site builds or matches a journal line by
// hand. Causes and sources are enums with one name table each.
//
// On disk a line is {"t": unix seconds, "event": NAME, ...fields}. A field
// in std::optional is written only when set (and read back as set only when
// present); a std::map<std::string, double> field is flattened into the
// line (an evaluation's metrics). Readers take what is missing as the
// field's default, so journals of older writers still read.
#include <cstdint>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "dtactor/result.hpp"

namespace dtactor::ev {

// ---- enums: each with one name table (journal_events.cpp) ----

// Why a generation starts. The changes since the previous plan are ordered
// most severe first (node_lost .. rank_ready): a plan's cause is the most
// severe one. Values match pb::generation_plan::generation_cause.
enum class plan_cause : int32_t {
  none = 0,  // no change noted
  node_lost = 1,
  rank_exited = 2,
  collective_failure = 3,
  node_left = 4,
  node_joined = 5,
  rank_ready = 6,
  start = 7,    // the first generation of a job
  restart = 8,  // a new coordinator could not adopt the running generation
  adopted = 9,  // a new coordinator took over the running generation
};

// Why the failure detector declared a node lost.
enum class loss_cause {
  heartbeat_timeout,                   // silent for cluster.heartbeat_timeout_ms
  suspected_after_collective_failure,  // silent for the suspect timeout after a peer's collective failed
  restarted,                           // registered again as a new process (incarnation)
  connection_closed,                   // its connection closed and it was not heard from again (at once after a peer's collective failed)
};

// Where a rank's starting state in a generation came from (pb::rank_status's
// state_source carries the same names).
enum class state_source {
  local,  // it kept its own
  peer,   // broadcast from a live rank
  disk,   // loaded from the checkpoint store
  fresh,  // nothing to keep or load: step 0
};

// Where a rank's optimizer shards came from in a generation (train.zero >= 1;
// pb::rank_status's optimizer_source carries the same names).
enum class optimizer_source {
  own,         // it kept the shards it holds
  replica,     // moved from the ranks holding them (a lost rank's from its replicas)
  checkpoint,  // both holders of some shard were lost: the newest checkpoint
  restart,     // ... and no checkpoint was committed: the job started over from step 0
};

// How a job ended.
enum class outcome { finished, stopped, failed };

// The names are stable: they are the journal's, the metrics' labels and the
// wire's. from_string is false (and `out` untouched) for any other text.
const char* to_string(plan_cause c);
const char* to_string(loss_cause c);
const char* to_string(state_source s);
const char* to_string(optimizer_source s);
const char* to_string(outcome o);
bool from_string(std::string_view s, plan_cause& out);
bool from_string(std::string_view s, loss_cause& out);
bool from_string(std::string_view s, state_source& out);
bool from_string(std::string_view s, optimizer_source& out);
bool from_string(std::string_view s, outcome& out);

// ---- events ----
// `fields(self, f)` lists the journaled fields as f("key", self.member); the
// codec visits it both ways. Members not listed are not journaled (said so).

// A coordinator started (a new session of the run directory).
struct coordinator_started {
  static constexpr std::string_view name = "coordinator_started";
  std::string listen;  // the bound address nodes register at
  std::string job_id;
  int32_t store_port = 0;
  int32_t metrics_port = 0;
  int64_t resume_step = -1;  // -1: starting over
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("listen", s.listen), f("job_id", s.job_id), f("store_port", s.store_port), f("metrics_port", s.metrics_port), f("resume_step", s.resume_step);
  }
};

// A torchscript job's module went into the store with the job.
struct module_shipped {
  static constexpr std::string_view name = "module_shipped";
  std::string file;
  std::string object;
  std::string digest;
  bool uploaded = false;  // false: it was already there
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("file", s.file), f("object", s.object), f("digest", s.digest), f("uploaded", s.uploaded);
  }
};

// A checkpoint looked at for resuming did not check out.
struct checkpoint_skipped {
  static constexpr std::string_view name = "checkpoint_skipped";
  std::string path;
  std::string reason;
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("path", s.path), f("reason", s.reason);
  }
};

// The coordinator will resume from this checkpoint (a rank journals
// checkpoint_restored once it loaded it).
struct checkpoint_found {
  static constexpr std::string_view name = "checkpoint_found";
  int64_t step = 0;
  std::string path;
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("step", s.step), f("path", s.path);
  }
};

struct node_joined {
  static constexpr std::string_view name = "node_joined";
  std::string node;
  // Not journaled: where Prometheus scrapes the node (the sink's service discovery).
  std::string peer;            // the bridge's routing id of its connection
  std::string advertise_addr;  // where its ranks (and its /metrics) are reached
  int32_t metrics_port = 0;    // 0: none
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("node", s.node);
  }
};

struct node_lost {
  static constexpr std::string_view name = "node_lost";
  std::string node;
  loss_cause cause = loss_cause::heartbeat_timeout;
  double detected_after_s = 0;
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("node", s.node), f("cause", s.cause), f("detected_after_s", s.detected_after_s);
  }
};

struct node_left {
  static constexpr std::string_view name = "node_left";
  std::string node;
  std::string reason;  // the node's own words (preemption notice, SIGTERM, ...)
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("node", s.node), f("reason", s.reason);
  }
};

// A node left on its cloud's preemption notice (--preemption-notice): next to
// its node_left. notice_s: the warning the cloud gave (announced - noticed);
// left_before_s: how long before the announced time the coordinator had it
// out of the membership (its ranks then finish the step in flight).
struct preemption_notice {
  static constexpr std::string_view name = "preemption_notice";
  std::string node;
  std::string cloud;
  std::string announced_time;  // as the cloud wrote it (empty for GCP, which gives none)
  double announced_unix_s = 0;
  int64_t at_step = 0;
  double notice_s = 0;
  double left_before_s = 0;
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("node", s.node), f("cloud", s.cloud), f("announced_time", s.announced_time), f("announced_unix_s", s.announced_unix_s),
        f("at_step", s.at_step), f("notice_s", s.notice_s), f("left_before_s", s.left_before_s);
  }
};

struct node_quarantined {
  static constexpr std::string_view name = "node_quarantined";
  std::string node;
  std::string reason;  // why and for how long
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("node", s.node), f("reason", s.reason);
  }
};

// Fewer nodes than cluster.floor_nodes: no generation until more arrive.
struct job_waiting {
  static constexpr std::string_view name = "job_waiting";
  uint64_t generation = 0;  // the last one
  std::string reason;
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("generation", s.generation), f("reason", s.reason);
  }
};

// A plan went out to the nodes.
struct generation_started {
  static constexpr std::string_view name = "generation_started";
  uint64_t generation = 0;
  int32_t world_size = 0;
  plan_cause cause = plan_cause::none;
  bool drain = false;
  int64_t start_step = 0;
  int32_t state_root = -1;  // global rank whose state everyone takes (-1: each keeps its own)
  std::vector<std::string> nodes;
  // Standby nodes (cluster.standby_nodes) planned in to take lost members'
  // places (absent: none).
  std::optional<std::vector<std::string>> standby_promoted = std::nullopt;
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("generation", s.generation), f("world_size", s.world_size), f("cause", s.cause), f("drain", s.drain), f("start_step", s.start_step),
        f("state_root", s.state_root), f("nodes", s.nodes), f("standby_promoted", s.standby_promoted);
  }
};

// A restarted coordinator took over the generation the nodes are running.
struct generation_adopted {
  static constexpr std::string_view name = "generation_adopted";
  uint64_t generation = 0;
  int32_t world_size = 0;
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("generation", s.generation), f("world_size", s.world_size);
  }
};

// A step every rank completed: from the coordinator (every rank reported it)
// or from `dtactor train` (its one rank, every train.report_every steps).
struct step_completed {
  static constexpr std::string_view name = "step";
  int64_t step = 0;
  int32_t world_size = 0;
  std::optional<uint64_t> generation;  // cluster
  double loss = 0;                     // sample-weighted mean over the ranks; non-finite is written as null
  std::optional<double> loss_avg;      // the mean loss over the steps since the previous line
  double lr = 0;
  double samples_per_s = 0;
  std::optional<double> data_wait_s;          // train: per step
  std::optional<double> allreduce_s;          // cluster: per step
  std::optional<double> allreduce_exposed_s;  // cluster: per step
  std::optional<double> compute_s;            // cluster: per step, forward and backward (slowest rank)
  std::optional<double> update_s;             // cluster: per step, the optimizer (zero >= 1: and the parameter all-gather)
  std::optional<double> gather_s;             // cluster, zero >= 1: per step, of update_s the parameter all-gather
  std::optional<double> pass_gather_s;        // cluster, zero = 3: per step, of compute_s the unit gathers and releases
  double step_s = 0;  // per step (the slowest rank); 0: not measured (`dtactor train`)
  // Not journaled (metrics only).
  int64_t samples = 0;  // over the steps the reports covered
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("step", s.step), f("world_size", s.world_size), f("generation", s.generation), f("loss", s.loss), f("loss_avg", s.loss_avg), f("lr", s.lr),
        f("samples_per_s", s.samples_per_s), f("step_s", s.step_s), f("data_wait_s", s.data_wait_s), f("allreduce_s", s.allreduce_s),
        f("allreduce_exposed_s", s.allreduce_exposed_s), f("compute_s", s.compute_s), f("update_s", s.update_s),
        f("gather_s", s.gather_s), f("pass_gather_s", s.pass_gather_s);
  }
};

// train.sync = diloco: a synchronisation (outer step) every rank took, as
// global rank 0 reported it. The link is busy for exchange_s of the
// window's window_s (link_busy = exchange_s / window_s).
struct outer_step {
  static constexpr std::string_view name = "outer_step";
  int64_t step = 0;
  uint64_t generation = 0;
  int32_t world_size = 0;
  int64_t inner_steps = 0;        // of the window it closed
  uint64_t payload_bytes = 0;     // the pseudo-gradient each rank handed to the exchange (fp32)
  double exchange_s = 0;          // the exchange in flight
  double window_s = 0;            // wall time of the window, its exchange included
  double pseudo_grad_norm = 0;    // of the workers' average
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("step", s.step), f("generation", s.generation), f("world_size", s.world_size), f("inner_steps", s.inner_steps),
        f("payload_bytes", s.payload_bytes), f("exchange_s", s.exchange_s), f("window_s", s.window_s), f("pseudo_grad_norm", s.pseudo_grad_norm);
  }
};

// Each rank's resource use so far (a few times a minute, and at the end).
// Sharded data (docs/data.md): a rank process's reading since it started
// (data/data_shards' counters; read_ahead_depth and cache_bytes are now).
struct data_reading {
  uint64_t bytes_s3 = 0, bytes_local = 0, cache_hits = 0, cache_misses = 0, shards_verified = 0, shards_failed = 0;
  uint64_t read_ahead_depth = 0, cache_bytes = 0, cache_peak_bytes = 0;
};

struct rank_resources {
  int32_t rank = 0;
  std::string node;
  double rss_bytes = 0;
  double peak_rss_bytes = 0;
  double cpu_s = 0;
  double elapsed_s = 0;  // the process's age
  // Training state the rank holds (train.zero shards the optimizer's,
  // replicas included); absent when it did not say.
  std::optional<uint64_t> param_bytes, grad_bytes, optimizer_state_bytes;
  // The host buffer of its checkpoint part (checkpoint.keep_buffer).
  std::optional<uint64_t> checkpoint_buffer_bytes;
  // Sharded data (docs/data.md): the rank process's reading since it
  // started; absent when it reads no shards.
  std::optional<uint64_t> data_bytes_s3, data_bytes_local, data_cache_hits, data_cache_misses, data_shards_verified, data_shards_failed,
      data_read_ahead_depth, data_cache_bytes, data_cache_peak_bytes;
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("rank", s.rank), f("node", s.node), f("rss_bytes", s.rss_bytes), f("peak_rss_bytes", s.peak_rss_bytes), f("cpu_s", s.cpu_s),
        f("elapsed_s", s.elapsed_s), f("param_bytes", s.param_bytes), f("grad_bytes", s.grad_bytes),
        f("optimizer_state_bytes", s.optimizer_state_bytes), f("checkpoint_buffer_bytes", s.checkpoint_buffer_bytes), f("data_bytes_s3", s.data_bytes_s3), f("data_bytes_local", s.data_bytes_local),
        f("data_cache_hits", s.data_cache_hits), f("data_cache_misses", s.data_cache_misses), f("data_shards_verified", s.data_shards_verified),
        f("data_shards_failed", s.data_shards_failed), f("data_read_ahead_depth", s.data_read_ahead_depth),
        f("data_cache_bytes", s.data_cache_bytes), f("data_cache_peak_bytes", s.data_cache_peak_bytes);
  }
};
struct resources {
  static constexpr std::string_view name = "resources";
  std::vector<rank_resources> ranks;
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("ranks", s.ranks);
  }
};

struct eval_done {
  static constexpr std::string_view name = "eval";
  int64_t step = 0;
  double duration_s = 0;
  std::map<std::string, double> metrics;  // flattened into the line
  std::vector<std::string> examples;      // written only when there are some
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("step", s.step), f("duration_s", s.duration_s), f("metrics", s.metrics), f("examples", s.examples);
  }
};

// The first step every rank of a generation after a failure completed.
struct recovery_done {
  static constexpr std::string_view name = "recovery_done";
  uint64_t generation = 0;
  int32_t world_size = 0;
  plan_cause cause = plan_cause::none;
  bool drain = false;
  int64_t resumed_step = 0;
  int64_t lost_steps = 0;  // completed steps before the failure that the generation did not resume from
  double duration_s = 0;   // from the plan to that step, on the actor's clock
  // train.zero >= 1: where the optimizer shards came from (the furthest any
  // rank went: checkpoint, then replica, then own) and the bytes of shards
  // and parameters the ranks moved in the reshard.
  std::optional<optimizer_source> optimizer;
  std::optional<uint64_t> reshard_bytes;
  // train.sync = diloco: the inner steps the lost workers had taken since
  // the last synchronisation, gone with them (the survivors' window
  // position times the ranks the world shrank by); the survivors keep
  // theirs, so lost_steps stays 0.
  std::optional<int64_t> lost_inner_steps;
  // ... and the slices of the window's steps no survivor held (the lost
  // workers', whether they had trained them or not), which the survivors
  // trained again before the next boundary: every sample of the window
  // reaches the global parameters once (one fragment, ranks as workers;
  // docs/diloco.md, "Failures").
  std::optional<int64_t> replayed_slices;
  // Where duration_s went, from the ranks' READY reports (absent when no
  // rank reported one): ready_s, the slowest rank's time from receiving the
  // plan to READY, made of drain_s (the slowest rank's time to end its
  // previous generation: a drain plan's training on to the agreed step
  // boundary, or abandoning the step in flight after a loss), group_s (the
  // group's rendezvous and connections beyond drain_s) and state_s (the
  // slowest rank's agreement and state transfer or reshard); first_step_s,
  // the rest of duration_s (the plan's delivery, the first step). Detection
  // is node_lost's detected_after_s.
  std::optional<double> ready_s, drain_s, group_s, state_s, first_step_s;
  // Ranks of the generation that were a node's warm spares, taking the
  // place of a rank process that exited (absent: none).
  std::optional<int32_t> spare_ranks;
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("generation", s.generation), f("world_size", s.world_size), f("cause", s.cause), f("drain", s.drain), f("resumed_step", s.resumed_step),
        f("lost_steps", s.lost_steps), f("duration_s", s.duration_s), f("optimizer_source", s.optimizer), f("reshard_bytes", s.reshard_bytes),
        f("lost_inner_steps", s.lost_inner_steps), f("replayed_slices", s.replayed_slices), f("ready_s", s.ready_s), f("drain_s", s.drain_s), f("group_s", s.group_s),
        f("state_s", s.state_s), f("first_step_s", s.first_step_s), f("spare_ranks", s.spare_ranks);
  }
};

// A rank took its state from a peer or from disk: in a cluster, the first
// rank of a new generation that did; in `dtactor train`, a resume.
struct checkpoint_restored {
  static constexpr std::string_view name = "checkpoint_restored";
  int64_t step = 0;
  state_source source = state_source::disk;  // peer or disk
  std::optional<uint64_t> generation;        // cluster
  std::optional<int32_t> root;               // cluster: the global rank it came from
  std::optional<uint64_t> bytes;             // peer: state bytes received
  std::optional<double> transfer_s;          // peer: how long that took
  std::optional<double> gb_per_s;            // peer: bytes / transfer_s / 1e9
  std::optional<std::string> path;           // train: the manifest
  // peer: received while the generation's first step trained
  // (cluster.heal_while_training; no transfer_s then)
  std::optional<bool> while_training;
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("step", s.step), f("source", s.source), f("generation", s.generation), f("root", s.root), f("bytes", s.bytes), f("transfer_s", s.transfer_s),
        f("gb_per_s", s.gb_per_s), f("path", s.path), f("while_training", s.while_training);
  }
};

// A rank failed (its own report: "rank_failed") or its process ended (its
// node's report: "rank_exited"): one type, two names.
struct rank_down {
  static constexpr std::string_view failed_name = "rank_failed";
  static constexpr std::string_view exited_name = "rank_exited";
  bool failed = true;  // which of the two; the name says it on disk
  int32_t rank = 0;
  int32_t local_rank = 0;
  std::string node;
  std::string detail;
  int32_t exit_code = 0;
  int64_t step = 0;
  uint64_t generation = 0;
  // rank_exited: a warm spare of its node took its place (absent: none did).
  std::optional<bool> spare;
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("rank", s.rank), f("local_rank", s.local_rank), f("node", s.node), f("detail", s.detail), f("exit_code", s.exit_code), f("step", s.step),
        f("generation", s.generation), f("spare", s.spare);
  }
};

// A node reported that it cannot run its part of the job.
struct job_error {
  static constexpr std::string_view name = "job_error";
  std::string node;
  std::string message;
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("node", s.node), f("message", s.message);
  }
};

struct checkpoint_saved {
  static constexpr std::string_view name = "checkpoint_saved";
  int64_t step = 0;
  std::string path;                    // the manifest
  int64_t bytes = 0;                   // state bytes, all parts
  std::optional<uint64_t> generation;  // cluster
  double duration_s = 0;               // the commit
  int32_t parts = 0;
  double stall_s = 0;      // training held up at the step boundary (the slowest rank)
  double write_s = 0;      // storing the parts in the background (the slowest rank)
  double bytes_per_s = 0;  // bytes / write_s
  int32_t direct_ranks = 0;  // ranks that wrote their part straight from the state (checkpoint.direct)
  // Deferred (checkpoint.defer_while_writing): the step it fell due at, while a rank still
  // stored the previous checkpoint.
  std::optional<int64_t> due_step;
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("step", s.step), f("path", s.path), f("bytes", s.bytes), f("generation", s.generation), f("duration_s", s.duration_s), f("parts", s.parts),
        f("stall_s", s.stall_s), f("write_s", s.write_s), f("bytes_per_s", s.bytes_per_s), f("direct_ranks", s.direct_ranks), f("due_step", s.due_step);
  }
};

struct checkpoint_failed {
  static constexpr std::string_view name = "checkpoint_failed";
  int64_t step = 0;
  std::string reason;
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("step", s.step), f("reason", s.reason);
  }
};

// A rank refused the checkpoint it was to load (its bytes do not check
// out, or it does not fit the job): marked bad for this job, never planned
// again (actors/checkpoint_choice.hpp).
struct checkpoint_refused {
  static constexpr std::string_view name = "checkpoint_refused";
  int64_t step = 0;  // the refused checkpoint's
  int32_t rank = 0;
  std::string node;
  uint64_t generation = 0;
  std::string reason;          // the rank's
  int64_t fallback_step = -1;  // what the next plan loads; -1: none is left, the job fails
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("step", s.step), f("rank", s.rank), f("node", s.node), f("generation", s.generation), f("reason", s.reason), f("fallback_step", s.fallback_step);
  }
};

// A stop was asked for (a signal): ranks stop after a final checkpoint.
struct job_stopping {
  static constexpr std::string_view name = "job_stopping";
  std::string reason;
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("reason", s.reason);
  }
};

// `dtactor train` started (a new session of the run directory).
struct job_started {
  static constexpr std::string_view name = "job_started";
  std::string model;
  int64_t parameters = 0;
  int64_t max_steps = 0;
  int64_t global_batch_size = 0;
  int32_t world_size = 1;
  int64_t start_step = 0;
  int32_t threads = 0;
  std::string blas;
  std::string config_digest;
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("model", s.model), f("parameters", s.parameters), f("max_steps", s.max_steps), f("global_batch_size", s.global_batch_size),
        f("world_size", s.world_size), f("start_step", s.start_step), f("threads", s.threads), f("blas", s.blas), f("config_digest", s.config_digest);
  }
};

// The job reached train.max_steps. `error`: the ranks finished with
// different parameters.
struct job_finished {
  static constexpr std::string_view name = "job_finished";
  int64_t step = 0;
  std::string params_digest;
  std::optional<int32_t> world_size;   // cluster
  std::optional<uint64_t> generation;  // cluster
  std::optional<double> wall_s;        // train
  std::optional<std::string> error;
  std::map<std::string, double> metrics;  // the last evaluation, flattened
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("step", s.step), f("params_digest", s.params_digest), f("world_size", s.world_size), f("generation", s.generation), f("wall_s", s.wall_s),
        f("error", s.error), f("metrics", s.metrics);
  }
};

// The job stopped before train.max_steps (a signal, stop_at_step).
struct job_stopped {
  static constexpr std::string_view name = "job_stopped";
  int64_t step = 0;
  std::optional<std::string> reason;
  std::optional<std::string> params_digest;
  std::optional<int32_t> world_size;
  std::optional<uint64_t> generation;
  std::optional<bool> final_checkpoint;  // cluster: every rank stopped after a final checkpoint
  std::optional<std::string> error;
  std::map<std::string, double> metrics;  // the last evaluation, flattened
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("step", s.step), f("reason", s.reason), f("params_digest", s.params_digest), f("world_size", s.world_size), f("generation", s.generation),
        f("final_checkpoint", s.final_checkpoint), f("error", s.error), f("metrics", s.metrics);
  }
};

struct job_failed {
  static constexpr std::string_view name = "job_failed";
  int64_t step = 0;
  std::optional<uint64_t> generation;  // cluster
  std::string reason;
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("step", s.step), f("generation", s.generation), f("reason", s.reason);
  }
};

// The job's goodput so far (monitoring/goodput.hpp defines the buckets):
// productive seconds over wall seconds since the coordinator started, and
// where the rest went. Beside each resources line and before the job's end line.
struct goodput {
  static constexpr std::string_view name = "goodput";
  double ratio = 0;  // productive_s / wall_s
  double wall_s = 0;
  double productive_s = 0, start_s = 0, recovery_s = 0, waiting_s = 0, checkpoint_s = 0, eval_s = 0, other_s = 0;
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("ratio", s.ratio), f("wall_s", s.wall_s), f("productive_s", s.productive_s), f("start_s", s.start_s), f("recovery_s", s.recovery_s),
        f("waiting_s", s.waiting_s), f("checkpoint_s", s.checkpoint_s), f("eval_s", s.eval_s), f("other_s", s.other_s);
  }
};

// `dtactor tune-batch`.
struct batch_size_search_started {
  static constexpr std::string_view name = "batch_size_search_started";
  std::string model;
  int64_t max_memory_bytes = 0;  // per rank
  int64_t start = 0;
  int64_t up_to = 0;
  int32_t steps = 0;
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("model", s.model), f("max_memory_bytes", s.max_memory_bytes), f("start", s.start), f("up_to", s.up_to), f("steps", s.steps);
  }
};
struct batch_size_trial {
  static constexpr std::string_view name = "batch_size_trial";
  int64_t micro_batch = 0;
  bool fits = false;
  double peak_rss_bytes = 0;
  std::optional<double> samples_per_s;  // fits
  std::optional<std::string> reason;    // does not fit
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("micro_batch", s.micro_batch), f("fits", s.fits), f("peak_rss_bytes", s.peak_rss_bytes), f("samples_per_s", s.samples_per_s),
        f("reason", s.reason);
  }
};
// micro_batch 0: nothing fit (then only max_memory_bytes is set besides).
struct batch_size_found {
  static constexpr std::string_view name = "batch_size_found";
  int64_t micro_batch = 0;
  int64_t max_memory_bytes = 0;
  std::optional<double> peak_rss_bytes;
  std::optional<double> samples_per_s;
  std::optional<bool> limited_by_up_to;  // every size tried fit
  std::optional<int64_t> trials;
  template <class S, class F>
  static void fields(S& s, F& f) {
    f("micro_batch", s.micro_batch), f("max_memory_bytes", s.max_memory_bytes), f("peak_rss_bytes", s.peak_rss_bytes),
        f("samples_per_s", s.samples_per_s), f("limited_by_up_to", s.limited_by_up_to), f("trials", s.trials);
  }
};

using journal_event = std::variant<coordinator_started, module_shipped, checkpoint_skipped, checkpoint_found, node_joined, node_lost, node_left, preemption_notice,
                                   node_quarantined, job_waiting, generation_started, generation_adopted, step_completed, outer_step, resources, eval_done,
                                   recovery_done, checkpoint_restored, rank_down, job_error, checkpoint_saved, checkpoint_failed, checkpoint_refused, job_stopping,
                                   job_started, job_finished, job_stopped, job_failed, goodput, batch_size_search_started, batch_size_trial, batch_size_found>;

// The event's name on disk.
std::string_view name_of(const journal_event& e);
// Whether `name` is a journal event of this version.
bool is_journal_event(std::string_view name);

// The event's fields as a JSON object (no "t", no "event").
nlohmann::json to_json(const journal_event& e);
// The event a JSON object names in its "event" field, read from its fields.
// Errors, one line each: no string "event", an event this version does not
// know, a field of the wrong type or an enum value it does not know.
result<journal_event> from_json(const nlohmann::json& j);

// One line of a journal file.
struct journal_line {
  double t = 0;  // unix seconds; 0 when the line has none
  journal_event event;
};
// Reads a line; errors as from_json's, and a line that is not a JSON object.
result<journal_line> parse_journal_line(std::string_view text);
// As parse_journal_line, but a well-formed line whose event this version
// does not know (a newer writer's) is std::nullopt, for readers that pass
// over such lines.
result<std::optional<journal_line>> read_journal_line(std::string_view text);

}  // namespace dtactor::ev
