#pragma once
// dtactor's Prometheus metrics: one registry per process (prometheus-cpp),
// served as text on GET /metrics by civetweb (monitoring/http_server.hpp),
// with whatever routes the process adds (/sd, the status page).
//
// Naming follows Prometheus conventions: base units (seconds, bytes),
// counters end in _total, durations are histograms. Labels only where they
// split something meaningful and bounded (recovery cause, drop kind, a node's
// local rank). A constant `job` label, when given, is on every series.
// Every process also exports the standard process_cpu_seconds_total,
// process_resident_memory_bytes and process_start_time_seconds of itself.
//
// Every accessor is thread-safe (prometheus-cpp locks internally) and the
// returned references stay valid for the object's lifetime: look them up
// once, then Set/Increment/Observe from any thread.
#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "job/journal_events.hpp"

#include "dtactor/result.hpp"
#include "monitoring/http_server.hpp"

namespace dtactor {

struct metrics_hooks;

class metrics {
 public:
  // `job`: value of the constant label `job`; empty = no such label.
  explicit metrics(const std::string& job = {});
  ~metrics();
  metrics(const metrics&) = delete;
  metrics& operator=(const metrics&) = delete;

  // Serves GET /metrics on bind_host:port (an IPv4 address) from civetweb's
  // workers, until destruction. Port 0 means "off" and succeeds without
  // serving. Fails with one clear line when the port is taken or the address
  // is bad. Call at most once.
  status serve(int port, const std::string& bind_host = "0.0.0.0");
  // The same on a port the system picks (port() says which): nothing can
  // take it between choosing and binding.
  status serve_on_free_port(const std::string& bind_host);
  // The port actually served on, or 0 when not serving.
  int port() const { return port_; }

  // The exposition text a scrape would return now (for tests and reports).
  std::string render() const;
  // The reply the server sends for one request (civetweb parsed it). Pure
  // but for the routes' callbacks: tests call it without a socket.
  http_response respond(const std::string& method, const std::string& path) const;

  // Runs `fn` before every scrape (and render()), on the server's thread: for
  // values read on demand (/proc). Must be thread-safe and quick.
  void on_scrape(std::function<void()> fn);
  // Serves GET `path` (e.g. "/sd") with the body `fn` returns, besides
  // /metrics. `fn` runs on the server's thread and must be thread-safe.
  void add_route(const std::string& path, const std::string& content_type, std::function<std::string()> fn);

  prometheus::Registry& registry() { return *registry_; }

  // ---- gauges ----
  prometheus::Gauge& world_size() { return *world_size_; }
  prometheus::Gauge& generation() { return *generation_; }
  prometheus::Gauge& step() { return *step_; }  // last committed step
  prometheus::Gauge& nodes_alive() { return *nodes_alive_; }
  prometheus::Gauge& loss() { return *loss_; }
  prometheus::Gauge& learning_rate() { return *learning_rate_; }
  prometheus::Gauge& samples_per_second() { return *samples_per_second_; }
  prometheus::Gauge& max_steps() { return *max_steps_; }  // train.max_steps: progress and ETA

  // ---- counters ----
  prometheus::Counter& samples() { return *samples_; }  // dtactor_samples_total
  // dtactor_recoveries_total{cause}: the cause's journal name
  // (ev::plan_cause: "node_lost", "rank_exited", "node_left", ...).
  prometheus::Counter& recoveries(ev::plan_cause cause);
  prometheus::Counter& lost_steps() { return *lost_steps_; }  // completed steps a recovery did not resume from
  // dtactor_spare_takeovers_total: rank processes that took a rank's place
  // from a node's warm spares (the coordinator: ranks planned in so, from
  // recovery_done's spare_ranks; a node: its own takeovers).
  prometheus::Counter& spare_takeovers() { return *spare_takeovers_; }
  // dtactor_standby_promotions_total (the coordinator): standby nodes
  // planned in to take a lost member's place (generation_started's
  // standby_promoted).
  prometheus::Counter& standby_promotions() { return *standby_promotions_; }
  // dtactor_spare_ranks (a node): its warm spares waiting now.
  prometheus::Gauge& spare_ranks() { return *spare_ranks_; }
  // dtactor_spare_resident_memory_bytes (a node): resident memory of its
  // spare rank processes waiting now (warming up or warm), summed; kept
  // apart from dtactor_rank_resident_memory_bytes, which holds the ranks'.
  prometheus::Gauge& spare_resident_memory() { return *spare_rss_; }
  // train.sync = diloco: synchronisations, pseudo-gradient bytes the ranks
  // handed to the exchange (all ranks), the averaged pseudo-gradient's norm
  // at the last one, and the share of its window the exchange was in flight.
  prometheus::Counter& outer_steps() { return *outer_steps_; }
  prometheus::Counter& outer_bytes() { return *outer_bytes_; }
  prometheus::Gauge& pseudo_gradient_norm() { return *pseudo_gradient_norm_; }
  prometheus::Gauge& link_busy_fraction() { return *link_busy_fraction_; }
  // dtactor_wire_dropped_frames_total{kind}: kind is wire::to_string(drop_kind).
  prometheus::Counter& wire_dropped_frames(const std::string& kind);
  // dtactor_refused_handshakes_total{reason}: connections whose ZMTP/CURVE
  // handshake failed (reason: to_string(handshake_failure): no_key,
  // unknown_key, bad_frame, busy); each is exported at 0 from the start.
  prometheus::Counter& refused_handshakes(const std::string& reason);

  // ---- histograms (seconds) ----
  prometheus::Histogram& step_duration() { return *step_duration_; }
  prometheus::Histogram& allreduce_duration() { return *allreduce_duration_; }
  // From the last sign of life of a lost member to its declaration as lost.
  prometheus::Histogram& failure_detection() { return *failure_detection_; }
  // From the declaration of a loss to training running again.
  prometheus::Histogram& recovery() { return *recovery_; }
  prometheus::Histogram& heartbeat_rtt() { return *heartbeat_rtt_; }
  prometheus::Histogram& checkpoint_save() { return *checkpoint_save_; }
  // Time a rank's step spent assembling its batch (data loading), per step.
  prometheus::Histogram& data_wait() { return *data_wait_; }

  // ---- checkpoints ----
  prometheus::Gauge& checkpoint_size_bytes() { return *checkpoint_size_bytes_; }
  prometheus::Gauge& checkpoint_last_step() { return *checkpoint_last_step_; }
  // Unix time of the newest checkpoint written, or of the job's start while
  // there is none (so that "checkpoint too old" measures from the start).
  prometheus::Gauge& checkpoint_last_timestamp() { return *checkpoint_last_timestamp_; }
  // Records one saved checkpoint: size, step, now, and the save time.
  void checkpoint_saved(int64_t step, double bytes, double seconds);

  // ---- evaluation ----
  // dtactor_eval_<metric> (e.g. dtactor_eval_accuracy); the journal's
  // val_loss is dtactor_eval_loss. One gauge per metric name a model reports
  // (a small fixed set). Names are sanitized to [a-z0-9_].
  prometheus::Gauge& eval_metric(const std::string& name);
  prometheus::Gauge& eval_step() { return *eval_step_; }  // step of the last evaluation

  // ---- goodput (coordinator; monitoring/goodput.hpp) ----
  // dtactor_goodput_ratio (productive / wall since the coordinator started)
  // and dtactor_goodput_seconds{bucket="productive"|"start"|"recovery"|
  // "waiting"|"checkpoint"|"eval"|"other"}.
  void goodput(const ev::goodput& g);

  // ---- per-rank resources (the node's endpoint; rank = local rank) ----
  prometheus::Counter& rank_cpu_seconds(const std::string& rank);         // dtactor_rank_cpu_seconds_total
  prometheus::Gauge& rank_resident_memory(const std::string& rank);       // dtactor_rank_resident_memory_bytes
  prometheus::Gauge& rank_peak_resident_memory(const std::string& rank);  // dtactor_rank_peak_resident_memory_bytes
  // Coordinator: dtactor_rank_state_bytes{rank, node, kind="params"|"grads"|"optimizer"|"checkpoint_buffer"},
  // the training state each rank holds (train.zero shards the optimizer's).
  void state_bytes(int rank, const std::string& node, double params, double grads, double optimizer, double checkpoint_buffer = 0);

  // ---- sharded data (coordinator; docs/data.md) ----
  // One rank's reading since its process started (cumulative counters of
  // that process): the job's counters grow by what is new since its last
  // report (a restarted process starts again from 0).
  using data_reading = ev::data_reading;
  // dtactor_data_read_bytes_total{source="s3"|"local"}, dtactor_data_cache_hits_total,
  // dtactor_data_cache_misses_total, dtactor_data_shards_verified_total,
  // dtactor_data_shards_failed_total; dtactor_data_read_ahead_depth{rank, node},
  // dtactor_data_cache_bytes{node}.
  void data_read(int rank, const std::string& node, const data_reading& now);

 private:
  status start_server(int port, const std::string& bind_host);
  // The constructor's parts, in registration (exposition) order.
  void register_training();              // step, loss, throughput, DiLoCo
  void register_control_plane();         // recoveries, dropped frames, refused handshakes
  void register_durations();             // the histograms
  void register_checkpoints_and_eval();  // max steps, newest checkpoint, eval step
  void register_ranks_and_data();        // per-rank CPU, memory and state; data reading
  void register_process();               // process_cpu/rss/start, refreshed on scrape

  std::map<std::pair<int, std::string>, data_reading> data_seen_;
  prometheus::Family<prometheus::Counter>* data_bytes_family_ = nullptr;
  prometheus::Counter* data_hits_ = nullptr;
  prometheus::Counter* data_misses_ = nullptr;
  prometheus::Counter* data_verified_ = nullptr;
  prometheus::Counter* data_failed_ = nullptr;
  prometheus::Family<prometheus::Gauge>* data_depth_family_ = nullptr;
  prometheus::Family<prometheus::Gauge>* data_cache_family_ = nullptr;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<http_server> server_;
  int port_ = 0;
  prometheus::Labels constant_;
  std::shared_ptr<metrics_hooks> hooks_;
  std::mutex eval_mu_;
  std::map<std::string, prometheus::Gauge*> eval_gauges_;

  prometheus::Family<prometheus::Counter>* recoveries_family_ = nullptr;
  prometheus::Family<prometheus::Counter>* dropped_family_ = nullptr;
  prometheus::Family<prometheus::Counter>* handshakes_family_ = nullptr;
  prometheus::Family<prometheus::Counter>* rank_cpu_family_ = nullptr;
  prometheus::Family<prometheus::Gauge>* rank_rss_family_ = nullptr;
  prometheus::Family<prometheus::Gauge>* rank_peak_rss_family_ = nullptr;
  prometheus::Family<prometheus::Gauge>* state_bytes_family_ = nullptr;
  prometheus::Family<prometheus::Gauge>* goodput_seconds_family_ = nullptr;
  prometheus::Gauge* goodput_ratio_ = nullptr;
  prometheus::Counter* process_cpu_ = nullptr;
  prometheus::Gauge* process_rss_ = nullptr;
  prometheus::Gauge* process_start_ = nullptr;
  double process_cpu_counted_ = 0;
  prometheus::Gauge* max_steps_ = nullptr;
  prometheus::Gauge* checkpoint_size_bytes_ = nullptr;
  prometheus::Gauge* checkpoint_last_step_ = nullptr;
  prometheus::Gauge* checkpoint_last_timestamp_ = nullptr;
  prometheus::Gauge* eval_step_ = nullptr;
  prometheus::Histogram* data_wait_ = nullptr;

  prometheus::Gauge* world_size_ = nullptr;
  prometheus::Gauge* generation_ = nullptr;
  prometheus::Gauge* step_ = nullptr;
  prometheus::Gauge* nodes_alive_ = nullptr;
  prometheus::Gauge* loss_ = nullptr;
  prometheus::Gauge* learning_rate_ = nullptr;
  prometheus::Gauge* samples_per_second_ = nullptr;
  prometheus::Counter* samples_ = nullptr;
  prometheus::Counter* lost_steps_ = nullptr;
  prometheus::Counter* spare_takeovers_ = nullptr;
  prometheus::Counter* standby_promotions_ = nullptr;
  prometheus::Gauge* spare_ranks_ = nullptr;
  prometheus::Gauge* spare_rss_ = nullptr;
  prometheus::Counter* outer_steps_ = nullptr;
  prometheus::Counter* outer_bytes_ = nullptr;
  prometheus::Gauge* pseudo_gradient_norm_ = nullptr;
  prometheus::Gauge* link_busy_fraction_ = nullptr;
  prometheus::Histogram* step_duration_ = nullptr;
  prometheus::Histogram* allreduce_duration_ = nullptr;
  prometheus::Histogram* failure_detection_ = nullptr;
  prometheus::Histogram* recovery_ = nullptr;
  prometheus::Histogram* heartbeat_rtt_ = nullptr;
  prometheus::Histogram* checkpoint_save_ = nullptr;
};

}  // namespace dtactor
