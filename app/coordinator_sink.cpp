#include "app/coordinator_sink.hpp"

#include <cstdio>

#include "base/async_log.hpp"
#include "storage/fs.hpp"

namespace dtactor {

coordinator_sink::coordinator_sink(journal& jn, metrics& m, run_observer& obs, sd_targets& sd) : jn_(jn), m_(m), obs_(obs), sd_(sd) {
  goodput_->book.begin_session(unix_time_now());
  m_.on_scrape([g = goodput_, m = &m_] {
    ev::goodput now;
    {
      std::lock_guard<std::mutex> lock(g->mu);
      now = g->book.figures(unix_time_now());
    }
    m->goodput(now);
  });
}

template <class E>
ev::goodput coordinator_sink::note_goodput(const E& e) {
  ev::goodput g;
  {
    std::lock_guard<std::mutex> lock(goodput_->mu);
    const double now = unix_time_now();
    goodput_->book.on(now, e);
    g = goodput_->book.figures(now);
  }
  m_.goodput(g);
  return g;
}

ev::goodput coordinator_sink::goodput_now() {
  ev::goodput g;
  {
    std::lock_guard<std::mutex> lock(goodput_->mu);
    g = goodput_->book.figures(unix_time_now());
  }
  m_.goodput(g);
  return g;
}

void coordinator_sink::operator()(const ev::event& e) {
  std::visit([this](const auto& x) { on(x); }, e);
}

void coordinator_sink::on(const ev::node_joined& e) {
  jn_.write(e);
  // The node becomes a scrape target (Prometheus finds it through /sd).
  sd_.note_registration(e.peer, e.node, e.advertise_addr, e.metrics_port);
  sd_.admit(e.peer);
}

void coordinator_sink::on(const ev::node_lost& e) {
  jn_.write(e);
  obs_.note_event("node " + e.node + " lost");
  m_.failure_detection().Observe(e.detected_after_s);
}

void coordinator_sink::on(const ev::node_left& e) {
  jn_.write(e);
  obs_.note_event("node " + e.node + " left");
}

void coordinator_sink::on(const ev::preemption_notice& e) {
  jn_.write(e);
  obs_.note_event("node " + e.node + " preempted (" + e.cloud + " notice)");
}

void coordinator_sink::on(const ev::node_quarantined& e) { jn_.write(e); }

void coordinator_sink::on(const ev::job_waiting& e) {
  jn_.write(e);
  note_goodput(e);
  obs_.note_event("waiting for nodes (below cluster.floor_nodes)");
}

void coordinator_sink::on(const ev::generation_started& e) {
  jn_.write(e);
  note_goodput(e);
  m_.nodes_alive().Set(static_cast<double>(e.nodes.size()));
  if (e.standby_promoted) m_.standby_promotions().Increment(static_cast<double>(e.standby_promoted->size()));
  m_.generation().Set(static_cast<double>(e.generation));
  m_.world_size().Set(e.world_size);
  obs_.on_generation(e.generation, e.world_size, e.start_step);
  obs_.log("generation " + std::to_string(e.generation) + ": world size " + std::to_string(e.world_size) + ", from step " +
           std::to_string(e.start_step));
}

void coordinator_sink::on(const ev::generation_adopted& e) {
  jn_.write(e);
  m_.generation().Set(static_cast<double>(e.generation));
  m_.world_size().Set(e.world_size);
  obs_.log("coordinator: adopted the running generation " + std::to_string(e.generation) + " (world size " + std::to_string(e.world_size) + ")");
}

void coordinator_sink::on(const ev::rank_usage& e) {
  if (e.data_wait_s > 0) m_.data_wait().Observe(e.data_wait_s);
  if (e.data) {
    const auto& d = *e.data;
    m_.data_read(e.global_rank, e.node, d);
    usage_.note_data(e.global_rank, e.node, d);
  }
  if (e.peak_rss_bytes <= 0) return;
  usage_.note(e.global_rank, e.node, {e.cpu_s, e.rss_bytes, e.peak_rss_bytes, e.process_age_s},
              {e.param_bytes, e.grad_bytes, e.optimizer_state_bytes, e.checkpoint_buffer_bytes});
  if (e.param_bytes > 0)
    m_.state_bytes(e.global_rank, e.node, static_cast<double>(e.param_bytes), static_cast<double>(e.grad_bytes),
                   static_cast<double>(e.optimizer_state_bytes), static_cast<double>(e.checkpoint_buffer_bytes));
}

void coordinator_sink::on(const ev::outer_step& e) {
  jn_.write(e);
  m_.outer_steps().Increment();
  m_.outer_bytes().Increment(static_cast<double>(e.payload_bytes) * std::max(1, e.world_size));
  m_.pseudo_gradient_norm().Set(e.pseudo_grad_norm);
  if (e.window_s > 0) m_.link_busy_fraction().Set(std::min(1.0, e.exchange_s / e.window_s));
}

void coordinator_sink::on(const ev::step_completed& e) {
  m_.step().Set(static_cast<double>(e.step));
  m_.samples().Increment(static_cast<double>(e.samples));
  m_.loss().Set(e.loss);
  m_.learning_rate().Set(e.lr);
  m_.samples_per_second().Set(e.samples_per_s);
  m_.step_duration().Observe(e.step_s);
  m_.allreduce_duration().Observe(e.allreduce_s.value_or(0));
  jn_.write(e);
  const ev::goodput g = note_goodput(e);
  obs_.on_step(e.step, e.loss, e.lr, e.samples_per_s, e.world_size);
  if (usage_.due(unix_time_now())) {
    jn_.write(usage_.snapshot());
    jn_.write(g);
  }
}

void coordinator_sink::on(const ev::eval_done& e) {
  jn_.write(e);
  note_goodput(e);
  obs_.on_eval(e.step, e.metrics);
  for (const auto& [k, v] : e.metrics) m_.eval_metric(k).Set(v);
  m_.eval_step().Set(static_cast<double>(e.step));
}

void coordinator_sink::on(const ev::recovery_done& e) {
  jn_.write(e);
  note_goodput(e);
  m_.recoveries(e.cause).Increment();
  if (e.spare_ranks) m_.spare_takeovers().Increment(*e.spare_ranks);
  m_.recovery().Observe(e.duration_s);
  if (e.lost_steps > 0) m_.lost_steps().Increment(static_cast<double>(e.lost_steps));
  char line[160];
  std::snprintf(line, sizeof line, "recovered (%s): world %d from step %lld in %.2f s", ev::to_string(e.cause), e.world_size,
                static_cast<long long>(e.resumed_step), e.duration_s);
  obs_.note_event(line);
}

void coordinator_sink::on(const ev::checkpoint_restored& e) { jn_.write(e); }

void coordinator_sink::on(const ev::rank_down& e) { jn_.write(e); }

void coordinator_sink::on(const ev::job_error& e) { jn_.write(e); }

void coordinator_sink::on(const ev::checkpoint_saved& e) {
  m_.checkpoint_saved(e.step, static_cast<double>(e.bytes), e.duration_s);
  obs_.note_event("checkpoint " + std::to_string(e.step));
  jn_.write(e);
  note_goodput(e);
}

void coordinator_sink::on(const ev::checkpoint_failed& e) { jn_.write(e); }

void coordinator_sink::on(const ev::checkpoint_refused& e) {
  jn_.write(e);
  obs_.note_event("checkpoint " + std::to_string(e.step) + " refused");
}

void coordinator_sink::on(const ev::job_stopping& e) { jn_.write(e); }

void coordinator_sink::on(const ev::job_ended& e) {
  if (!usage_.empty()) jn_.write(usage_.snapshot());
  jn_.write(goodput_now());
  if (e.how == ev::outcome::failed) {
    jn_.write(ev::job_failed{e.step, e.generation, e.reason});
    obs_.finish();
    stderr_line("dtactor: the job stops at step " + std::to_string(e.step) + ": " + e.reason +
                (e.resumable ? "; start it again to resume from the newest checkpoint" : ""));
    return;
  }
  const bool stopped = e.how == ev::outcome::stopped;
  if (stopped && !e.final_checkpoint) {
    // Not every rank stopped after a final checkpoint (nothing was training,
    // or the ranks did not answer in time): the newest checkpoint stands.
    ev::job_stopped j;
    j.step = e.step;
    j.reason = e.reason;
    j.final_checkpoint = false;
    jn_.write(j);
    obs_.finish();
    stdout_line("stopped at step " + std::to_string(e.step) + " without a final checkpoint: " + e.reason);
    return;
  }
  // job_finished and job_stopped (with every rank) carry the same fields.
  auto with_end = [&e](auto line) {
    line.step = e.step;
    line.params_digest = e.params_digest;
    line.world_size = e.world_size;
    line.generation = e.generation;
    if (e.digests_differ) line.error = e.reason;
    line.metrics = e.metrics;
    return line;
  };
  if (stopped) {
    ev::job_stopped line;
    line.final_checkpoint = true;
    jn_.write(with_end(line));
  } else {
    jn_.write(with_end(ev::job_finished{}));
  }
  obs_.finish();
  std::string line = std::string(stopped ? "stopped" : "finished") + " at step " + std::to_string(e.step) + ":";
  for (const auto& [k, v] : e.metrics) {
    char value[64];
    std::snprintf(value, sizeof value, "%.4f", v);
    line += " " + k + "=" + value;
  }
  stdout_line(line + " params_digest=" + e.params_digest + " world_size=" + std::to_string(e.world_size));
}

}  // namespace dtactor
