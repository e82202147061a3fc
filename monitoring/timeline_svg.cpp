// The log book's timeline (monitoring/report.hpp): three panels over one
// wall-clock axis, world size, samples/s and loss, with the membership
// changes, recoveries and checkpoints of the journal drawn across them.
#include <algorithm>
#include <cmath>
#include <functional>
#include <sstream>

#include "monitoring/report.hpp"

namespace dtactor {

namespace {

using report_svg::escape_xml;
using report_svg::nice_step;
using report_svg::tick_label;

constexpr double W = 900, L = 70, R = 150, T = 34, panel_h = 110, gap = 28, B = 40;

struct panel {
  const char* title;
  const char* color;
  double (*value)(const run_digest::point&);
  bool step_line;  // drawn as steps (a count), not a curve
};

const panel panels[] = {
    {"world size", "#555", [](const run_digest::point& p) { return static_cast<double>(p.world_size); }, true},
    {"samples/s", "#1f77b4", [](const run_digest::point& p) { return p.samples_per_s; }, false},
    {"loss", "#2ca02c", [](const run_digest::point& p) { return p.loss; }, false},
};

const char* mark_color(run_digest::mark::kind k) {
  switch (k) {
    case run_digest::mark::kind::lost: return "#d62728";
    case run_digest::mark::kind::left: return "#ff7f0e";
    case run_digest::mark::kind::joined: return "#2ca02c";
    case run_digest::mark::kind::recovered: return "#1f77b4";
    case run_digest::mark::kind::checkpoint: return "#999";
  }
  return "#999";
}

const char* mark_name(run_digest::mark::kind k) {
  switch (k) {
    case run_digest::mark::kind::lost: return "node lost";
    case run_digest::mark::kind::left: return "node left";
    case run_digest::mark::kind::joined: return "node joined";
    case run_digest::mark::kind::recovered: return "training again";
    case run_digest::mark::kind::checkpoint: return "checkpoint";
  }
  return "";
}

void draw_panel(std::ostringstream& o, const panel& p, double top, const std::vector<const run_digest::point*>& pts, double t0, double t1,
                const std::function<double(double)>& X) {
  double y0 = 0, y1 = 0;
  for (auto* q : pts)
    if (std::isfinite(p.value(*q))) y1 = std::max(y1, p.value(*q));
  if (y1 <= y0) y1 = 1;
  const double ys = nice_step(y0, y1, 3);
  y1 = std::ceil(y1 / ys) * ys;
  auto Y = [&](double v) { return top + panel_h - (v - y0) / (y1 - y0) * panel_h; };
  for (double v = y0; v <= y1 + ys / 2; v += ys) {
    o << "<line x1=\"" << L << "\" y1=\"" << Y(v) << "\" x2=\"" << W - R << "\" y2=\"" << Y(v) << "\" stroke=\"#eee\"/>\n";
    o << "<text x=\"" << L - 6 << "\" y=\"" << Y(v) + 4 << "\" text-anchor=\"end\">" << tick_label(v, ys) << "</text>\n";
  }
  o << "<text x=\"" << L << "\" y=\"" << top - 4 << "\" font-weight=\"bold\" fill=\"" << p.color << "\">" << p.title << "</text>\n";
  o << "<polyline fill=\"none\" stroke=\"" << p.color << "\" stroke-width=\"1.5\" points=\"";
  double last_y = -1;
  for (auto* q : pts) {
    const double v = p.value(*q);
    if (!std::isfinite(v) || q->t < t0 || q->t > t1) continue;
    if (p.step_line && last_y >= 0) o << X(q->t) << ',' << last_y << ' ';
    last_y = Y(v);
    o << X(q->t) << ',' << last_y << ' ';
  }
  o << "\"/>\n";
}

}  // namespace

std::string render_timeline_svg(const run_digest& d) {
  const double H = T + 3 * panel_h + 2 * gap + B;
  std::ostringstream o;
  o.setf(std::ios::fixed);
  o.precision(1);
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H << "\" viewBox=\"0 0 " << W << ' ' << H
    << "\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  o << "<text x=\"" << (L + W - R) / 2 << "\" y=\"16\" text-anchor=\"middle\" font-size=\"13\">the run against wall time"
    << (d.model.empty() ? "" : " (" + escape_xml(d.model) + ")") << "</text>\n";
  std::vector<const run_digest::point*> pts;
  for (const auto& p : d.steps)
    if (p.t > 0) pts.push_back(&p);
  if (pts.empty()) {
    o << "<text x=\"" << W / 2 << "\" y=\"" << H / 2 << "\" text-anchor=\"middle\">no step events</text>\n</svg>\n";
    return o.str();
  }
  const double t0 = std::min(d.first_t > 0 ? d.first_t : pts.front()->t, pts.front()->t), t1 = std::max({d.last_t, pts.back()->t, t0 + 1});
  const std::function<double(double)> X = [&](double t) { return L + (t - t0) / (t1 - t0) * (W - L - R); };
  for (int i = 0; i < 3; ++i) draw_panel(o, panels[i], T + i * (panel_h + gap), pts, t0, t1, X);
  const double bottom = T + 3 * panel_h + 2 * gap;
  // The time axis (seconds since the journal's first line).
  const double xs = nice_step(0, t1 - t0, 8);
  for (double v = 0; v <= t1 - t0 + xs / 2; v += xs) {
    o << "<line x1=\"" << X(t0 + v) << "\" y1=\"" << bottom << "\" x2=\"" << X(t0 + v) << "\" y2=\"" << bottom + 4 << "\" stroke=\"#333\"/>\n";
    o << "<text x=\"" << X(t0 + v) << "\" y=\"" << bottom + 16 << "\" text-anchor=\"middle\">" << tick_label(v, xs) << "</text>\n";
  }
  o << "<text x=\"" << (L + W - R) / 2 << "\" y=\"" << H - 6 << "\" text-anchor=\"middle\">seconds since the run started</text>\n";
  // Events across every panel; checkpoints as short ticks at the bottom.
  for (const auto& m : d.marks) {
    if (m.t < t0 || m.t > t1) continue;
    const double x = X(m.t);
    if (m.what == run_digest::mark::kind::checkpoint) {
      o << "<line x1=\"" << x << "\" y1=\"" << bottom - 6 << "\" x2=\"" << x << "\" y2=\"" << bottom << "\" stroke=\"" << mark_color(m.what) << "\"/>\n";
      continue;
    }
    o << "<line x1=\"" << x << "\" y1=\"" << T << "\" x2=\"" << x << "\" y2=\"" << bottom << "\" stroke=\"" << mark_color(m.what)
      << "\" stroke-dasharray=\"" << (m.what == run_digest::mark::kind::recovered ? "2 2" : "5 3") << "\"><title>" << mark_name(m.what) << ": "
      << escape_xml(m.label) << "</title></line>\n";
  }
  // The legend.
  double y = T + 6;
  for (auto k : {run_digest::mark::kind::lost, run_digest::mark::kind::left, run_digest::mark::kind::joined, run_digest::mark::kind::recovered,
                 run_digest::mark::kind::checkpoint}) {
    const auto n = std::count_if(d.marks.begin(), d.marks.end(), [k](const run_digest::mark& m) { return m.what == k; });
    o << "<line x1=\"" << W - R + 14 << "\" y1=\"" << y << "\" x2=\"" << W - R + 32 << "\" y2=\"" << y << "\" stroke=\"" << mark_color(k)
      << "\" stroke-width=\"2\"/>\n<text x=\"" << W - R + 36 << "\" y=\"" << y + 4 << "\">" << mark_name(k) << " (" << n << ")</text>\n";
    y += 18;
  }
  o << "</svg>\n";
  return o.str();
}

}  // namespace dtactor
