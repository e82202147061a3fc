// `dtactor report` on a synthetic journal: what the log book must say.
#include "monitoring/report.hpp"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "test_util.hpp"

namespace dtactor {
namespace {

// A cluster run: two nodes, a node lost at step 120 and recovered with 2
// steps lost, a replacement joining, evaluations, checkpoints,
// resources, and the finish.
const char* const k_journal = R"({"event":"coordinator_started","job_id":"job-abc","t":1000.0}
{"event":"job_started","model":"vit","parameters":205066,"max_steps":200,"global_batch_size":128,"t":1000.5}
{"event":"node_joined","node":"n0","node_rank":0,"t":1001.0}
{"event":"node_joined","node":"n1","node_rank":1,"t":1001.2}
{"event":"generation_started","generation":1,"world_size":2,"start_step":0,"nodes":["n0","n1"],"t":1001.5}
{"event":"step","step":50,"loss":1.5,"lr":0.001,"samples_per_s":3000,"world_size":2,"t":1010.0}
{"event":"step","step":100,"loss":0.9,"lr":0.002,"samples_per_s":3200,"world_size":2,"t":1020.0}
{"event":"eval","step":100,"accuracy":0.81,"val_loss":0.55,"duration_s":1.0,"examples":["a -> b"],"t":1021.0}
{"event":"checkpoint_saved","step":100,"path":"x/ckpt-100.dtc","bytes":2097152,"duration_s":0.02,"t":1021.5}
{"event":"checkpoint_refused","step":90,"rank":1,"node":"n1","generation":1,"reason":"checksum mismatch","fallback_step":80,"t":1025.0}
{"event":"node_lost","node":"n1","cause":"heartbeat_timeout","detected_after_s":3.1,"t":1030.0}
{"event":"recovery_done","generation":2,"world_size":1,"resumed_step":118,"lost_steps":2,"duration_s":4.5,"t":1034.5}
{"event":"generation_started","generation":2,"world_size":1,"start_step":118,"nodes":["n0"],"t":1034.4}
{"event":"step","step":150,"loss":0.7,"lr":0.0015,"samples_per_s":1800,"world_size":1,"t":1050.0}
{"event":"eval","step":150,"accuracy":0.85,"val_loss":0.50,"duration_s":1.0,"t":1051.0}
{"event":"resources","ranks":[{"rank":0,"node":"n0","rss_bytes":3.0e8,"peak_rss_bytes":3.2e8,"cpu_s":50,"elapsed_s":100},{"rank":1,"node":"n1","rss_bytes":2.9e8,"peak_rss_bytes":3.1e8,"cpu_s":20,"elapsed_s":40}]}
{"event":"step","step":200,"loss":0.6,"lr":0.0001,"samples_per_s":1850,"world_size":1,"t":1080.0}
{"event":"eval","step":200,"accuracy":0.84,"val_loss":0.52,"duration_s":1.0,"t":1081.0}
{"event":"resources","ranks":[{"rank":0,"node":"n0","rss_bytes":2.0e8,"peak_rss_bytes":3.0e8,"cpu_s":80,"elapsed_s":160}],"t":1081.5}
{"event":"job_finished","step":200,"params_digest":"abcd","accuracy":0.84,"t":1082.0}
)";

TEST(report, digest_reads_every_kind_of_event) {
  std::istringstream in(k_journal);
  auto d = digest_journal(in, "journal.jsonl");
  ASSERT_TRUE(d) << d.message();
  EXPECT_EQ(d->model, "vit");
  EXPECT_EQ(d->job_id, "job-abc");
  EXPECT_EQ(d->outcome, run_digest::outcome_kind::finished);
  EXPECT_EQ(d->last_step, 200);
  EXPECT_EQ(d->steps.size(), 4u);
  EXPECT_EQ(d->evals.size(), 3u);
  EXPECT_EQ(d->generations.size(), 2u);
  ASSERT_EQ(d->recoveries.size(), 1u);
  const auto& r = d->recoveries[0];
  EXPECT_EQ(r.node, "n1");
  EXPECT_EQ(r.cause, "heartbeat_timeout");
  EXPECT_DOUBLE_EQ(r.detected_after_s, 3.1);
  EXPECT_DOUBLE_EQ(r.duration_s, 4.5);
  EXPECT_EQ(r.lost_steps, 2);
  EXPECT_EQ(r.resumed_step, 118);
  EXPECT_EQ(r.world_size, 1);
  ASSERT_EQ(d->resources.size(), 2u);
  // The peak is the largest seen, the CPU time the latest.
  EXPECT_DOUBLE_EQ(d->resources["n0/0"].peak_rss_bytes, 3.2e8);
  EXPECT_DOUBLE_EQ(d->resources["n0/0"].cpu_s, 80);
  EXPECT_EQ(d->checkpoints_saved, 1);
  EXPECT_EQ(d->sessions.size(), 1u);
  EXPECT_DOUBLE_EQ(d->last_t - d->first_t, 82.0);
}

TEST(report, markdown_has_the_log_book) {
  std::istringstream in(k_journal);
  auto d = digest_journal(in, "journal.jsonl");
  ASSERT_TRUE(d) << d.message();
  const std::string md = render_report(d.value(), "runs/x", "[train]\nglobal_batch_size = 128\nmicro_batch_size = 32\n", "loss.svg");
  auto has = [&](const std::string& s) { return md.find(s) != std::string::npos; };
  EXPECT_TRUE(has("| outcome | **finished** |")) << md;
  EXPECT_TRUE(has("| steps | 200 of 200 |")) << md;
  // Final and best: accuracy is best at 150 (85%), final 84%; val_loss best at 150.
  EXPECT_TRUE(has("| accuracy | 84.00% | 85.00% | 150 |")) << md;
  EXPECT_TRUE(has("| val_loss (lower is better) | 0.5200 | 0.5000 | 150 |")) << md;
  EXPECT_TRUE(has("![training loss](loss.svg)"));
  // Resources: peak memory per rank and CPU utilization (80 s over 160 s).
  EXPECT_TRUE(has("| n0 | 0 | 305.2 MiB | 80 s | 50% of one core |")) << md;
  EXPECT_TRUE(has("| n1 | 1 | 295.6 MiB |")) << md;
  // The recovery: cause, node, detection, duration, lost steps.
  EXPECT_TRUE(has("| heartbeat_timeout | n1 | 3.10 s | 4.50 s | 2 | 118 | 1 |")) << md;
  // Largest batch: 128 global on the 1 rank left after the loss, capped by the micro-batch 32.
  EXPECT_TRUE(has("largest per-rank share was 128 (world size 1)")) << md;
  EXPECT_TRUE(has("forward pass ran was **32**")) << md;
  EXPECT_TRUE(has("```toml\n[train]")) << md;
  EXPECT_TRUE(has("| 2 | +34 s | 1 | 118 | n0 |")) << md;
  EXPECT_TRUE(has("checkpoint_refused: step 90 by rank 1 (checksum mismatch); fell back to step 80")) << md;
}

// The goodput section: a cluster run whose steps carry step_s, with a
// checkpoint stall, an evaluation and a recovery (monitoring/goodput.hpp).
TEST(report, the_goodput_section_says_where_the_time_went) {
  std::istringstream in(R"({"event":"coordinator_started","job_id":"j","t":1000.0}
{"event":"generation_started","generation":1,"world_size":2,"start_step":0,"t":1010.0}
{"event":"step","step":1,"generation":1,"world_size":2,"step_s":1.0,"t":1020.0}
{"event":"step","step":11,"generation":1,"world_size":2,"step_s":2.0,"t":1041.0}
{"event":"checkpoint_saved","step":11,"stall_s":2.0,"t":1043.0}
{"event":"eval","step":11,"duration_s":4.0,"t":1048.0}
{"event":"node_lost","node":"n1","t":1050.0}
{"event":"generation_started","generation":2,"world_size":1,"start_step":11,"t":1055.0}
{"event":"recovery_done","generation":2,"world_size":1,"resumed_step":11,"duration_s":6.0,"t":1061.0}
{"event":"step","step":12,"generation":2,"world_size":1,"step_s":1.0,"t":1061.0}
{"event":"job_finished","step":12,"t":1100.0}
)");
  auto d = digest_journal(in, "journal.jsonl");
  ASSERT_TRUE(d) << d.message();
  ASSERT_TRUE(d.value().goodput);
  // productive 1 + 20 + 1 = 22 of 100 s; start 20 - 1 = 19; recovery
  // (1055 - 1048, from the evaluation) + (6 - 1) = 12; checkpoint 2;
  // eval 4; other 41.
  EXPECT_DOUBLE_EQ(d.value().goodput->ratio, 0.22);
  const std::string md = render_report(d.value(), "runs/x", "", "");
  auto has = [&](const std::string& s) { return md.find(s) != std::string::npos; };
  EXPECT_TRUE(has("## Goodput\n\n**22.0%** of 100 s went into training steps")) << md;
  EXPECT_TRUE(has("| start (to the first step) | 19 s | 19.0% |")) << md;
  EXPECT_TRUE(has("| recovery (detection, new generation, first step) | 12 s | 12.0% |")) << md;
  EXPECT_TRUE(has("| checkpoint stalls | 2.00 s | 2.0% |")) << md;
  EXPECT_TRUE(has("| evaluation | 4.00 s | 4.0% |")) << md;
  EXPECT_TRUE(has("| other (reporting, the end, downtime between starts) | 41 s | 41.0% |")) << md;
}

TEST(report, svg_is_drawn_from_the_steps) {
  std::istringstream in(k_journal);
  auto d = digest_journal(in, "journal.jsonl");
  ASSERT_TRUE(d) << d.message();
  const std::string svg = render_loss_svg(d.value());
  EXPECT_EQ(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  const auto pl = svg.find("<polyline");
  ASSERT_NE(pl, std::string::npos);
  const auto pts = svg.find("points=\"", pl);
  const std::string points = svg.substr(pts + 8, svg.find('"', pts + 8) - pts - 8);
  EXPECT_EQ(std::count(points.begin(), points.end(), ','), 4) << points;  // one per step event
  EXPECT_NE(svg.find("gen 2, world 1"), std::string::npos);             // the membership change is marked
  EXPECT_NE(svg.find("<circle"), std::string::npos);                   // validation losses
}

TEST(report, the_timeline_marks_losses_joins_recoveries_and_checkpoints) {
  std::istringstream in(k_journal);
  auto d = digest_journal(in, "journal.jsonl");
  ASSERT_TRUE(d) << d.message();
  const std::string svg = render_timeline_svg(d.value());
  EXPECT_EQ(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  // Three panels (world size, samples/s, loss), one point per step event each
  // (the world size as steps: a corner before each change).
  std::size_t polylines = 0;
  for (auto at = svg.find("<polyline"); at != std::string::npos; at = svg.find("<polyline", at + 1)) ++polylines;
  EXPECT_EQ(polylines, 3u);
  EXPECT_NE(svg.find("<title>node lost: n1</title>"), std::string::npos) << svg;
  EXPECT_NE(svg.find("<title>node joined: n0</title>"), std::string::npos);
  EXPECT_NE(svg.find("<title>training again: world 1</title>"), std::string::npos);
  EXPECT_NE(svg.find("node lost (1)"), std::string::npos);
  EXPECT_NE(svg.find("checkpoint (1)"), std::string::npos);
  // The lost node's line sits at its time: 1030 of 1000..1082.
  const auto lost = svg.rfind("<line x1=\"", svg.find("<title>node lost"));
  const double x = std::stod(svg.substr(lost + 10));
  EXPECT_NEAR(x, 70 + 30.0 / 82 * (900 - 70 - 150), 1.0);
}

TEST(report, resumed_runs_count_each_start) {
  const std::string j = R"({"event":"job_started","model":"gpt","max_steps":10,"global_batch_size":8,"t":100}
{"event":"step","step":5,"loss":3.0,"lr":0.1,"samples_per_s":10,"world_size":1,"t":110}
{"event":"job_stopped","step":5,"reason":"signal 15","t":111}
{"event":"job_started","model":"gpt","max_steps":10,"global_batch_size":8,"t":200}
{"event":"checkpoint_restored","step":5,"source":"disk","path":"p","t":201}
{"event":"step","step":10,"loss":2.0,"lr":0.1,"samples_per_s":10,"world_size":1,"t":215}
)";
  std::istringstream in(j);
  auto d = digest_journal(in, "j");
  ASSERT_TRUE(d) << d.message();
  EXPECT_EQ(d->sessions.size(), 2u);
  EXPECT_EQ(d->outcome, run_digest::outcome_kind::interrupted);  // the second start has no end event
  const std::string md = render_report(d.value(), "r", "", "");
  EXPECT_NE(md.find("| training time | 26 s over 2 starts (resumed 1 time(s)) |"), std::string::npos) << md;
  EXPECT_NE(md.find("resumed from step 5 (disk)"), std::string::npos) << md;
  EXPECT_NE(md.find("None: no node was lost"), std::string::npos);
}

// A coordinator that resumed (checkpoint_found journaled before its
// coordinator_started), a node declared lost and rejoining several times
// (lost twice before the first recovery was done), a step committed twice:
// one start, two recoveries, as the journal holds.
TEST(report, a_flapping_node_counts_the_journals_starts_and_recoveries) {
  const std::string j = R"({"event":"checkpoint_found","step":40,"path":"s/ckpt-40","t":99}
{"event":"coordinator_started","job_id":"job-f","t":100}
{"event":"generation_started","generation":1,"world_size":2,"start_step":40,"nodes":["n0","n1"],"t":101}
{"event":"step","step":41,"loss":2.0,"lr":0.1,"samples_per_s":10,"world_size":2,"t":102}
{"event":"node_lost","node":"n1","cause":"heartbeat_timeout","detected_after_s":1.0,"t":103}
{"event":"node_joined","node":"n1","node_rank":1,"t":104}
{"event":"node_lost","node":"n1","cause":"heartbeat_timeout","detected_after_s":1.0,"t":105}
{"event":"recovery_done","generation":2,"world_size":1,"resumed_step":41,"lost_steps":0,"duration_s":2.0,"t":107}
{"event":"step","step":42,"loss":1.9,"lr":0.1,"samples_per_s":10,"world_size":1,"t":108}
{"event":"step","step":42,"loss":1.9,"lr":0.1,"samples_per_s":10,"world_size":1,"t":108.5}
{"event":"node_joined","node":"n1","node_rank":1,"t":109}
{"event":"node_lost","node":"n1","cause":"heartbeat_timeout","detected_after_s":1.0,"t":110}
{"event":"node_joined","node":"n1","node_rank":1,"t":111}
{"event":"node_left","node":"n1","reason":"preempted","t":112}
{"event":"recovery_done","generation":3,"world_size":1,"resumed_step":42,"lost_steps":0,"duration_s":1.5,"t":113}
{"event":"job_finished","step":42,"t":114}
)";
  std::istringstream in(j);
  auto d = digest_journal(in, "j");
  ASSERT_TRUE(d) << d.message();
  EXPECT_EQ(d->sessions.size(), 1u);
  EXPECT_EQ(d->recoveries_done, 2);
  // Each loss and leave is a row, each closed by the recovery after it.
  ASSERT_EQ(d->recoveries.size(), 4u);
  for (const auto& r : d->recoveries) EXPECT_GE(r.duration_s, 0) << r.node << " at " << r.t;
  const std::string md = render_report(d.value(), "r", "", "");
  EXPECT_EQ(md.find(" starts (resumed"), std::string::npos) << md;
  EXPECT_NE(md.find("| training time | 15 s |"), std::string::npos) << md;
  EXPECT_NE(md.find("| recoveries | 2 |"), std::string::npos) << md;
  EXPECT_NE(md.find("| nodes lost or left | 4 |"), std::string::npos) << md;
}

TEST(report, a_corrupt_line_is_one_clear_error) {
  std::istringstream in(std::string("{\"event\":\"job_started\",\"t\":1}\n{\"event\":\"step\",\"st\n"));
  auto d = digest_journal(in, "runs/x/journal.jsonl");
  ASSERT_FALSE(d);
  EXPECT_EQ(d.message().find("runs/x/journal.jsonl line 2 is not a journal event"), 0u) << d.message();
  std::istringstream empty("");
  auto e = digest_journal(empty, "j");
  ASSERT_FALSE(e);
  EXPECT_NE(e.message().find("no events"), std::string::npos);
  std::istringstream not_object("[1,2]\n");
  EXPECT_FALSE(digest_journal(not_object, "j"));
  // A known event read through the schema: a field of the wrong type is named.
  std::istringstream bad_field("{\"event\":\"job_started\",\"t\":1}\n{\"event\":\"node_lost\",\"node\":\"n1\",\"cause\":\"boredom\"}\n");
  auto f = digest_journal(bad_field, "j");
  ASSERT_FALSE(f);
  EXPECT_NE(f.message().find("j line 2 is not a journal event (journal event \"node_lost\": field \"cause\" has the unknown value \"boredom\")"),
            std::string::npos)
      << f.message();
}

TEST(report, a_newer_writers_event_is_passed_over) {
  std::istringstream in(std::string(k_journal) + "{\"event\":\"from_the_future\",\"x\":1,\"t\":1090.0}\n");
  auto d = digest_journal(in, "j");
  ASSERT_TRUE(d) << d.message();
  EXPECT_EQ(d->outcome, run_digest::outcome_kind::finished);
}

TEST(report, write_report_files_and_errors) {
  dtactor::testing::temp_dir dir;
  auto missing = write_report(dir.path() + "/nope");
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.message().find("is not a directory"), std::string::npos) << missing.message();
  auto no_journal = write_report(dir.path());
  ASSERT_FALSE(no_journal);
  EXPECT_NE(no_journal.message().find("no journal"), std::string::npos) << no_journal.message();

  std::ofstream(dir.path() + "/journal.jsonl") << k_journal;
  std::ofstream(dir.path() + "/config.toml") << "[model]\nname = \"vit\"\n";
  auto r = write_report(dir.path());
  ASSERT_TRUE(r) << r.message();
  EXPECT_EQ(r->markdown, dir.path() + "/report.md");
  EXPECT_EQ(r->svg, dir.path() + "/loss.svg");
  EXPECT_TRUE(std::filesystem::exists(r->timeline)) << r->timeline;
  EXPECT_TRUE(std::filesystem::file_size(r->markdown) > 500);
  EXPECT_TRUE(std::filesystem::file_size(r->svg) > 500);

  auto elsewhere = write_report(dir.path(), dir.path() + "/out/book.md");
  ASSERT_FALSE(elsewhere);  // the folder of --out must exist
  std::filesystem::create_directories(dir.path() + "/out");
  auto out = write_report(dir.path(), dir.path() + "/out/book.md");
  ASSERT_TRUE(out) << out.message();
  EXPECT_EQ(out->svg, dir.path() + "/out/loss.svg");
}

}  // namespace
}  // namespace dtactor
