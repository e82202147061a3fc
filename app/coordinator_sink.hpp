#pragma once
// Where the coordinator's actors' events (job/events.hpp) become journal
// lines, Prometheus metrics, console lines and scrape targets: the one
// translation from what happened to how it is shown. Called on the
// emitting actor's thread: the journal, the metrics, the console and the
// scrape targets are thread-safe, the goodput book is behind its mutex;
// the ranks' usage book is touched only by the job actor's events
// (rank_usage, step_completed, job_ended), one at a time as CAF runs an
// actor.

#include <memory>
#include <mutex>

#include "job/events.hpp"
#include "monitoring/goodput.hpp"
#include "monitoring/journal.hpp"
#include "monitoring/metrics.hpp"
#include "monitoring/resources.hpp"
#include "monitoring/run_observer.hpp"
#include "monitoring/service_discovery.hpp"

namespace dtactor {

class coordinator_sink {
 public:
  // Goodput counts from now: the coordinator's start. Every scrape of
  // /metrics sets the goodput gauges as of the scrape.
  coordinator_sink(journal& jn, metrics& m, run_observer& obs, sd_targets& sd);

  void operator()(const ev::event& e);

  // The sink as an event_sink; `this` must outlive every actor holding it.
  event_sink as_sink() {
    return [this](const ev::event& e) { (*this)(e); };
  }

 private:
  void on(const ev::node_joined& e);
  void on(const ev::node_lost& e);
  void on(const ev::node_left& e);
  void on(const ev::preemption_notice& e);
  void on(const ev::node_quarantined& e);
  void on(const ev::job_waiting& e);
  void on(const ev::generation_started& e);
  void on(const ev::generation_adopted& e);
  void on(const ev::rank_usage& e);
  void on(const ev::outer_step& e);
  void on(const ev::step_completed& e);
  void on(const ev::eval_done& e);
  void on(const ev::recovery_done& e);
  void on(const ev::checkpoint_restored& e);
  void on(const ev::rank_down& e);
  void on(const ev::job_error& e);
  void on(const ev::checkpoint_saved& e);
  void on(const ev::checkpoint_failed& e);
  void on(const ev::checkpoint_refused& e);
  void on(const ev::job_stopping& e);
  void on(const ev::job_ended& e);
  void on(const ev::members_view&) {}  // the status page's alone

  // Feeds the goodput book an event that moves a bucket and sets the
  // gauges; the figures as of now.
  template <class E>
  ev::goodput note_goodput(const E& e);
  ev::goodput goodput_now();

  journal& jn_;
  metrics& m_;
  run_observer& obs_;
  sd_targets& sd_;
  resource_book usage_;  // the job actor's events only
  // The book is fed by several actors' events and read by every scrape of
  // /metrics (so that the ratio falls live while no step completes); the
  // scrape hook shares it, and may outlive the sink.
  struct goodput_state {
    std::mutex mu;
    goodput_book book;
  };
  std::shared_ptr<goodput_state> goodput_ = std::make_shared<goodput_state>();
};

}  // namespace dtactor
