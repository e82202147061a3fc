#include "monitoring/metrics.hpp"

#include <prometheus/text_serializer.h>

#include <cstdio>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <vector>

#include "monitoring/resources.hpp"

namespace dtactor {

// What the server consults besides the registry: callbacks run before each
// scrape, and extra routes. Shared by the metrics object and its server.
struct metrics_hooks {
  struct route {
    std::string content_type;
    std::function<std::string()> body;
  };
  std::mutex mu;
  std::vector<std::function<void()>> before_scrape;
  std::map<std::string, route> routes;

  void run_before_scrape() {
    std::vector<std::function<void()>> fns;
    {
      std::lock_guard<std::mutex> lock(mu);
      fns = before_scrape;
    }
    for (auto& f : fns) f();
  }
  std::optional<route> find(const std::string& path) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = routes.find(path);
    if (it == routes.end()) return std::nullopt;
    return it->second;
  }
};

namespace {

// What GET `path` returns: /metrics, or a route added with add_route.
http_response metrics_reply(const std::string& method, const std::string& path, prometheus::Registry& registry, metrics_hooks& hooks) {
  if (method != "GET" && method != "HEAD") return {405, "text/plain; charset=utf-8", "use GET\n"};
  if (path == "/metrics" || path == "/metrics/") {
    hooks.run_before_scrape();
    return {200, "text/plain; version=0.0.4; charset=utf-8", prometheus::TextSerializer().Serialize(registry.Collect())};
  }
  if (auto extra = hooks.find(path)) return {200, extra->content_type, extra->body()};
  return {404, "text/plain; charset=utf-8", "dtactor serves Prometheus metrics on /metrics\n"};
}

}  // namespace

namespace {

using prometheus::Histogram;
using prometheus::Labels;

Labels constant_labels(const std::string& job) {
  Labels l;
  if (!job.empty()) l["job"] = job;
  return l;
}

prometheus::Family<prometheus::Gauge>* gauge_family(prometheus::Registry& r, const Labels& c, const char* name, const char* help) {
  return &prometheus::BuildGauge().Name(name).Help(help).Labels(c).Register(r);
}

prometheus::Family<prometheus::Counter>* counter_family(prometheus::Registry& r, const Labels& c, const char* name, const char* help) {
  return &prometheus::BuildCounter().Name(name).Help(help).Labels(c).Register(r);
}

prometheus::Gauge* gauge(prometheus::Registry& r, const Labels& c, const char* name, const char* help) { return &gauge_family(r, c, name, help)->Add({}); }

prometheus::Counter* counter(prometheus::Registry& r, const Labels& c, const char* name, const char* help) {
  return &counter_family(r, c, name, help)->Add({});
}

prometheus::Histogram* histogram(prometheus::Registry& r, const Labels& c, const char* name, const char* help, Histogram::BucketBoundaries buckets) {
  return &prometheus::BuildHistogram().Name(name).Help(help).Labels(c).Register(r).Add({}, std::move(buckets));
}

}  // namespace

// The families register in this order, which is the exposition's order.
metrics::metrics(const std::string& job)
    : registry_(std::make_shared<prometheus::Registry>()), constant_(constant_labels(job)), hooks_(std::make_shared<metrics_hooks>()) {
  register_training();
  register_control_plane();
  register_durations();
  register_checkpoints_and_eval();
  register_ranks_and_data();
  register_process();
}

void metrics::register_training() {
  auto& r = *registry_;
  const Labels& c = constant_;
  world_size_ = gauge(r, c, "dtactor_world_size", "Ranks in the current generation.");
  generation_ = gauge(r, c, "dtactor_generation", "Current membership generation.");
  step_ = gauge(r, c, "dtactor_step", "Last committed global step.");
  nodes_alive_ = gauge(r, c, "dtactor_nodes_alive", "Nodes currently considered alive.");
  loss_ = gauge(r, c, "dtactor_loss", "Training loss of the last committed step.");
  learning_rate_ = gauge(r, c, "dtactor_learning_rate", "Learning rate of the last step.");
  samples_per_second_ = gauge(r, c, "dtactor_samples_per_second", "Training throughput over the recent steps.");

  samples_ = counter(r, c, "dtactor_samples_total", "Training samples processed in committed steps.");
  lost_steps_ = counter(r, c, "dtactor_lost_steps_total", "Completed steps a recovery did not resume from (work lost).");
  spare_takeovers_ = counter(r, c, "dtactor_spare_takeovers_total", "Rank processes that took a rank's place from a node's warm spares.");
  standby_promotions_ = counter(r, c, "dtactor_standby_promotions_total", "Standby nodes planned into the world to take a lost member node's place.");
  spare_ranks_ = gauge(r, c, "dtactor_spare_ranks", "A node's warm spare rank processes waiting to take a rank's place.");
  spare_rss_ = gauge(r, c, "dtactor_spare_resident_memory_bytes",
                     "Resident memory of a node's spare rank processes waiting now (warming up or warm), summed.");
  outer_steps_ = counter(r, c, "dtactor_outer_steps_total", "train.sync = diloco: synchronisations (outer steps) taken.");
  outer_bytes_ = counter(r, c, "dtactor_outer_payload_bytes_total",
                         "train.sync = diloco: pseudo-gradient bytes the ranks handed to the exchange (fp32; a bf16 wire sends half).");
  pseudo_gradient_norm_ = gauge(r, c, "dtactor_pseudo_gradient_norm", "train.sync = diloco: norm of the averaged pseudo-gradient at the last synchronisation.");
  link_busy_fraction_ = gauge(r, c, "dtactor_link_busy_fraction",
                              "train.sync = diloco: share of the last window during which its exchange was in flight (1 = the link never idle).");
  goodput_ratio_ = gauge(r, c, "dtactor_goodput_ratio", "Productive training time over wall time since the coordinator started (0 to 1).");
  goodput_seconds_family_ = gauge_family(r, c, "dtactor_goodput_seconds",
                                         "Wall time since the coordinator started, by what it went to (the buckets add up to it).");
}

void metrics::goodput(const ev::goodput& g) {
  goodput_ratio_->Set(g.ratio);
  const std::pair<const char*, double> buckets[] = {{"productive", g.productive_s}, {"start", g.start_s},     {"recovery", g.recovery_s},
                                                    {"waiting", g.waiting_s},       {"checkpoint", g.checkpoint_s}, {"eval", g.eval_s},
                                                    {"other", g.other_s}};
  for (const auto& [bucket, seconds] : buckets) goodput_seconds_family_->Add({{"bucket", bucket}}).Set(seconds);
}

void metrics::register_control_plane() {
  auto& r = *registry_;
  const Labels& c = constant_;
  recoveries_family_ = counter_family(r, c, "dtactor_recoveries_total", "Membership changes that rebuilt the communicators, by cause.");
  // Exported at 0 from the start, so that increase() and rate() see the first
  // recovery of each cause (a series born at 1 shows no increase): every
  // cause a recovery_done can carry (not start, adopted or none).
  for (auto cause : {ev::plan_cause::node_lost, ev::plan_cause::rank_exited, ev::plan_cause::collective_failure, ev::plan_cause::node_left,
                     ev::plan_cause::node_joined, ev::plan_cause::rank_ready, ev::plan_cause::restart})
    recoveries(cause);
  dropped_family_ = counter_family(r, c, "dtactor_wire_dropped_frames_total", "ZeroMQ frames refused or undeliverable, by kind.");
  handshakes_family_ = counter_family(r, c, "dtactor_refused_handshakes_total",
                                      "Connections to the control port whose handshake failed (no key, unknown key, bad frame), by reason.");
  for (const char* reason : {"no_key", "unknown_key", "bad_frame", "busy"}) refused_handshakes(reason);
}

void metrics::register_durations() {
  auto& r = *registry_;
  const Labels& c = constant_;
  step_duration_ =
      histogram(r, c, "dtactor_step_duration_seconds", "Wall time of one training step.", {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60});
  allreduce_duration_ = histogram(r, c, "dtactor_allreduce_duration_seconds", "Time spent in gradient allreduce per step.",
                                  {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5});
  failure_detection_ = histogram(r, c, "dtactor_failure_detection_seconds", "From a lost member's last sign of life to its declaration as lost.",
                                 {0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60});
  recovery_ = histogram(r, c, "dtactor_recovery_seconds", "From the declaration of a membership change to training running again.",
                        {0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300});
  heartbeat_rtt_ = histogram(r, c, "dtactor_heartbeat_rtt_seconds", "Heartbeat round-trip time.",
                             {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1});
  checkpoint_save_ = histogram(r, c, "dtactor_checkpoint_save_seconds", "Time to write one checkpoint to disk.",
                               {0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120});
  data_wait_ = histogram(r, c, "dtactor_data_wait_seconds", "Time a rank's step spent assembling its batch (data loading), per step.",
                         {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1});
}

void metrics::register_checkpoints_and_eval() {
  auto& r = *registry_;
  const Labels& c = constant_;
  max_steps_ = gauge(r, c, "dtactor_max_steps", "The step training ends at (train.max_steps).");
  checkpoint_size_bytes_ = gauge(r, c, "dtactor_checkpoint_size_bytes", "Size of the newest checkpoint written.");
  checkpoint_last_step_ = gauge(r, c, "dtactor_checkpoint_last_step", "Step of the newest checkpoint written.");
  checkpoint_last_timestamp_ =
      gauge(r, c, "dtactor_checkpoint_last_timestamp_seconds", "Unix time of the newest checkpoint written (the job's start while there is none).");
  eval_step_ = gauge(r, c, "dtactor_eval_step", "Step of the last evaluation.");
}

void metrics::register_ranks_and_data() {
  auto& r = *registry_;
  const Labels& c = constant_;
  rank_cpu_family_ = counter_family(r, c, "dtactor_rank_cpu_seconds_total", "CPU time (user + system) of this node's rank processes, by local rank.");
  data_bytes_family_ = counter_family(r, c, "dtactor_data_read_bytes_total",
                                      "Bytes of data shards the ranks read, by source (s3: fetched into the nodes' caches; local: shards mapped in place).");
  data_hits_ = counter(r, c, "dtactor_data_cache_hits_total", "Shards the ranks found ready (mapped, or in the node's cache) when a step needed them.");
  data_misses_ = counter(r, c, "dtactor_data_cache_misses_total", "Shards a step had to wait for (fetched while it waited).");
  data_verified_ = counter(r, c, "dtactor_data_shards_verified_total", "Shards fetched whose size and digest matched.");
  data_failed_ = counter(r, c, "dtactor_data_shards_failed_total", "Shard fetches that failed or did not verify.");
  data_depth_family_ =
      gauge_family(r, c, "dtactor_data_read_ahead_depth", "Shards a rank's read-ahead has queued or in flight, by global rank and node.");
  data_cache_family_ = gauge_family(r, c, "dtactor_data_cache_bytes", "Bytes in a node's data cache directory (data.cache_bytes bounds it), by node.");
  state_bytes_family_ = gauge_family(r, c, "dtactor_rank_state_bytes",
                                     "Training state a rank holds, by global rank, node and kind (params, grads, optimizer; train.zero shards the "
                                     "optimizer's, replicas included).");
  rank_rss_family_ = gauge_family(r, c, "dtactor_rank_resident_memory_bytes", "Resident memory of this node's rank processes, by local rank.");
  rank_peak_rss_family_ =
      gauge_family(r, c, "dtactor_rank_peak_resident_memory_bytes", "Peak resident memory of this node's rank processes, by local rank.");
}

// The standard process_* metrics, read from /proc at each scrape.
void metrics::register_process() {
  auto& r = *registry_;
  const Labels& c = constant_;
  process_cpu_ = counter(r, c, "process_cpu_seconds_total", "Total user and system CPU time spent in seconds.");
  process_rss_ = gauge(r, c, "process_resident_memory_bytes", "Resident memory size in bytes.");
  process_start_ = gauge(r, c, "process_start_time_seconds", "Start time of the process since unix epoch in seconds.");
  on_scrape([this, mu = std::make_shared<std::mutex>()] {
    auto u = read_proc_usage();
    if (!u) return;
    std::lock_guard<std::mutex> lock(*mu);  // render() may run beside a scrape
    if (u->cpu_s > process_cpu_counted_) {
      process_cpu_->Increment(u->cpu_s - process_cpu_counted_);
      process_cpu_counted_ = u->cpu_s;
    }
    process_rss_->Set(u->rss_bytes);
    process_start_->Set(u->start_unix);
  });
}

metrics::~metrics() { server_.reset(); }  // no scrape may run while members go

prometheus::Counter& metrics::recoveries(ev::plan_cause cause) { return recoveries_family_->Add({{"cause", ev::to_string(cause)}}); }

prometheus::Counter& metrics::wire_dropped_frames(const std::string& kind) { return dropped_family_->Add({{"kind", kind}}); }

prometheus::Counter& metrics::refused_handshakes(const std::string& reason) { return handshakes_family_->Add({{"reason", reason}}); }

prometheus::Counter& metrics::rank_cpu_seconds(const std::string& rank) { return rank_cpu_family_->Add({{"rank", rank}}); }

prometheus::Gauge& metrics::rank_resident_memory(const std::string& rank) { return rank_rss_family_->Add({{"rank", rank}}); }

void metrics::state_bytes(int rank, const std::string& node, double params, double grads, double optimizer, double checkpoint_buffer) {
  const std::string r = std::to_string(rank);
  state_bytes_family_->Add({{"rank", r}, {"node", node}, {"kind", "params"}}).Set(params);
  state_bytes_family_->Add({{"rank", r}, {"node", node}, {"kind", "grads"}}).Set(grads);
  state_bytes_family_->Add({{"rank", r}, {"node", node}, {"kind", "optimizer"}}).Set(optimizer);
  state_bytes_family_->Add({{"rank", r}, {"node", node}, {"kind", "checkpoint_buffer"}}).Set(checkpoint_buffer);
}

void metrics::data_read(int rank, const std::string& node, const data_reading& now) {
  auto& last = data_seen_[{rank, node}];
  // A counter below the last report: a new process (it counts from 0).
  auto grew = [](uint64_t n, uint64_t l) { return static_cast<double>(n >= l ? n - l : n); };
  const bool restarted = now.cache_hits + now.cache_misses < last.cache_hits + last.cache_misses;
  if (restarted) last = data_reading{};
  data_bytes_family_->Add({{"source", "s3"}}).Increment(grew(now.bytes_s3, last.bytes_s3));
  data_bytes_family_->Add({{"source", "local"}}).Increment(grew(now.bytes_local, last.bytes_local));
  data_hits_->Increment(grew(now.cache_hits, last.cache_hits));
  data_misses_->Increment(grew(now.cache_misses, last.cache_misses));
  data_verified_->Increment(grew(now.shards_verified, last.shards_verified));
  data_failed_->Increment(grew(now.shards_failed, last.shards_failed));
  data_depth_family_->Add({{"rank", std::to_string(rank)}, {"node", node}}).Set(static_cast<double>(now.read_ahead_depth));
  data_cache_family_->Add({{"node", node}}).Set(static_cast<double>(now.cache_bytes));
  last = now;
}

prometheus::Gauge& metrics::rank_peak_resident_memory(const std::string& rank) { return rank_peak_rss_family_->Add({{"rank", rank}}); }

void metrics::checkpoint_saved(int64_t step, double bytes, double seconds) {
  checkpoint_save_->Observe(seconds);
  checkpoint_size_bytes_->Set(bytes);
  checkpoint_last_step_->Set(static_cast<double>(step));
  checkpoint_last_timestamp_->SetToCurrentTime();
}

prometheus::Gauge& metrics::eval_metric(const std::string& name) {
  std::string n = name == "val_loss" ? "loss" : name;
  for (auto& ch : n) {
    if (ch >= 'A' && ch <= 'Z') ch = static_cast<char>(ch - 'A' + 'a');
    if (!((ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '_')) ch = '_';
  }
  std::lock_guard<std::mutex> lock(eval_mu_);
  auto& g = eval_gauges_[n];
  if (!g)
    g = &prometheus::BuildGauge()
             .Name("dtactor_eval_" + n)
             .Help("Evaluation metric '" + name + "' of the last evaluation on held-out data.")
             .Labels(constant_)
             .Register(*registry_)
             .Add({});
  return *g;
}

void metrics::on_scrape(std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(hooks_->mu);
  hooks_->before_scrape.push_back(std::move(fn));
}

void metrics::add_route(const std::string& path, const std::string& content_type, std::function<std::string()> fn) {
  std::lock_guard<std::mutex> lock(hooks_->mu);
  hooks_->routes[path] = {content_type, std::move(fn)};
}

status metrics::serve(int port, const std::string& bind_host) {
  if (port == 0) return status::success();
  if (port < 0 || port > 65535) return make_error("metrics: port " + std::to_string(port) + " is out of range; use 1-65535, or 0 for off");
  return start_server(port, bind_host);
}

status metrics::serve_on_free_port(const std::string& bind_host) { return start_server(0, bind_host); }

status metrics::start_server(int port, const std::string& bind_host) {
  if (server_) return make_error("metrics: already serving on port " + std::to_string(port_));
  auto server = http_server::start(bind_host, port, [registry = registry_, hooks = hooks_](const std::string& method, const std::string& path) {
    return metrics_reply(method, path, *registry, *hooks);
  });
  if (!server) return make_error("metrics: cannot serve /metrics on " + server.message());
  port_ = server.value()->port();
  server_ = std::move(server.value());
  return status::success();
}

http_response metrics::respond(const std::string& method, const std::string& path) const { return metrics_reply(method, path, *registry_, *hooks_); }

std::string metrics::render() const {
  hooks_->run_before_scrape();
  return prometheus::TextSerializer().Serialize(registry_->Collect());
}

}  // namespace dtactor
