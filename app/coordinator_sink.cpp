#include "app/coordinator_sink.hpp"

#include <cstdio>

#include "runtime/fs.hpp"

namespace dtactor {

void coordinator_sink::operator()(const ev::event& e) {
  std::visit([this](const auto& x) { on(x); }, e);
}

void coordinator_sink::on(const ev::node_joined& e) {
  jn_.write("node_joined", {{"node", e.node}});
  // The node becomes a scrape target (Prometheus finds it through /sd).
  sd_.note_registration(e.peer, e.node, e.advertise_addr, e.metrics_port);
  sd_.admit(e.peer);
}

void coordinator_sink::on(const ev::node_lost& e) {
  jn_.write("node_lost", {{"node", e.node}, {"cause", ev::to_string(e.cause)}, {"detected_after_s", e.detected_after_s}});
  obs_.note_event("node " + e.node + " lost");
  m_.failure_detection().Observe(e.detected_after_s);
}

void coordinator_sink::on(const ev::node_left& e) {
  jn_.write("node_left", {{"node", e.node}, {"reason", e.reason}});
  obs_.note_event("node " + e.node + " left");
}

void coordinator_sink::on(const ev::node_quarantined& e) { jn_.write("node_quarantined", {{"node", e.node}, {"reason", e.reason}}); }

void coordinator_sink::on(const ev::job_waiting& e) {
  jn_.write("job_waiting", {{"generation", e.generation}, {"reason", e.reason}});
  obs_.note_event("waiting for nodes (below cluster.floor_nodes)");
}

void coordinator_sink::on(const ev::generation_started& e) {
  jn_.write("generation_started", {{"generation", e.generation},
                                   {"world_size", e.world_size},
                                   {"cause", e.cause},
                                   {"drain", e.drain},
                                   {"start_step", e.start_step},
                                   {"state_root", e.state_root},
                                   {"nodes", e.nodes}});
  m_.nodes_alive().Set(static_cast<double>(e.nodes.size()));
  m_.generation().Set(static_cast<double>(e.generation));
  m_.world_size().Set(e.world_size);
  obs_.on_generation(e.generation, e.world_size, e.start_step);
  obs_.log("generation " + std::to_string(e.generation) + ": world size " + std::to_string(e.world_size) + ", from step " +
           std::to_string(e.start_step));
}

void coordinator_sink::on(const ev::generation_adopted& e) {
  jn_.write("generation_adopted", {{"generation", e.generation}, {"world_size", e.world_size}});
  m_.generation().Set(static_cast<double>(e.generation));
  m_.world_size().Set(e.world_size);
  obs_.log("coordinator: adopted the running generation " + std::to_string(e.generation) + " (world size " + std::to_string(e.world_size) + ")");
}

void coordinator_sink::on(const ev::rank_usage& e) {
  if (e.data_wait_s > 0) m_.data_wait().Observe(e.data_wait_s);
  if (e.peak_rss_bytes <= 0) return;
  usage_.note(e.global_rank, e.node, {e.cpu_s, e.rss_bytes, e.peak_rss_bytes, e.process_age_s});
}

void coordinator_sink::on(const ev::step_completed& e) {
  m_.step().Set(static_cast<double>(e.step));
  m_.samples().Increment(static_cast<double>(e.samples));
  m_.loss().Set(e.loss);
  m_.learning_rate().Set(e.lr);
  m_.samples_per_second().Set(e.samples_per_s);
  m_.step_duration().Observe(e.step_s);
  m_.allreduce_duration().Observe(e.allreduce_s);
  jn_.write("step", {{"step", e.step},
                     {"world_size", e.world_size},
                     {"generation", e.generation},
                     {"loss", e.loss},
                     {"lr", e.lr},
                     {"samples_per_s", e.samples_per_s},
                     {"allreduce_s", e.allreduce_s},
                     {"allreduce_exposed_s", e.allreduce_exposed_s}});
  obs_.on_step(e.step, e.loss, e.lr, e.samples_per_s, e.world_size);
  if (usage_.due(unix_time_now())) jn_.write("resources", usage_.to_json());
}

void coordinator_sink::on(const ev::eval_done& e) {
  nlohmann::json j = {{"step", e.step}, {"duration_s", e.duration_s}};
  for (const auto& [k, v] : e.metrics) j[k] = v;
  if (!e.examples.empty()) j["examples"] = e.examples;
  jn_.write("eval", j);
  obs_.on_eval(e.step, e.metrics);
  for (const auto& [k, v] : e.metrics) m_.eval_metric(k).Set(v);
  m_.eval_step().Set(static_cast<double>(e.step));
}

void coordinator_sink::on(const ev::recovery_done& e) {
  jn_.write("recovery_done", {{"generation", e.generation},
                              {"world_size", e.world_size},
                              {"cause", e.cause},
                              {"drain", e.drain},
                              {"resumed_step", e.resumed_step},
                              {"lost_steps", e.lost_steps},
                              {"duration_s", e.duration_s}});
  m_.recoveries(e.cause).Increment();
  m_.recovery().Observe(e.duration_s);
  if (e.lost_steps > 0) m_.lost_steps().Increment(static_cast<double>(e.lost_steps));
  char line[160];
  std::snprintf(line, sizeof line, "recovered (%s): world %d from step %lld in %.2f s", e.cause.c_str(), e.world_size,
                static_cast<long long>(e.resumed_step), e.duration_s);
  obs_.note_event(line);
}

void coordinator_sink::on(const ev::checkpoint_restored& e) {
  nlohmann::json j = {{"step", e.step}, {"source", e.source}, {"generation", e.generation}, {"root", e.root}};
  if (e.source == "peer" && e.bytes > 0) {
    j["bytes"] = e.bytes;
    j["transfer_s"] = e.transfer_s;
    if (e.transfer_s > 0) j["gb_per_s"] = static_cast<double>(e.bytes) / e.transfer_s / 1e9;
  }
  jn_.write("checkpoint_restored", j);
}

void coordinator_sink::on(const ev::rank_down& e) {
  jn_.write(e.failed ? "rank_failed" : "rank_exited", {{"rank", e.rank},
                                                       {"local_rank", e.local_rank},
                                                       {"node", e.node},
                                                       {"detail", e.detail},
                                                       {"exit_code", e.exit_code},
                                                       {"step", e.step},
                                                       {"generation", e.generation}});
}

void coordinator_sink::on(const ev::node_error& e) { jn_.write("job_error", {{"node", e.node}, {"message", e.message}}); }

void coordinator_sink::on(const ev::checkpoint_saved& e) {
  m_.checkpoint_saved(e.step, static_cast<double>(e.bytes), e.duration_s);
  obs_.note_event("checkpoint " + std::to_string(e.step));
  jn_.write("checkpoint_saved", {{"step", e.step},
                                 {"path", e.path},
                                 {"bytes", e.bytes},
                                 {"generation", e.generation},
                                 {"duration_s", e.duration_s},
                                 {"parts", e.parts},
                                 {"stall_s", e.stall_s},
                                 {"write_s", e.write_s},
                                 {"bytes_per_s", e.bytes_per_s}});
}

void coordinator_sink::on(const ev::checkpoint_failed& e) { jn_.write("checkpoint_failed", {{"step", e.step}, {"reason", e.reason}}); }

void coordinator_sink::on(const ev::job_stopping& e) { jn_.write("job_stopping", {{"reason", e.reason}}); }

void coordinator_sink::on(const ev::job_ended& e) {
  if (!usage_.empty()) jn_.write("resources", usage_.to_json());
  if (e.how == ev::outcome::failed) {
    jn_.write("job_failed", {{"step", e.step}, {"generation", e.generation}, {"reason", e.reason}});
    obs_.finish();
    std::fprintf(stderr, "dtactor: the job stops at step %lld: %s; start it again to resume from the newest checkpoint\n",
                 static_cast<long long>(e.step), e.reason.c_str());
    return;
  }
  const bool stopped = e.how == ev::outcome::stopped;
  if (stopped && !e.final_checkpoint) {
    // Not every rank stopped after a final checkpoint (nothing was training,
    // or the ranks did not answer in time): the newest checkpoint stands.
    jn_.write("job_stopped", {{"step", e.step}, {"reason", e.reason}, {"final_checkpoint", false}});
    obs_.finish();
    std::fprintf(stdout, "stopped at step %lld without a final checkpoint: %s\n", static_cast<long long>(e.step), e.reason.c_str());
    std::fflush(stdout);
    return;
  }
  nlohmann::json j = {{"step", e.step}, {"params_digest", e.params_digest}, {"world_size", e.world_size}, {"generation", e.generation}};
  if (stopped) j["final_checkpoint"] = true;
  for (const auto& [k, v] : e.metrics) j[k] = v;
  if (e.digests_differ) j["error"] = e.reason;
  jn_.write(stopped ? "job_stopped" : "job_finished", j);
  obs_.finish();
  std::fprintf(stdout, "%s at step %lld:", stopped ? "stopped" : "finished", static_cast<long long>(e.step));
  for (const auto& [k, v] : e.metrics) std::fprintf(stdout, " %s=%.4f", k.c_str(), v);
  std::fprintf(stdout, " params_digest=%s world_size=%d\n", e.params_digest.c_str(), e.world_size);
  std::fflush(stdout);
}

}  // namespace dtactor
