// The status page's HTML (monitoring/status_board.hpp): no outside assets;
// the script polls status.json once a second and writes every value with
// textContent, never as markup, so nothing a peer sent can become HTML.
#include "monitoring/status_board.hpp"

namespace dtactor {

namespace {

// The document head: title and the whole style sheet (no outside assets).
constexpr const char* k_head = R"HTML(<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>dtactor</title>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:0;background:#f4f5f7;color:#1d2330}
header{background:#1d2330;color:#fff;padding:10px 20px;display:flex;gap:16px;align-items:baseline}
header h1{font-size:18px;margin:0}
#conn{margin-left:auto;font-size:12px;opacity:.8}
main{padding:16px 20px;display:grid;grid-template-columns:repeat(auto-fit,minmax(420px,1fr));gap:16px}
section{background:#fff;border-radius:6px;padding:12px 16px;box-shadow:0 1px 2px rgba(0,0,0,.08)}
section.wide{grid-column:1/-1}
h2{font-size:13px;text-transform:uppercase;letter-spacing:.05em;color:#5b6475;margin:0 0 8px}
.kv{display:grid;grid-template-columns:repeat(4,1fr);gap:8px}
.kv div span{display:block;font-size:11px;color:#5b6475}
.kv div b{font-size:20px;font-weight:600}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;font-size:12px;font-weight:600;background:#e4e7ec}
.training,.finished{background:#d3f2dc;color:#11612b}.recovering,.joining,.draining,.stopping,.waiting{background:#fdf0c8;color:#7a5300}
.lost,.failed,.quarantined{background:#fbd5d5;color:#8a1616}
.standby{background:#dde7fb;color:#1f4a9c}
table{width:100%;border-collapse:collapse;font-size:13px}
th{text-align:left;color:#5b6475;font-weight:500;border-bottom:1px solid #e4e7ec;padding:4px 6px}
td{border-bottom:1px solid #f0f1f4;padding:4px 6px;font-variant-numeric:tabular-nums}
.bar{height:6px;background:#e4e7ec;border-radius:3px;margin-top:6px}.bar i{display:block;height:6px;background:#3b6fd8;border-radius:3px}
svg{width:100%;height:160px}
.empty{color:#8a92a3;font-style:italic}
ul{margin:0;padding-left:18px;font-family:ui-monospace,monospace;font-size:12px}
</style></head>
)HTML";

// The page's frame: the header and one section per part of status.json, each filled by the script.
constexpr const char* k_body = R"HTML(<body>
<header><h1>dtactor</h1><span id="job"></span><span id="state" class="badge"></span><span id="conn"></span></header>
<main>
<section class="wide"><h2>Job</h2>
<div class="kv">
<div><span>step</span><b id="step">-</b></div>
<div><span>samples/s</span><b id="sps">-</b></div>
<div><span>world size</span><b id="world">-</b></div>
<div><span>generation</span><b id="gen">-</b></div>
<div><span>loss</span><b id="loss">-</b></div>
<div><span>evaluation</span><b id="eval">-</b></div>
<div><span>recoveries</span><b id="nrec">-</b></div>
<div><span>steps lost</span><b id="nlost">-</b></div>
</div>
<div class="bar"><i id="progress" style="width:0"></i></div>
</section>
<section class="wide"><h2>Samples/s (blue) and world size (grey), last minutes <span id="scale"></span></h2>
<svg id="chart" viewBox="0 0 600 160" preserveAspectRatio="none"></svg></section>
<section class="wide"><h2>Members</h2>
<table><thead><tr><th>node</th><th>host</th><th>ranks</th><th>state</th><th>heartbeat age</th><th>last step by rank</th></tr></thead>
<tbody id="members"></tbody></table></section>
<section><h2>Recoveries</h2>
<table><thead><tr><th>when</th><th>cause</th><th>node</th><th>detected</th><th>duration</th><th>world</th><th>steps lost</th></tr></thead>
<tbody id="recoveries"></tbody></table></section>
<section><h2>Checkpoints</h2>
<table><thead><tr><th>when</th><th>step</th><th>size</th><th>commit</th><th>where</th></tr></thead>
<tbody id="checkpoints"></tbody></table></section>
<section class="wide"><h2>Last errors</h2><ul id="errors"></ul></section>
</main>
)HTML";

// The script's start and its helpers: formatting, table rows, the chart. Every value goes in through textContent.
constexpr const char* k_script_helpers = R"JS(<script>
"use strict";
const $ = id => document.getElementById(id);
function text(el, v) { el.textContent = v; return el; }
function ago(s) { s = Math.max(0, s); return s < 90 ? s.toFixed(0) + " s ago" : s < 5400 ? (s / 60).toFixed(0) + " min ago" : (s / 3600).toFixed(1) + " h ago"; }
function bytes(b) { const u = ["B", "KB", "MB", "GB", "TB"]; let i = 0; while (b >= 1000 && i < 4) { b /= 1000; i++; } return b.toFixed(i ? 1 : 0) + " " + u[i]; }
function row(cells, cls) {
  const tr = document.createElement("tr");
  cells.forEach((c, i) => { const td = document.createElement("td"); if (cls && cls[i]) { const s = document.createElement("span"); s.className = "badge " + cls[i]; text(s, c); td.appendChild(s); } else text(td, c); tr.appendChild(td); });
  return tr;
}
function fill(id, rows, empty, cols) {
  const body = $(id); body.replaceChildren();
  if (!rows.length) { const tr = document.createElement("tr"); const td = document.createElement("td"); td.colSpan = cols; td.className = "empty"; text(td, empty); tr.appendChild(td); body.appendChild(tr); }
  rows.forEach(r => body.appendChild(r));
}
function chart(series) {
  const svg = $("chart"); svg.replaceChildren();
  if (series.length < 2) return;
  const t0 = series[0].t, t1 = series[series.length - 1].t || 1e-9, span = Math.max(1e-9, t1 - t0);
  const maxS = Math.max(1, ...series.map(p => p.samples_per_s)), maxW = Math.max(1, ...series.map(p => p.world));
  const line = (f, max, color, width) => {
    const pl = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    pl.setAttribute("points", series.map(p => ((p.t - t0) / span * 600).toFixed(1) + "," + (155 - f(p) / max * 145).toFixed(1)).join(" "));
    pl.setAttribute("fill", "none"); pl.setAttribute("stroke", color); pl.setAttribute("stroke-width", width);
    svg.appendChild(pl);
  };
  line(p => p.world, maxW * 1.1, "#9aa3b5", 2);
  line(p => p.samples_per_s, maxS * 1.1, "#3b6fd8", 1.5);
  text($("scale"), "(top: " + (maxS * 1.1).toFixed(0) + " samples/s, world " + (maxW * 1.1).toFixed(1) + ")");
}
)JS";

// render() writes one status.json into the page; poll() fetches it once a second. Closes the script and the document.
constexpr const char* k_script_render = R"JS(function render(s) {
  const j = s.job;
  text($("job"), "job " + j.id);
  const st = $("state"); text(st, j.state); st.className = "badge " + j.state.split(" ")[0];
  text($("step"), j.step + (j.max_steps ? " / " + j.max_steps : ""));
  $("progress").style.width = (j.max_steps ? Math.min(100, 100 * j.step / j.max_steps) : 0) + "%";
  text($("sps"), j.samples_per_s.toFixed(0)); text($("world"), j.world_size); text($("gen"), j.generation);
  text($("loss"), j.loss.toFixed(4));
  const m = Object.entries(s.eval.metrics);
  text($("eval"), m.length ? m.map(([k, v]) => k + " " + v.toFixed(4)).join(", ") : "-");
  text($("nrec"), s.recoveries.total); text($("nlost"), s.recoveries.lost_steps);
  chart(s.series);
  fill("members", s.members.map(n => row([n.node, n.host || "-", n.ready_ranks + " / " + n.nproc, n.state,
    n.heartbeat_age_s < 0 ? "-" : (n.heartbeat_age_s * 1000).toFixed(0) + " ms",
    n.ranks.map(r => "r" + r.rank + ": " + r.step).join("  ") || "-"], [null, null, null, n.state])), "no nodes yet", 6);
  fill("recoveries", s.recoveries.last.slice().reverse().map(r => row([ago(r.ago_s), r.cause, r.node || "-",
    r.detected_s < 0 ? "-" : r.detected_s.toFixed(2) + " s", r.duration_s.toFixed(2) + " s", r.world, r.lost_steps])), "none", 7);
  fill("checkpoints", s.checkpoints.slice().reverse().map(c => row([ago(c.ago_s), c.step, bytes(c.bytes), c.seconds.toFixed(2) + " s", c.location || "-"])), "none yet", 5);
  const ul = $("errors"); ul.replaceChildren();
  if (!s.errors.length) { const li = document.createElement("li"); li.className = "empty"; text(li, "none"); ul.appendChild(li); }
  s.errors.slice().reverse().forEach(e => { const li = document.createElement("li"); text(li, ago(e.ago_s) + "  " + e.text); ul.appendChild(li); });
}
async function poll() {
  try {
    const r = await fetch("status.json", {cache: "no-store"});
    render(await r.json());
    text($("conn"), "updated " + new Date().toLocaleTimeString());
  } catch (e) { text($("conn"), "coordinator unreachable"); }
  setTimeout(poll, 1000);
}
poll();
</script>
</body></html>
)JS";

}  // namespace

const std::string& status_board::page() {
  static const std::string html = std::string(k_head) + k_body + k_script_helpers + k_script_render;
  return html;
}

}  // namespace dtactor
