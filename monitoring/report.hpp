#pragma once
// `dtactor report RUN_DIR`: a Markdown log book of a run, built from the run
// directory alone (journal.jsonl, config.toml), plus the loss curve as an SVG
// drawn here. Works for `dtactor train` runs and cluster runs, finished,
// failed or still running, and for journals that span several starts of the
// same run directory (resumes).
#include <cstdint>
#include <istream>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "job/journal_events.hpp"
#include "dtactor/result.hpp"

namespace dtactor {

struct run_digest {
  struct point {
    int64_t step = 0;
    double t = 0;
    double loss = 0;
    double samples_per_s = 0;
    int world_size = 0;
  };
  struct eval_point {
    int64_t step = 0;
    double t = 0;
    std::map<std::string, double> metrics;
    std::vector<std::string> examples;
  };
  struct generation {
    uint64_t number = 0;
    double t = 0;
    int world_size = 0;
    int64_t start_step = 0;
    std::vector<std::string> nodes;
  };
  struct recovery {
    double t = 0;               // when the loss / leave was noticed
    std::string cause;          // node_lost's cause, node_left, ...
    std::string node;
    double detected_after_s = -1;  // from last sign of life; -1 unknown
    double duration_s = -1;        // to training running again; -1 unknown / not finished
    int64_t lost_steps = -1;  // completed steps the recovery did not resume from
    int64_t resumed_step = -1;
    uint64_t generation = 0;
    int world_size = 0;
  };
  struct rank_resources {
    std::string node;
    int rank = 0;
    double peak_rss_bytes = 0;
    double cpu_s = 0;
    double elapsed_s = 0;
    std::optional<ev::data_reading> data;  // sharded data: the latest reading of this rank (docs/data.md)
  };
  struct session {  // one start of a process writing the journal
    enum class kind { train, cluster, unknown };  // `dtactor train`, a coordinator, a journal with no start event
    double start = 0, end = 0;
    kind what = kind::unknown;
  };

  // What the timeline marks: a node lost or leaving, a node joining, training
  // running again after a change, a checkpoint committed.
  struct mark {
    enum class kind { lost, left, joined, recovered, checkpoint };
    double t = 0;
    kind what = kind::checkpoint;
    std::string label;
  };
  std::vector<mark> marks;

  std::string model;
  std::string job_id;
  int64_t parameters = 0;
  int64_t max_steps = 0;
  int64_t global_batch_size = 0;
  // How the last session ended: interrupted (no end event), or running (a
  // dtactor holds the run directory's lock: write_report's reading).
  enum class outcome_kind { unknown, finished, failed, stopped, interrupted, running };
  outcome_kind outcome = outcome_kind::unknown;
  std::string outcome_detail;
  int64_t last_step = 0;
  double first_t = 0, last_t = 0;
  // One per start event (coordinator_started, or job_started outside a
  // coordinator's session): the summary's "starts".
  std::vector<session> sessions;
  std::vector<point> steps;
  std::vector<eval_point> evals;
  std::vector<generation> generations;
  std::vector<recovery> recoveries;  // a row per node lost or left, and per recovery_done with no loss before it
  int recoveries_done = 0;           // recovery_done events: the summary's "recoveries"
  std::vector<std::string> nodes_joined;
  std::map<std::string, rank_resources> resources;  // by "node/rank"
  int checkpoints_saved = 0;
  int64_t last_checkpoint_step = -1;
  double last_checkpoint_bytes = 0;
  double checkpoint_seconds_total = 0;
  std::vector<std::string> checkpoint_problems;  // skipped / failed, with reasons
  std::vector<std::pair<int64_t, std::string>> restores;  // step, source
  std::vector<std::string> failures;  // rank_failed, job_failed, ...
  // `dtactor tune-batch` (batch_size_trial / batch_size_found events).
  struct batch_trial {
    int64_t micro_batch = 0;
    bool fits = false;
    double peak_rss_bytes = 0;
    double samples_per_s = 0;
    std::string reason;
  };
  std::vector<batch_trial> batch_trials;  // of the last search
  int64_t batch_found = -1;               // its result (0: nothing fit; -1: no search)
  double batch_budget_bytes = 0;
  bool batch_limited_by_up_to = false;
  // Productive time over wall time since the first start (monitoring/goodput.hpp); none without a timed event.
  std::optional<ev::goodput> goodput;
  int events = 0;
};

// Reads a journal (one JSON object per line). A line that is not a JSON
// object is an error naming the line; unknown events are ignored.
result<run_digest> digest_journal(std::istream& in, const std::string& name);

// The outcome as the log book writes it: "finished", "interrupted", ...
std::string_view to_string(run_digest::outcome_kind o);

// Lower is better for losses and perplexity; higher for everything else.
bool report_lower_is_better(const std::string& metric);

// The loss curve (step on x, loss on y) with generation changes and
// recoveries marked; a self-contained SVG document.
std::string render_loss_svg(const run_digest& d);

// The log book; `svg_name` is the loss curve's path relative to the Markdown
// file ("" = no curve), `config_toml` the run's effective config ("" = none).
std::string render_report(const run_digest& d, const std::string& run_dir, const std::string& config_toml, const std::string& svg_name);

struct report_files {
  std::string markdown;
  std::string svg;
  std::string timeline;  // timeline.svg beside it
};

// The run against wall time (SVG): world size, samples/s and loss, with
// nodes lost, leaving and joining, recoveries and checkpoints marked
// (monitoring/timeline_svg.cpp).
std::string render_timeline_svg(const run_digest& d);

// What the report's drawings share.
namespace report_svg {
std::string escape_xml(const std::string& s);
// 1, 2 or 5 times a power of ten, giving about `n` intervals over [lo, hi].
double nice_step(double lo, double hi, int n);
std::string tick_label(double v, double step);
}  // namespace report_svg

// Writes the log book to `out` (default RUN_DIR/report.md) and the loss curve
// next to it (loss.svg). Errors are one line: a missing run directory or
// journal, a line of the journal that does not parse, an unwritable output.
result<report_files> write_report(const std::string& run_dir, const std::string& out = "");

}  // namespace dtactor
