#include "monitoring/report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "job/journal_events.hpp"
#include "monitoring/goodput.hpp"
#include "storage/fs.hpp"

namespace dtactor {

namespace report_svg {

std::string escape_xml(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else if (c == '&') out += "&amp;";
    else if (c == '"') out += "&quot;";
    else out += c;
  }
  return out;
}

// 1, 2 or 5 times a power of ten, giving about `n` intervals over [lo, hi].
double nice_step(double lo, double hi, int n) {
  const double raw = (hi - lo) / std::max(1, n);
  if (!(raw > 0) || !std::isfinite(raw)) return 1;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (raw <= m * p) return m * p;
  return 10 * p;
}

std::string tick_label(double v, double step) {
  char buf[64];
  if (std::fabs(v) >= 10000 && step >= 1000) {
    std::snprintf(buf, sizeof buf, "%.0fk", v / 1000);
  } else if (step >= 1) {
    std::snprintf(buf, sizeof buf, "%.0f", v);
  } else {
    const int digits = std::min(6, static_cast<int>(std::ceil(-std::log10(step))));
    std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  }
  return buf;
}

}  // namespace report_svg

using report_svg::escape_xml;
using report_svg::nice_step;
using report_svg::tick_label;

namespace {

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

std::string utc(double t) {
  // A journal time past the year 9999 (or NaN) is corrupt, not a date.
  if (!(t > 0) || t > 253402300799.0) return "?";
  const std::time_t s = static_cast<std::time_t>(t);
  std::tm tm{};
  gmtime_r(&s, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return buf;
}

std::string duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  if (s < 0.1) return fmt("%.1f ms", s * 1000);
  if (s < 10) return fmt("%.2f s", s);
  if (s < 120) return fmt("%.0f s", s);
  if (s > 1e12) return fmt("%.3g s", s);  // beyond any real run; keeps lround in range
  const long t = std::lround(s);
  char buf[48];
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%ld h %02ld min", t / 3600, (t / 60) % 60);
  else
    std::snprintf(buf, sizeof buf, "%ld min %02ld s", t / 60, t % 60);
  return buf;
}

std::string bytes(double b) {
  if (b <= 0) return "?";
  if (b >= 1024.0 * 1024 * 1024) return fmt("%.2f GiB", b / (1024.0 * 1024 * 1024));
  if (b >= 1024.0 * 1024) return fmt("%.1f MiB", b / (1024.0 * 1024));
  return fmt("%.1f KiB", b / 1024.0);
}

std::string metric_value(const std::string& name, double v) {
  if (name.find("accuracy") != std::string::npos || name == "exact_match") return fmt("%.2f%%", 100 * v);
  return fmt("%.4f", v);
}

// Markdown table cells must not contain a bare '|' or a newline.
std::string cell(std::string s) {
  std::string out;
  for (char c : s) {
    if (c == '|') out += "\\|";
    else if (c == '\n') out += ' ';
    else out += c;
  }
  return out;
}

// The value of `key` under [section] in the effective config (written by
// config::to_toml: one "key = value" per line), unquoted; "" when absent.
std::string toml_value(const std::string& toml, const std::string& section, const std::string& key) {
  std::istringstream in(toml);
  std::string line, current;
  while (std::getline(in, line)) {
    if (!line.empty() && line[0] == '[') {
      current = line.substr(1, line.find(']') - 1);
      continue;
    }
    const auto eq = line.find('=');
    if (current != section || eq == std::string::npos) continue;
    std::string k = line.substr(0, eq), v = line.substr(eq + 1);
    k.erase(k.find_last_not_of(" \t") + 1);
    v.erase(0, v.find_first_not_of(" \t"));
    v.erase(v.find_last_not_of(" \t\r") + 1);
    if (v.size() >= 2 && (v.front() == '\'' || v.front() == '"')) v = v.substr(1, v.size() - 2);
    if (k == key) return v;
  }
  return "";
}

}  // namespace

std::string_view to_string(run_digest::outcome_kind o) {
  switch (o) {
    case run_digest::outcome_kind::unknown: return "unknown";
    case run_digest::outcome_kind::finished: return "finished";
    case run_digest::outcome_kind::failed: return "failed";
    case run_digest::outcome_kind::stopped: return "stopped";
    case run_digest::outcome_kind::interrupted: return "interrupted";
    case run_digest::outcome_kind::running: return "running";
  }
  return "unknown";
}

bool report_lower_is_better(const std::string& metric) {
  return metric.find("loss") != std::string::npos || metric == "perplexity";
}

namespace {

// Folds a journal's events, in order, into a run_digest. One handler per
// event the report shows; every other event only moves the run's times.
// What a journaled rank's resources say of its data reading.
ev::data_reading data_reading_of(const ev::rank_resources& r) {
  ev::data_reading x;
  x.bytes_s3 = r.data_bytes_s3.value_or(0);
  x.bytes_local = r.data_bytes_local.value_or(0);
  x.cache_hits = r.data_cache_hits.value_or(0);
  x.cache_misses = r.data_cache_misses.value_or(0);
  x.shards_verified = r.data_shards_verified.value_or(0);
  x.shards_failed = r.data_shards_failed.value_or(0);
  x.read_ahead_depth = r.data_read_ahead_depth.value_or(0);
  x.cache_bytes = r.data_cache_bytes.value_or(0);
  x.cache_peak_bytes = r.data_cache_peak_bytes.value_or(0);
  return x;
}

class digest_builder {
 public:
  // `t` is the event's time (0: none journaled).
  void add(double t, const ev::journal_event& event) {
    if (take_batch_search(event)) return;
    if (t > 0) {
      if (d_.first_t == 0) d_.first_t = t;
      d_.last_t = std::max(d_.last_t, t);
    }
    track_session(t, event);
    goodput_.add(t, event);
    std::visit([&](const auto& e) { on(t, e); }, event);
  }
  run_digest& digest() { return d_; }
  // The figures once every line is in.
  void finish() {
    if (goodput_.started()) d_.goodput = goodput_.figures();
  }

 private:
  // `dtactor tune-batch` runs before (or between) trainings: its events are
  // not part of a training session. True when `event` was one of them.
  bool take_batch_search(const ev::journal_event& event) {
    if (auto* e = std::get_if<ev::batch_size_search_started>(&event)) {
      d_.batch_trials.clear();
      d_.batch_found = -1;
      d_.batch_budget_bytes = static_cast<double>(e->max_memory_bytes);
      return true;
    }
    if (auto* e = std::get_if<ev::batch_size_trial>(&event)) {
      d_.batch_trials.push_back({e->micro_batch, e->fits, e->peak_rss_bytes, e->samples_per_s.value_or(0), e->reason.value_or("")});
      return true;
    }
    if (auto* e = std::get_if<ev::batch_size_found>(&event)) {
      d_.batch_found = e->micro_batch;
      d_.batch_limited_by_up_to = e->limited_by_up_to.value_or(false);
      return true;
    }
    return false;
  }

  run_digest::session* current() { return d_.sessions.empty() ? nullptr : &d_.sessions.back(); }

  // One session per start event: a coordinator_started, or a job_started
  // (`dtactor train`) outside a coordinator's session. What a process
  // journals before its start event (a coordinator's checkpoint search, its
  // shipped module) belongs to that start; a session of kind unknown is
  // left only for a journal with no start event before its first events
  // (older writers).
  void track_session(double t, const ev::journal_event& event) {
    const auto* job_start = std::get_if<ev::job_started>(&event);
    const auto* coordinator_start = std::get_if<ev::coordinator_started>(&event);
    using kind = run_digest::session::kind;
    const bool in_cluster = current() && current()->what == kind::cluster;
    if (coordinator_start || (job_start && !in_cluster)) {
      const kind started = job_start ? kind::train : kind::cluster;
      if (current() && current()->what == kind::unknown)
        current()->what = started;
      else
        d_.sessions.push_back({t, t, started});
      d_.outcome = run_digest::outcome_kind::interrupted;
      d_.outcome_detail.clear();
      open_losses_.clear();
    } else if (!current() && t > 0) {
      d_.sessions.push_back({t, t, kind::unknown});
    }
    if (current() && t > 0) current()->end = std::max(current()->end, t);
  }

  template <class E>
  void on(double, const E&) {}  // an event the report does not show

  void on(double, const ev::job_started& e) {
    if (!e.model.empty()) d_.model = e.model;
    if (e.parameters) d_.parameters = e.parameters;
    if (e.max_steps) d_.max_steps = e.max_steps;
    if (e.global_batch_size) d_.global_batch_size = e.global_batch_size;
  }
  void on(double, const ev::coordinator_started& e) {
    if (!e.job_id.empty()) d_.job_id = e.job_id;
  }
  void on(double t, const ev::step_completed& e) {
    run_digest::point p;
    p.step = e.step;
    p.t = t;
    p.loss = e.loss;
    p.samples_per_s = e.samples_per_s;
    p.world_size = e.world_size > 0 ? e.world_size : 1;
    d_.steps.push_back(p);
    d_.last_step = std::max(d_.last_step, p.step);
  }
  void on(double t, const ev::eval_done& e) { d_.evals.push_back({e.step, t, e.metrics, e.examples}); }
  void on(double t, const ev::generation_started& e) { d_.generations.push_back({e.generation, t, e.world_size, e.start_step, e.nodes}); }
  void on(double t, const ev::node_joined& e) {
    d_.nodes_joined.push_back(e.node.empty() ? "?" : e.node);
    d_.marks.push_back({t, run_digest::mark::kind::joined, e.node});
  }
  void on(double t, const ev::node_lost& e) {
    open_loss(t, e.node, ev::to_string(e.cause), e.detected_after_s, run_digest::mark::kind::lost);
  }
  void on(double t, const ev::node_left& e) {
    open_loss(t, e.node, std::string(ev::node_left::name) + (e.reason.empty() ? "" : ": " + e.reason), -1, run_digest::mark::kind::left);
  }
  // A row that the next recovery_done closes.
  void open_loss(double t, const std::string& node, std::string cause, double detected_after_s, run_digest::mark::kind mark) {
    run_digest::recovery r;
    r.t = t;
    r.node = node.empty() ? "?" : node;
    r.cause = std::move(cause);
    r.detected_after_s = detected_after_s;
    d_.recoveries.push_back(r);
    open_losses_.push_back(d_.recoveries.size() - 1);
    d_.marks.push_back({t, mark, r.node});
  }
  // Closes every loss since the last recovery (a node lost twice before it
  // included); a recovery with no journaled loss before it (e.g. a rank
  // restart) gets its own row.
  void on(double t, const ev::recovery_done& e) {
    ++d_.recoveries_done;
    auto close = [&e](run_digest::recovery& r) {
      r.duration_s = e.duration_s;
      r.lost_steps = e.lost_steps;
      r.resumed_step = e.resumed_step;
      r.generation = e.generation;
      r.world_size = e.world_size;
    };
    for (size_t idx : open_losses_) close(d_.recoveries[idx]);
    d_.marks.push_back({t, run_digest::mark::kind::recovered, "world " + std::to_string(e.world_size)});
    if (open_losses_.empty()) {
      run_digest::recovery r;
      r.t = t;
      r.cause = e.cause == ev::plan_cause::none ? "recovery" : ev::to_string(e.cause);
      close(r);
      d_.recoveries.push_back(r);
    }
    open_losses_.clear();
  }
  void on(double, const ev::resources& e) {
    for (const auto& r : e.ranks) {
      const std::string node = r.node.empty() ? "?" : r.node;
      auto& rr = d_.resources[node + "/" + std::to_string(r.rank)];
      rr.node = node;
      rr.rank = r.rank;
      rr.peak_rss_bytes = std::max(rr.peak_rss_bytes, r.peak_rss_bytes);
      rr.cpu_s = r.cpu_s;
      rr.elapsed_s = r.elapsed_s;
      if (r.data_bytes_s3 || r.data_bytes_local)
        rr.data = data_reading_of(r);
    }
  }
  void on(double t, const ev::checkpoint_saved& e) {
    ++d_.checkpoints_saved;
    d_.marks.push_back({t, run_digest::mark::kind::checkpoint, std::to_string(e.step)});
    d_.last_checkpoint_step = e.step;
    d_.last_checkpoint_bytes = static_cast<double>(e.bytes);
    d_.checkpoint_seconds_total += e.duration_s;
  }
  void on(double, const ev::checkpoint_skipped& e) {
    d_.checkpoint_problems.push_back(std::string(e.name) + ": " + e.path + " (" + or_unknown(e.reason) + ")");
  }
  void on(double, const ev::checkpoint_refused& e) {
    d_.checkpoint_problems.push_back(std::string(e.name) + ": step " + std::to_string(e.step) + " by rank " + std::to_string(e.rank) + " (" +
                                     or_unknown(e.reason) + "); " +
                                     (e.fallback_step >= 0 ? "fell back to step " + std::to_string(e.fallback_step) : "none left: the job failed"));
  }
  void on(double, const ev::checkpoint_failed& e) {
    d_.checkpoint_problems.push_back(std::string(e.name) + ": step " + std::to_string(e.step) + " (" + or_unknown(e.reason) + ")");
  }
  void on(double, const ev::checkpoint_restored& e) { d_.restores.emplace_back(e.step, ev::to_string(e.source)); }
  void on(double, const ev::rank_down& e) {
    d_.failures.push_back(std::string(ev::name_of(e)) + ": rank " + std::to_string(e.rank) + " on " + (e.node.empty() ? "?" : e.node) + " at step " +
                          std::to_string(e.step) + " (" + (e.detail.empty() ? "exit code " + std::to_string(e.exit_code) : e.detail) + ")");
  }
  void on(double, const ev::job_finished& e) {
    d_.outcome = e.error ? run_digest::outcome_kind::failed : run_digest::outcome_kind::finished;
    d_.outcome_detail = e.error.value_or("");
    d_.last_step = std::max(d_.last_step, e.step);
  }
  void on(double, const ev::job_failed& e) {
    d_.outcome = run_digest::outcome_kind::failed;
    d_.outcome_detail = e.reason;
    d_.failures.push_back(std::string(e.name) + " at step " + std::to_string(e.step) + ": " + or_unknown(e.reason));
  }
  void on(double, const ev::job_stopped& e) {
    d_.outcome = run_digest::outcome_kind::stopped;
    d_.outcome_detail = e.reason.value_or("");
  }

  static std::string or_unknown(const std::string& s) { return s.empty() ? "?" : s; }

  run_digest d_;
  goodput_book goodput_;
  std::vector<size_t> open_losses_;  // rows of d_.recoveries that the next recovery_done closes
};

}  // namespace

result<run_digest> digest_journal(std::istream& in, const std::string& name) {
  digest_builder b;
  std::string text;
  int64_t line_no = 0;
  while (std::getline(in, text)) {
    ++line_no;
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto read = ev::read_journal_line(text);
    if (!read)
      return make_error(name + " line " + std::to_string(line_no) + " is not a journal event (" + read.message() + "); fix or remove that line");
    ++b.digest().events;
    if (read.value()) b.add(read.value()->t, read.value()->event);  // none: a newer writer's event
  }
  if (b.digest().events == 0) return make_error(name + " has no events; is the run still starting?");
  b.finish();
  return std::move(b.digest());
}

std::string render_loss_svg(const run_digest& d) {
  const double W = 720, H = 360, L = 64, R = 20, T = 30, B = 48;
  std::vector<const run_digest::point*> pts;
  for (const auto& p : d.steps)
    if (std::isfinite(p.loss)) pts.push_back(&p);
  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H << "\" viewBox=\"0 0 " << W << ' ' << H
    << "\" font-family=\"sans-serif\" font-size=\"11\">\n";
  o << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  o << "<text x=\"" << W / 2 << "\" y=\"18\" text-anchor=\"middle\" font-size=\"13\">training loss"
    << (d.model.empty() ? "" : " (" + escape_xml(d.model) + ")") << "</text>\n";
  if (pts.empty()) {
    o << "<text x=\"" << W / 2 << "\" y=\"" << H / 2 << "\" text-anchor=\"middle\">no step events with a finite loss</text>\n</svg>\n";
    return o.str();
  }
  double x0 = 0, x1 = static_cast<double>(std::max<int64_t>(pts.back()->step, d.max_steps));
  for (auto* p : pts) x1 = std::max(x1, static_cast<double>(p->step));
  double y0 = pts[0]->loss, y1 = pts[0]->loss;
  for (auto* p : pts) y0 = std::min(y0, p->loss), y1 = std::max(y1, p->loss);
  y0 = std::min(0.0, y0);
  if (y1 <= y0) y1 = y0 + 1;
  const double ys = nice_step(y0, y1, 5), xs = nice_step(x0, std::max(x1, 1.0), 6);
  y1 = std::ceil(y1 / ys) * ys;
  x1 = std::max(std::ceil(x1 / xs) * xs, xs);
  auto X = [&](double v) { return L + (v - x0) / (x1 - x0) * (W - L - R); };
  auto Y = [&](double v) { return H - B - (v - y0) / (y1 - y0) * (H - T - B); };
  o.setf(std::ios::fixed);
  o.precision(1);
  // Grid and axes.
  for (double v = y0; v <= y1 + ys / 2; v += ys) {
    o << "<line x1=\"" << L << "\" y1=\"" << Y(v) << "\" x2=\"" << W - R << "\" y2=\"" << Y(v) << "\" stroke=\"#e5e5e5\"/>\n";
    o << "<text x=\"" << L - 6 << "\" y=\"" << Y(v) + 4 << "\" text-anchor=\"end\">" << tick_label(v, ys) << "</text>\n";
  }
  for (double v = x0; v <= x1 + xs / 2; v += xs) {
    o << "<line x1=\"" << X(v) << "\" y1=\"" << H - B << "\" x2=\"" << X(v) << "\" y2=\"" << H - B + 4 << "\" stroke=\"#333\"/>\n";
    o << "<text x=\"" << X(v) << "\" y=\"" << H - B + 16 << "\" text-anchor=\"middle\">" << tick_label(v, xs) << "</text>\n";
  }
  o << "<line x1=\"" << L << "\" y1=\"" << H - B << "\" x2=\"" << W - R << "\" y2=\"" << H - B << "\" stroke=\"#333\"/>\n";
  o << "<line x1=\"" << L << "\" y1=\"" << T << "\" x2=\"" << L << "\" y2=\"" << H - B << "\" stroke=\"#333\"/>\n";
  o << "<text x=\"" << (L + W - R) / 2 << "\" y=\"" << H - 10 << "\" text-anchor=\"middle\">step</text>\n";
  o << "<text x=\"14\" y=\"" << (T + H - B) / 2 << "\" text-anchor=\"middle\" transform=\"rotate(-90 14 " << (T + H - B) / 2
    << ")\">loss</text>\n";
  // Membership changes after the first generation, and recoveries.
  for (size_t i = 1; i < d.generations.size(); ++i) {
    const auto& g = d.generations[i];
    const double x = X(static_cast<double>(g.start_step));
    o << "<line x1=\"" << x << "\" y1=\"" << T << "\" x2=\"" << x << "\" y2=\"" << H - B
      << "\" stroke=\"#d62728\" stroke-dasharray=\"4 3\"/>\n";
    o << "<text x=\"" << x + 3 << "\" y=\"" << T + 10 << "\" fill=\"#d62728\">gen " << g.number << ", world " << g.world_size << "</text>\n";
  }
  // The curve.
  o << "<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"1.5\" points=\"";
  for (auto* p : pts) o << X(static_cast<double>(p->step)) << ',' << Y(p->loss) << ' ';
  o << "\"/>\n";
  // Evaluation losses as dots, when there are any.
  for (const auto& e : d.evals) {
    auto it = e.metrics.find("val_loss");
    if (it == e.metrics.end() || !std::isfinite(it->second) || it->second > y1 || it->second < y0) continue;
    o << "<circle cx=\"" << X(static_cast<double>(e.step)) << "\" cy=\"" << Y(it->second) << "\" r=\"3\" fill=\"#ff7f0e\"/>\n";
  }
  o << "<text x=\"" << W - R << "\" y=\"" << T + 10 << "\" text-anchor=\"end\" fill=\"#1f77b4\">train loss";
  bool any_val = false;
  for (const auto& e : d.evals) any_val = any_val || e.metrics.count("val_loss");
  o << "</text>\n";
  if (any_val) o << "<text x=\"" << W - R << "\" y=\"" << T + 24 << "\" text-anchor=\"end\" fill=\"#ff7f0e\">● validation loss</text>\n";
  o << "</svg>\n";
  return o.str();
}

namespace {

// The summary table; returns the smallest world size seen (0: none).
int summary_section(std::ostringstream& o, const run_digest& d) {
  double train_s = 0;
  for (const auto& s : d.sessions) train_s += std::max(0.0, s.end - s.start);
  o << "## Summary\n\n| | |\n|---|---|\n";
  if (!d.model.empty()) o << "| model | " << cell(d.model) << (d.parameters ? " (" + std::to_string(d.parameters) + " parameters)" : "") << " |\n";
  if (!d.job_id.empty()) o << "| job | " << cell(d.job_id) << " |\n";
  o << "| outcome | **" << to_string(d.outcome) << "**" << (d.outcome_detail.empty() ? "" : ": " + cell(d.outcome_detail)) << " |\n";
  o << "| steps | " << d.last_step;
  if (d.max_steps > 0) o << " of " << d.max_steps;
  o << " |\n";
  o << "| started | " << utc(d.first_t) << " |\n| last event | " << utc(d.last_t) << " |\n";
  o << "| training time | " << duration(train_s);
  if (d.sessions.size() > 1) o << " over " << d.sessions.size() << " starts (resumed " << d.sessions.size() - 1 << " time(s))";
  o << " |\n";
  if (!d.steps.empty()) {
    std::vector<double> sps;
    for (const auto& p : d.steps)
      if (p.samples_per_s > 0) sps.push_back(p.samples_per_s);
    if (!sps.empty()) {
      std::sort(sps.begin(), sps.end());
      o << "| throughput | median " << fmt("%.0f", sps[sps.size() / 2]) << " samples/s (min " << fmt("%.0f", sps.front()) << ", max "
        << fmt("%.0f", sps.back()) << ") |\n";
    }
    o << "| last training loss | " << fmt("%.4f", d.steps.back().loss) << " at step " << d.steps.back().step << " |\n";
  }
  int max_world = 0, min_world = 0;
  for (const auto& g : d.generations) {
    max_world = std::max(max_world, g.world_size);
    min_world = min_world == 0 ? g.world_size : std::min(min_world, g.world_size);
  }
  for (const auto& p : d.steps) {
    max_world = std::max(max_world, p.world_size);
    min_world = min_world == 0 ? p.world_size : std::min(min_world, p.world_size);
  }
  if (max_world > 0) o << "| world size | " << (min_world == max_world ? std::to_string(max_world) : std::to_string(min_world) + " to " + std::to_string(max_world)) << " rank(s) |\n";
  o << "| recoveries | " << d.recoveries_done << " |\n";
  if (const auto losses = std::count_if(d.recoveries.begin(), d.recoveries.end(), [](const auto& r) { return !r.node.empty(); }))
    o << "| nodes lost or left | " << losses << " |\n";
  o << "\n";
  return min_world;
}

// The final and best value of every metric evaluated.
void evaluation_section(std::ostringstream& o, const run_digest& d) {
  o << "## Evaluation\n\n";
  if (d.evals.empty()) {
    o << "No evaluation was journaled.\n\n";
  } else {
    const auto& last = d.evals.back();
    std::set<std::string> names;
    for (const auto& e : d.evals)
      for (const auto& [k, v] : e.metrics) names.insert(k);
    o << "| metric | final (step " << last.step << ") | best | at step |\n|---|---|---|---|\n";
    for (const auto& n : names) {
      const bool lower = report_lower_is_better(n);
      const run_digest::eval_point* best = nullptr;
      for (const auto& e : d.evals) {
        auto it = e.metrics.find(n);
        if (it == e.metrics.end() || !std::isfinite(it->second)) continue;
        if (!best || (lower ? it->second < best->metrics.at(n) : it->second > best->metrics.at(n))) best = &e;
      }
      auto f = last.metrics.find(n);
      o << "| " << cell(n) << (lower ? " (lower is better)" : "") << " | " << (f != last.metrics.end() ? metric_value(n, f->second) : "-") << " | "
        << (best ? metric_value(n, best->metrics.at(n)) : "-") << " | " << (best ? std::to_string(best->step) : "-") << " |\n";
    }
    o << "\n" << d.evals.size() << " evaluation(s).";
    if (!last.examples.empty()) {
      o << " Examples from the last one:\n\n";
      for (size_t i = 0; i < last.examples.size() && i < 8; ++i) o << "- `" << last.examples[i] << "`\n";
    }
    o << "\n\n";
  }
}

// Each rank's memory and CPU, and (sharded data) what it read.
void resources_section(std::ostringstream& o, const run_digest& d) {
  o << "## Resources\n\n";
  if (d.resources.empty()) {
    o << "No `resources` events in the journal (written by this version's coordinator and `dtactor train`).\n\n";
  } else {
    o << "| node | rank | peak resident memory | CPU time | CPU utilization |\n|---|---|---|---|---|\n";
    for (const auto& [k, r] : d.resources) {
      o << "| " << cell(r.node) << " | " << r.rank << " | " << bytes(r.peak_rss_bytes) << " | " << duration(r.cpu_s) << " | "
        << (r.elapsed_s > 0 ? fmt("%.0f%%", 100 * r.cpu_s / r.elapsed_s) + " of one core" : std::string("?")) << " |\n";
    }
    o << "\nCPU utilization is the process's CPU time over its lifetime (100% = one core busy all the time).\n\n";
  }

  // ---- sharded data ----
  bool sharded = false;
  for (const auto& [k, r] : d.resources) sharded = sharded || r.data.has_value();
  if (sharded) {
    o << "## Data\n\n| node | rank | read from S3 | read locally | cache hits | misses | shards verified | failed | peak cache |\n"
         "|---|---|---|---|---|---|---|---|---|\n";
    for (const auto& [k, r] : d.resources) {
      if (!r.data) continue;
      const auto& x = *r.data;
      o << "| " << cell(r.node) << " | " << r.rank << " | " << bytes(static_cast<double>(x.bytes_s3)) << " | "
        << bytes(static_cast<double>(x.bytes_local)) << " | " << x.cache_hits << " | " << x.cache_misses << " | " << x.shards_verified << " | "
        << x.shards_failed << " | " << bytes(static_cast<double>(x.cache_peak_bytes)) << " |\n";
    }
    o << "\nThe latest reading of each rank process since it started (a restarted process counts again from 0); docs/data.md.\n\n";
  }
}

// The batch a forward pass ran, and tune-batch's trials.
void batch_section(std::ostringstream& o, const run_digest& d, const std::string& config_toml, int min_world) {
  o << "## Batch size\n\n";
  if (d.global_batch_size > 0 || !config_toml.empty()) {
    int64_t gb = d.global_batch_size;
    if (gb == 0) gb = std::atoll(toml_value(config_toml, "train", "global_batch_size").c_str());
    const int64_t micro = std::atoll(toml_value(config_toml, "train", "micro_batch_size").c_str());
    const int w = min_world > 0 ? min_world : 1;
    const int64_t share = gb > 0 ? (gb + w - 1) / w : 0;
    const int64_t forward = micro > 0 ? std::min(micro, share) : share;
    o << "Global batch " << gb << " samples per step";
    if (share > 0) o << "; the largest per-rank share was " << share << " (world size " << w << ")";
    if (forward > 0) o << ", and the largest batch one forward pass ran was **" << forward << "**" << (micro > 0 ? " (train.micro_batch_size)" : "");
    o << "." << (d.batch_trials.empty() ? " Larger batches were not tried in this run." : "") << "\n\n";
  } else {
    o << "Unknown (no `job_started` event and no config).\n\n";
  }
  if (!d.batch_trials.empty()) {
    o << "`dtactor tune-batch` tried " << d.batch_trials.size() << " micro-batch sizes within " << bytes(d.batch_budget_bytes)
      << " per rank (doubling, then bisecting; one fresh process per size): ";
    if (d.batch_found > 0)
      o << "the largest that fits is **" << d.batch_found << "**" << (d.batch_limited_by_up_to ? " (every size tried fit)" : "") << ".\n\n";
    else if (d.batch_found == 0)
      o << "none fit.\n\n";
    else
      o << "the search did not finish.\n\n";
    o << "| micro-batch | fits | peak resident memory | samples/s | why not |\n|---|---|---|---|---|\n";
    for (const auto& t : d.batch_trials)
      o << "| " << t.micro_batch << " | " << (t.fits ? "yes" : "no") << " | " << bytes(t.peak_rss_bytes) << " | "
        << (t.fits ? fmt("%.0f", t.samples_per_s) : std::string("")) << " | " << cell(t.reason) << " |\n";
    o << "\n";
  }
}

// Nodes that joined and the generations.
void cluster_section(std::ostringstream& o, const run_digest& d) {
  if (!d.generations.empty() || !d.nodes_joined.empty()) {
    o << "## Cluster membership\n\n";
    if (!d.nodes_joined.empty()) {
      o << "Nodes that joined: ";
      for (size_t i = 0; i < d.nodes_joined.size(); ++i) o << (i ? ", " : "") << "`" << d.nodes_joined[i] << "`";
      o << ".\n\n";
    }
    if (!d.generations.empty()) {
      o << "| generation | at | world size | from step | nodes |\n|---|---|---|---|---|\n";
      for (const auto& g : d.generations) {
        std::string nodes;
        for (size_t i = 0; i < g.nodes.size(); ++i) nodes += (i ? ", " : "") + g.nodes[i];
        o << "| " << g.number << " | +" << duration(g.t - d.first_t) << " | " << g.world_size << " | " << g.start_step << " | " << cell(nodes)
          << " |\n";
      }
      o << "\n";
    }
  }
}

// Productive time over wall time, and where the rest went
// (monitoring/goodput.hpp defines the buckets).
void goodput_section(std::ostringstream& o, const run_digest& d) {
  if (!d.goodput || !(d.goodput->wall_s > 0)) return;
  const ev::goodput& g = *d.goodput;
  o << "## Goodput\n\n**" << fmt("%.1f%%", 100 * g.ratio) << "** of " << duration(g.wall_s)
    << " went into training steps (productive time over wall time since the first start).\n\n"
    << "| where the time went | time | share |\n|---|---|---|\n";
  const std::pair<const char*, double> rows[] = {{"productive (training steps)", g.productive_s},
                                                 {"start (to the first step)", g.start_s},
                                                 {"recovery (detection, new generation, first step)", g.recovery_s},
                                                 {"waiting for nodes (cluster.floor_nodes)", g.waiting_s},
                                                 {"checkpoint stalls", g.checkpoint_s},
                                                 {"evaluation", g.eval_s},
                                                 {"other (reporting, the end, downtime between starts)", g.other_s}};
  for (const auto& [what, s] : rows) o << "| " << what << " | " << duration(s) << " | " << fmt("%.1f%%", 100 * s / g.wall_s) << " |\n";
  o << "\n";
}

// Every recovery, and the failures.
void recoveries_section(std::ostringstream& o, const run_digest& d) {
  o << "## Recoveries\n\n";
  if (d.recoveries.empty()) {
    o << "None: no node was lost or left during the run.\n\n";
  } else {
    o << "| when | cause | node | detected after | recovery took | steps lost | resumed at step | new world size |\n"
         "|---|---|---|---|---|---|---|---|\n";
    for (const auto& r : d.recoveries) {
      o << "| " << utc(r.t) << " (+" << duration(r.t - d.first_t) << ") | " << cell(r.cause) << " | " << cell(r.node) << " | "
        << (r.detected_after_s >= 0 ? duration(r.detected_after_s) : "-") << " | "
        << (r.duration_s >= 0 ? duration(r.duration_s) : "not finished") << " | "
        << (r.lost_steps >= 0 ? std::to_string(r.lost_steps) : "-") << " | "
        << (r.resumed_step >= 0 ? std::to_string(r.resumed_step) : "-") << " | " << (r.world_size > 0 ? std::to_string(r.world_size) : "-")
        << " |\n";
    }
    o << "\n";
  }
  if (!d.failures.empty()) {
    o << "Failures:\n\n";
    for (const auto& f : d.failures) o << "- " << f << "\n";
    o << "\n";
  }
}

// What was saved and resumed from.
void checkpoints_section(std::ostringstream& o, const run_digest& d) {
  o << "## Checkpoints\n\n";
  if (d.checkpoints_saved == 0) {
    o << "None saved.\n";
  } else {
    o << d.checkpoints_saved << " saved, the last at step " << d.last_checkpoint_step << " (" << bytes(d.last_checkpoint_bytes)
      << "); " << duration(d.checkpoint_seconds_total / d.checkpoints_saved) << " per save on average.\n";
  }
  for (const auto& [step, source] : d.restores) o << "\n- resumed from step " << step << " (" << source << ")";
  if (!d.restores.empty()) o << "\n";
  for (const auto& p : d.checkpoint_problems) o << "\n- " << cell(p);
  o << "\n\n";
}

}  // namespace

std::string render_report(const run_digest& d, const std::string& run_dir, const std::string& config_toml, const std::string& svg_name) {
  std::ostringstream o;
  o << "# Log book: " << run_dir << "\n\n";
  o << "Written by `dtactor report` from `journal.jsonl`";
  if (!config_toml.empty()) o << " and `config.toml`";
  o << " (" << d.events << " events).\n\n";
  const int min_world = summary_section(o, d);
  evaluation_section(o, d);
  if (!svg_name.empty()) o << "## Timeline\n\n![world size, samples/s and loss against wall time](timeline.svg)\n\n## Loss\n\n![training loss](" << svg_name << ")\n\n";
  resources_section(o, d);
  batch_section(o, d, config_toml, min_world);
  goodput_section(o, d);
  cluster_section(o, d);
  recoveries_section(o, d);
  checkpoints_section(o, d);
  if (!config_toml.empty()) o << "## Config\n\n```toml\n" << config_toml << (config_toml.back() == '\n' ? "" : "\n") << "```\n";
  return o.str();
}

result<report_files> write_report(const std::string& run_dir, const std::string& out) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(run_dir, ec)) return make_error("report: '" + run_dir + "' is not a directory; give a run directory (e.g. runs/local)");
  const std::string journal_path = run_dir + "/journal.jsonl";
  std::ifstream in(journal_path);
  if (!in) return make_error("report: no journal in '" + run_dir + "' (" + journal_path + " cannot be read); is it a dtactor run directory?");
  auto d = digest_journal(in, journal_path);
  if (!d) return make_error("report: " + d.message());
  std::string config_toml;
  if (fs::exists(run_dir + "/config.toml", ec)) {
    auto c = read_file(run_dir + "/config.toml");
    if (!c) return make_error("report: " + c.message());
    config_toml = c.value();
  }
  // A cluster's journal does not repeat what the config says.
  auto& dg = d.value();
  // The last session has no end event: still running if a dtactor holds the
  // run directory's lock, else it was interrupted.
  if (dg.outcome == run_digest::outcome_kind::interrupted)
    if (auto who = file_lock::holder(run_dir_lock_path(run_dir)); !who.empty()) {
      dg.outcome = run_digest::outcome_kind::running;
      dg.outcome_detail = who;
    }
  if (dg.model.empty()) dg.model = toml_value(config_toml, "model", "name");
  if (dg.max_steps == 0) dg.max_steps = std::atoll(toml_value(config_toml, "train", "max_steps").c_str());
  if (dg.global_batch_size == 0) dg.global_batch_size = std::atoll(toml_value(config_toml, "train", "global_batch_size").c_str());
  report_files files;
  files.markdown = out.empty() ? run_dir + "/report.md" : out;
  const fs::path md_dir = fs::path(files.markdown).parent_path();
  files.svg = (md_dir.empty() ? fs::path("loss.svg") : md_dir / "loss.svg").string();
  const std::string svg = render_loss_svg(d.value());
  if (auto st = write_file_atomic(files.svg, {svg}); !st) return make_error("report: " + st.message());
  files.timeline = (md_dir.empty() ? fs::path("timeline.svg") : md_dir / "timeline.svg").string();
  if (auto st = write_file_atomic(files.timeline, {render_timeline_svg(d.value())}); !st) return make_error("report: " + st.message());
  const std::string md = render_report(d.value(), run_dir, config_toml, "loss.svg");
  if (auto st = write_file_atomic(files.markdown, {md}); !st) return make_error("report: " + st.message());
  return files;
}

}  // namespace dtactor
