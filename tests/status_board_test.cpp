// The status page's data (monitoring/status_board.hpp) from the events a
// coordinator emits, and the chaos monkey of `dtactor local --chaos`
// (app/chaos.hpp) over a scripted journal: no processes, no clock.
#include "monitoring/status_board.hpp"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "app/chaos.hpp"

namespace dtactor {
namespace {

using nlohmann::json;

ev::members_view view(std::vector<std::pair<std::string, bool>> nodes, double age = 0.05) {
  ev::members_view v;
  v.generation = 1;
  int rank = 0;
  for (auto& [id, in_plan] : nodes) {
    ev::member_seen m;
    m.node = id;
    m.host = "10.0.0." + std::to_string(++rank);
    m.node_rank = rank - 1;
    m.nproc = 1;
    m.ready_ranks = 1;
    m.in_plan = in_plan;
    m.heartbeat_age_s = age;
    v.members.push_back(m);
  }
  return v;
}

const json* member(const json& j, const std::string& id) {
  for (const auto& m : j["members"])
    if (m["node"] == id) return &m;
  return nullptr;
}

TEST(status_board, follows_a_loss_and_a_replacement) {
  status_board b(status_options{"job-1", 100, false});
  b.on(ev::node_joined{"a", "p1", "10.0.0.1", 0}, 1000);
  b.on(ev::node_joined{"b", "p2", "10.0.0.2", 0}, 1000);
  b.on(view({{"a", false}, {"b", false}}), 1000.5);
  auto j = json::parse(b.json(1001));
  EXPECT_EQ(j["job"]["state"], "starting");
  EXPECT_EQ((*member(j, "a"))["state"], "joining");

  b.on(ev::generation_started{1, 2, ev::plan_cause::start, false, 0, -1, {"a", "b"}}, 1002);
  ev::step_completed s;
  s.step = 10, s.world_size = 2, s.samples_per_s = 3000, s.loss = 0.5;
  b.on(s, 1003);
  ev::rank_usage u;
  u.global_rank = 1, u.node = "b", u.step = 10;
  b.on(u, 1003);
  b.on(view({{"a", true}, {"b", true}}, 0.08), 1003.5);
  j = json::parse(b.json(1003.6));
  EXPECT_EQ(j["job"]["state"], "training");
  EXPECT_EQ(j["job"]["world_size"], 2);
  EXPECT_EQ((*member(j, "b"))["state"], "training");
  EXPECT_NEAR((*member(j, "b"))["heartbeat_age_s"].get<double>(), 0.18, 1e-6);
  EXPECT_EQ((*member(j, "b"))["ranks"][0]["step"], 10);

  b.on(ev::node_lost{"b", ev::loss_cause::heartbeat_timeout, 0.31}, 1004);
  j = json::parse(b.json(1004));
  EXPECT_EQ(j["job"]["state"], "recovering");
  EXPECT_EQ((*member(j, "b"))["state"], "lost");
  EXPECT_EQ((*member(j, "b"))["heartbeat_age_s"], -1.0);

  b.on(ev::generation_started{2, 1, ev::plan_cause::node_lost, false, 10, 0, {"a"}}, 1004.1);
  ev::recovery_done r;
  r.generation = 2, r.world_size = 1, r.cause = ev::plan_cause::node_lost, r.resumed_step = 10, r.duration_s = 0.12;
  b.on(r, 1004.3);
  b.on(view({{"a", true}}), 1004.5);
  j = json::parse(b.json(1005));
  EXPECT_EQ(j["job"]["state"], "training");
  EXPECT_EQ(j["job"]["world_size"], 1);
  EXPECT_EQ((*member(j, "b"))["state"], "lost") << "a lost node stays listed as lost";
  ASSERT_EQ(j["recoveries"]["last"].size(), 1u);
  EXPECT_EQ(j["recoveries"]["last"][0]["node"], "b");
  EXPECT_DOUBLE_EQ(j["recoveries"]["last"][0]["detected_s"].get<double>(), 0.31);
  EXPECT_EQ(j["recoveries"]["last"][0]["cause"], "node_lost");

  // The replacement (same id, a new process) joins and trains.
  b.on(ev::node_joined{"b", "p3", "10.0.0.3", 0}, 1006);
  b.on(view({{"a", true}, {"b", false}}), 1006.2);
  EXPECT_EQ((*member(json::parse(b.json(1006.3)), "b"))["state"], "joining");
  b.on(ev::generation_started{3, 2, ev::plan_cause::node_joined, true, 20, 0, {"a", "b"}}, 1007);
  j = json::parse(b.json(1007));
  EXPECT_EQ((*member(j, "b"))["state"], "training");
  EXPECT_EQ(j["job"]["world_size"], 2);
  // Lost nodes are forgotten after a while.
  b.on(ev::node_lost{"a", ev::loss_cause::heartbeat_timeout, 1.0}, 1008);
  b.on(view({{"b", true}}), 2000);
  EXPECT_EQ(member(json::parse(b.json(2000)), "a"), nullptr);
}

TEST(status_board, shows_a_standby_node_as_standby_until_it_is_planned_in) {
  status_board b(status_options{"job-1", 100, false});
  for (const char* id : {"a", "b", "s"}) b.on(ev::node_joined{id, "p", "10.0.0.9", 0}, 1000);
  b.on(ev::generation_started{1, 2, ev::plan_cause::start, false, 0, -1, {"a", "b"}}, 1001);
  auto v = view({{"a", true}, {"b", true}, {"s", false}});
  v.members[2].standby = true;
  b.on(v, 1001.5);
  auto j = json::parse(b.json(1002));
  EXPECT_EQ((*member(j, "a"))["state"], "training");
  EXPECT_EQ((*member(j, "s"))["state"], "standby");
  EXPECT_GE((*member(j, "s"))["heartbeat_age_s"].get<double>(), 0.0);

  // a is lost; the plan that drops it names s (promoted).
  b.on(ev::node_lost{"a", ev::loss_cause::connection_closed, 0.01}, 1003);
  b.on(ev::generation_started{2, 2, ev::plan_cause::node_lost, false, 10, 0, {"b", "s"}}, 1003.1);
  EXPECT_EQ((*member(json::parse(b.json(1003.2)), "s"))["state"], "training");
  b.on(view({{"b", true}, {"s", true}}), 1003.5);
  j = json::parse(b.json(1004));
  EXPECT_EQ((*member(j, "s"))["state"], "training");
  EXPECT_EQ((*member(j, "a"))["state"], "lost");
}

TEST(status_board, prints_what_peers_sent_as_bounded_text_and_hides_it_when_keyed) {
  std::string hostile = "\x1b[2J\nfinished at step 999999";
  hostile += '\0';
  hostile += std::string(10000, 'x');
  status_board open(status_options{"job", 10, false});
  open.on(ev::job_error{"n1", hostile}, 10);
  ev::checkpoint_saved c;
  c.step = 5, c.path = "/data/ckpt/step-5.manifest", c.bytes = 1000;
  open.on(c, 11);
  open.on(view({{"n1", true}}), 12);
  const std::string text = open.json(12);
  EXPECT_EQ(text.find('\x1b'), std::string::npos);
  EXPECT_EQ(text.find('\n'), text.size() - 1) << "one line of JSON";
  const auto j = json::parse(text);
  const std::string shown = j["errors"][0]["text"];
  EXPECT_LT(shown.size(), 400u);
  EXPECT_NE(shown.find("bytes)"), std::string::npos);
  EXPECT_EQ(j["checkpoints"][0]["location"], "/data/ckpt/step-5.manifest");

  ev::checkpoint_refused refused;
  refused.step = 20, refused.rank = 1, refused.reason = "checksum mismatch", refused.fallback_step = 10;
  open.on(refused, 13);
  const auto last = json::parse(open.json(13))["errors"].back()["text"].get<std::string>();
  EXPECT_EQ(last, "checkpoint at step 20 refused by rank 1: checksum mismatch; training goes on from step 10");

  status_board keyed(status_options{"job", 10, true});
  keyed.on(ev::job_error{"n1", hostile}, 10);
  keyed.on(c, 11);
  keyed.on(view({{"n1", true}}), 12);
  const auto k = json::parse(keyed.json(12));
  EXPECT_EQ(k["checkpoints"][0]["location"], "");
  EXPECT_EQ(k["members"][0]["host"], "");
  EXPECT_EQ(k["errors"][0]["text"].get<std::string>().find("xxx"), std::string::npos);
  EXPECT_EQ(k["checkpoints"][0]["step"], 5);
}

TEST(status_board, the_chart_keeps_the_last_minutes) {
  status_board b(status_options{"job", 0, false, 60});
  for (int i = 0; i < 200; ++i) {
    ev::step_completed s;
    s.step = i, s.world_size = 2, s.samples_per_s = 100 + i;
    b.on(s, 1000 + i);
  }
  const auto j = json::parse(b.json(1200));
  ASSERT_FALSE(j["series"].empty());
  EXPECT_GE(j["series"].front()["t"].get<double>(), -61);
  EXPECT_LE(j["series"].size(), 31u);
  EXPECT_EQ(j["series"].back()["step"], 198);
}

TEST(status_board, the_page_is_self_contained) {
  const std::string& p = status_board::page();
  EXPECT_NE(p.find("status.json"), std::string::npos);
  for (const char* outside : {"src=", "href=", "<link", "url(", "@import", "https://"}) EXPECT_EQ(p.find(outside), std::string::npos) << "no outside assets: " << outside;
  EXPECT_EQ(p.find("innerHTML"), std::string::npos) << "values are set as text only";
}

// ---- dtactor local --chaos ----

struct fake_cluster {
  std::vector<std::string> alive{"local-0", "local-1", "local-2"};
  std::vector<std::string> killed, lines;
  int next = 3;
  chaos_monkey::hooks hooks() {
    chaos_monkey::hooks h;
    h.alive = [this] { return alive; };
    h.kill = [this](const std::string& id) {
      killed.push_back(id);
      alive.erase(std::find(alive.begin(), alive.end(), id));
    };
    h.start = [this]() -> std::optional<std::string> {
      alive.push_back("local-" + std::to_string(next++));
      return alive.back();
    };
    h.say = [this](const std::string& l) { lines.push_back(l); };
    return h;
  }
};

ev::step_completed step_at(int64_t step, int32_t world) {
  ev::step_completed s;
  s.step = step, s.world_size = world;
  return s;
}

TEST(chaos_monkey, kills_measures_and_replaces) {
  fake_cluster c;
  chaos_options o;
  o.every_s = 10;
  o.seed = 7;
  chaos_monkey m(o, c.hooks());
  m.tick(100);
  EXPECT_TRUE(c.killed.empty()) << "nothing before training starts";
  m.on(step_at(1, 3), 100);
  m.tick(105);
  EXPECT_TRUE(c.killed.empty());
  m.tick(110.5);
  ASSERT_EQ(c.killed.size(), 1u);
  const std::string victim = c.killed[0];
  m.tick(111);
  EXPECT_EQ(c.killed.size(), 1u) << "one fault at a time";
  m.on(ev::node_lost{victim, ev::loss_cause::heartbeat_timeout, 0.3}, 110.8);
  ev::recovery_done r;
  r.world_size = 2, r.lost_steps = 0, r.cause = ev::plan_cause::node_lost;
  m.on(r, 111.0);
  ASSERT_EQ(c.alive.size(), 3u) << "a replacement was started";
  m.on(step_at(50, 2), 111.5);
  m.tick(125);
  EXPECT_EQ(c.killed.size(), 1u) << "no kill while the replacement joins";
  m.on(step_at(60, 3), 112.6);
  const auto& rec = m.recoveries();
  ASSERT_EQ(rec.size(), 1u);
  EXPECT_NEAR(rec[0].detected_s, 0.3, 1e-9);
  EXPECT_NEAR(rec[0].first_step_s, 0.5, 1e-9);
  EXPECT_NEAR(rec[0].joined_s, 1.6, 1e-9);
  EXPECT_EQ(rec[0].world, 2);
  EXPECT_NE(m.summary().find("1 node(s) killed"), std::string::npos) << m.summary();
  EXPECT_NE(m.summary().find("detected in 0.30 s"), std::string::npos) << m.summary();
  m.tick(122.7);
  EXPECT_EQ(c.killed.size(), 2u) << "the next kill comes every_s after the join";
  m.on(ev::job_finished{}, 123);
}

TEST(chaos_monkey, never_kills_the_last_node_and_stops_with_the_job) {
  fake_cluster c;
  c.alive = {"local-0"};
  chaos_options o;
  o.every_s = 1;
  chaos_monkey m(o, c.hooks());
  m.on(step_at(1, 1), 0);
  m.tick(5);
  EXPECT_TRUE(c.killed.empty());
  c.alive.push_back("local-1");
  m.on(ev::job_finished{}, 6);
  m.tick(50);
  EXPECT_TRUE(c.killed.empty());
  EXPECT_EQ(m.summary(), "");
}

TEST(chaos_monkey, reads_whole_journal_lines_only) {
  const std::string path = ::testing::TempDir() + "/chaos_journal.jsonl";
  std::FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs("{\"t\":1,\"event\":\"node_lost\",\"node\":\"a\",\"cause\":\"heartbeat_timeout\",\"detected_after_s\":0.2}\n{\"t\":2,\"ev", f);
  std::fflush(f);
  journal_tail tail(path);
  auto first = tail.read_new();
  ASSERT_EQ(first.size(), 1u);
  EXPECT_TRUE(std::holds_alternative<ev::node_lost>(first[0].event));
  std::fputs("ent\":\"node_left\",\"node\":\"b\",\"reason\":\"x\"}\n", f);
  std::fclose(f);
  auto second = tail.read_new();
  ASSERT_EQ(second.size(), 1u);
  EXPECT_TRUE(std::holds_alternative<ev::node_left>(second[0].event));
  EXPECT_DOUBLE_EQ(second[0].t, 2);
}

}  // namespace
}  // namespace dtactor
