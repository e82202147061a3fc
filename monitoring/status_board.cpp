#include "monitoring/status_board.hpp"

#include <algorithm>
#include <nlohmann/json.hpp>

namespace dtactor {

namespace {

constexpr std::size_t max_recoveries = 50, max_checkpoints = 20, max_errors = 20;
constexpr double departed_shown_s = 300;  // a lost or drained node stays listed this long
constexpr double point_every_s = 2;       // chart resolution
constexpr std::size_t max_text = 300;     // characters of one text field

// Text that came from a peer or a store, shortened; JSON escapes the rest
// and the page only ever sets it as text.
std::string bounded(const std::string& s) {
  if (s.size() <= max_text) return s;
  return s.substr(0, max_text) + "... (" + std::to_string(s.size()) + " bytes)";
}

template <class D>
void keep_last(D& d, std::size_t n) {
  while (d.size() > n) d.pop_front();
}

}  // namespace

status_board::status_board(status_options o) : opts_(std::move(o)) {}

const char* status_board::to_string(job_state s) {
  switch (s) {
    case job_state::starting: return "starting";
    case job_state::waiting: return "waiting for nodes";
    case job_state::training: return "training";
    case job_state::recovering: return "recovering";
    case job_state::stopping: return "stopping";
    case job_state::finished: return "finished";
    case job_state::stopped: return "stopped";
    case job_state::failed: return "failed";
  }
  return "?";
}

const char* status_board::to_string(member_state s) {
  switch (s) {
    case member_state::joining: return "joining";
    case member_state::standby: return "standby";
    case member_state::training: return "training";
    case member_state::draining: return "draining";
    case member_state::lost: return "lost";
    case member_state::quarantined: return "quarantined";
  }
  return "?";
}

void status_board::on(const ev::event& e, double now) {
  std::lock_guard<std::mutex> lock(mu_);
  if (started_ == 0) started_ = now;
  std::visit([&](const auto& x) { handle(x, now); }, e);
}

void status_board::error(double now, const std::string& text) {
  errors_.push_back({now, bounded(text)});
  keep_last(errors_, max_errors);
}

void status_board::forget_departed(double now) {
  for (auto it = members_.begin(); it != members_.end();)
    if (it->second.left_at > 0 && now - it->second.left_at > departed_shown_s) it = members_.erase(it);
    else ++it;
}

void status_board::handle(const ev::members_view& e, double now) {
  for (auto& [id, m] : members_)
    if (m.left_at == 0) m.left_at = -1;  // not in this view: marked below, or departed
  for (const auto& s : e.members) {
    auto& m = members_[s.node];
    m.host = s.host;
    m.node_rank = s.node_rank;
    m.nproc = s.nproc;
    m.ready_ranks = s.ready_ranks;
    m.heard_at = now - s.heartbeat_age_s;
    m.left_at = 0;
    if (m.state != member_state::quarantined)
      m.state = s.in_plan ? member_state::training : s.standby ? member_state::standby : member_state::joining;
  }
  for (const auto& id : e.draining) {
    auto& m = members_[id];
    m.state = member_state::draining;
    m.left_at = 0;
  }
  for (auto& [id, m] : members_)
    if (m.left_at < 0) {  // gone without an event saying how (a leave that finished draining)
      m.left_at = now;
      if (m.state != member_state::lost && m.state != member_state::quarantined) m.state = member_state::draining;
    }
  forget_departed(now);
}

void status_board::handle(const ev::node_joined& e, double now) {
  auto& m = members_[e.node];
  m.state = member_state::joining;
  m.left_at = 0;
  m.heard_at = now;
  m.rank_steps.clear();
}

void status_board::handle(const ev::node_lost& e, double now) {
  auto& m = members_[e.node];
  m.state = member_state::lost;
  m.left_at = now;
  pending_detection_[e.node] = e.detected_after_s;
  if (state_ == job_state::training) state_ = job_state::recovering;
}

void status_board::handle(const ev::node_left& e, double now) {
  auto& m = members_[e.node];
  m.state = member_state::draining;
  m.left_at = now;
}

void status_board::handle(const ev::node_quarantined& e, double now) {
  auto& m = members_[e.node];
  m.state = member_state::quarantined;
  m.left_at = now;
  error(now, "node " + e.node + " quarantined" + (opts_.keyed ? "" : ": " + e.reason));
}

void status_board::handle(const ev::job_waiting&, double) { state_ = job_state::waiting; }

void status_board::handle(const ev::generation_started& e, double) {
  generation_ = e.generation;
  world_ = e.world_size;
  const bool after_loss = e.cause == ev::plan_cause::node_lost || e.cause == ev::plan_cause::rank_exited || e.cause == ev::plan_cause::collective_failure;
  if (state_ != job_state::stopping) state_ = after_loss ? job_state::recovering : job_state::training;
  for (auto& [id, m] : members_) m.rank_steps.clear();  // global ranks are numbered afresh each generation
  for (auto& [id, m] : members_)
    if (std::find(e.nodes.begin(), e.nodes.end(), id) != e.nodes.end() && (m.state == member_state::joining || m.state == member_state::standby))
      m.state = member_state::training;
}

void status_board::handle(const ev::generation_adopted& e, double) {
  generation_ = e.generation;
  world_ = e.world_size;
  state_ = job_state::training;
}

void status_board::handle(const ev::rank_usage& e, double) {
  if (e.step >= 0) members_[e.node].rank_steps[e.global_rank] = e.step;
}

void status_board::handle(const ev::step_completed& e, double now) {
  step_ = e.step;
  loss_ = e.loss;
  samples_per_s_ = e.samples_per_s;
  world_ = e.world_size;
  if (state_ == job_state::starting || state_ == job_state::waiting) state_ = job_state::training;
  if (series_.empty() || now - series_.back().t >= point_every_s) series_.push_back({now, e.samples_per_s, e.loss, e.step, e.world_size});
  while (!series_.empty() && now - series_.front().t > opts_.history_s) series_.pop_front();
}

void status_board::handle(const ev::eval_done& e, double) {
  eval_ = e.metrics;
  eval_step_ = e.step;
}

void status_board::handle(const ev::recovery_done& e, double now) {
  recovery r;
  r.t = now;
  r.cause = ev::to_string(e.cause);
  r.duration_s = e.duration_s;
  r.resumed_step = e.resumed_step;
  r.lost_steps = e.lost_steps;
  r.world = e.world_size;
  if (!pending_detection_.empty()) {
    r.node = pending_detection_.begin()->first;
    r.detected_s = pending_detection_.begin()->second;
    pending_detection_.clear();
  }
  recoveries_.push_back(std::move(r));
  keep_last(recoveries_, max_recoveries);
  ++recoveries_total_;
  lost_steps_total_ += e.lost_steps;
  if (state_ == job_state::recovering) state_ = job_state::training;
}

void status_board::handle(const ev::rank_down& e, double now) {
  error(now, std::string("rank ") + std::to_string(e.rank) + " on " + e.node + (e.failed ? " failed" : " exited") + " at step " + std::to_string(e.step) +
                 (opts_.keyed || e.detail.empty() ? "" : ": " + e.detail));
}

void status_board::handle(const ev::job_error& e, double now) { error(now, "node " + e.node + ": " + (opts_.keyed ? "an error" : e.message)); }

void status_board::handle(const ev::checkpoint_saved& e, double now) {
  checkpoints_.push_back({now, e.duration_s, e.step, static_cast<uint64_t>(std::max<int64_t>(0, e.bytes)), opts_.keyed ? "" : bounded(e.path)});
  keep_last(checkpoints_, max_checkpoints);
}

void status_board::handle(const ev::checkpoint_failed& e, double now) {
  error(now, "checkpoint at step " + std::to_string(e.step) + " failed" + (opts_.keyed ? "" : ": " + e.reason));
}

void status_board::handle(const ev::checkpoint_refused& e, double now) {
  error(now, "checkpoint at step " + std::to_string(e.step) + " refused by rank " + std::to_string(e.rank) + (opts_.keyed ? "" : ": " + e.reason) +
                 (e.fallback_step >= 0 ? "; training goes on from step " + std::to_string(e.fallback_step) : "; no checkpoint left"));
}

void status_board::handle(const ev::job_stopping&, double) { state_ = job_state::stopping; }

void status_board::handle(const ev::job_ended& e, double now) {
  step_ = std::max(step_, e.step);
  state_ = e.how == ev::outcome::finished ? job_state::finished : e.how == ev::outcome::stopped ? job_state::stopped : job_state::failed;
  if (e.how == ev::outcome::failed) error(now, "the job failed" + (opts_.keyed ? "" : ": " + e.reason));
  if (!e.metrics.empty()) eval_ = e.metrics;
}

std::string status_board::json(double now) const {
  using nlohmann::json;
  std::lock_guard<std::mutex> lock(mu_);
  json j;
  j["job"] = {{"id", opts_.job_id}, {"state", to_string(state_)}, {"generation", generation_}, {"world_size", world_},
              {"step", step_}, {"max_steps", opts_.max_steps}, {"loss", loss_}, {"samples_per_s", samples_per_s_},
              {"uptime_s", started_ > 0 ? now - started_ : 0.0}, {"keyed", opts_.keyed}};
  j["eval"] = {{"step", eval_step_}, {"metrics", eval_}};
  j["members"] = json::array();
  for (const auto& [id, m] : members_) {
    json ranks = json::array();
    for (const auto& [r, s] : m.rank_steps) ranks.push_back({{"rank", r}, {"step", s}});
    j["members"].push_back({{"node", id}, {"host", opts_.keyed ? "" : bounded(m.host)}, {"node_rank", m.node_rank}, {"nproc", m.nproc},
                            {"ready_ranks", m.ready_ranks}, {"state", to_string(m.state)},
                            {"heartbeat_age_s", m.left_at == 0 && m.heard_at > 0 ? std::max(0.0, now - m.heard_at) : -1.0}, {"ranks", ranks}});
  }
  j["series"] = json::array();
  for (const auto& p : series_) j["series"].push_back({{"t", p.t - now}, {"step", p.step}, {"samples_per_s", p.samples_per_s}, {"loss", p.loss}, {"world", p.world}});
  j["recoveries"] = {{"total", recoveries_total_}, {"lost_steps", lost_steps_total_}, {"last", json::array()}};
  for (const auto& r : recoveries_)
    j["recoveries"]["last"].push_back({{"ago_s", now - r.t}, {"cause", r.cause}, {"node", r.node}, {"detected_s", r.detected_s}, {"duration_s", r.duration_s},
                                       {"resumed_step", r.resumed_step}, {"lost_steps", r.lost_steps}, {"world", r.world}});
  j["checkpoints"] = json::array();
  for (const auto& c : checkpoints_)
    j["checkpoints"].push_back({{"ago_s", now - c.t}, {"step", c.step}, {"bytes", c.bytes}, {"seconds", c.seconds}, {"location", c.location}});
  j["errors"] = json::array();
  for (const auto& e : errors_) j["errors"].push_back({{"ago_s", now - e.t}, {"text", e.text}});
  return j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
}

}  // namespace dtactor
