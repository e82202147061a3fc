// Heartbeat relays (actors/relays.hpp): the pure pieces, and a coordinator
// with five node agents in memory under CAF's test coordinator, where
// members beat their group's relay and losses are still found within the
// heartbeat timeout of a node's last beat.
#include "actors/relays.hpp"

#include <gtest/gtest.h>

#include <map>
#include <set>
#include <vector>

#include "actor_test_util.hpp"
#include "actors/membership_actor.hpp"
#include "actors/node_agent.hpp"

using namespace dtactor;
using namespace dtactor::test_support;
using namespace std::chrono_literals;

namespace {

relay_directory::still_member any_member() {
  return [](const node_id&, int32_t) { return true; };
}

}  // namespace

TEST(relay_directory, names_the_lowest_ranked_member_of_a_group_that_listens_once_the_job_is_large_enough) {
  relay_directory d({3, 4});
  d.set(node_id{"a"}, 0, "");  // cannot relay
  d.set(node_id{"b"}, 1, "tcp://b:1");
  d.set(node_id{"c"}, 2, "tcp://c:1");
  d.set(node_id{"d"}, 3, "tcp://d:1");
  d.update(3);
  EXPECT_FALSE(d.relay_for(2, any_member()));  // below relay_from_nodes
  EXPECT_EQ(d.direct_beaters(3), 3u);
  d.update(4);
  ASSERT_TRUE(d.relay_for(0, any_member()));
  EXPECT_EQ(d.relay_for(0, any_member())->id.str(), "b");
  EXPECT_EQ(d.relay_for(2, any_member())->endpoint, "tcp://b:1");
  EXPECT_EQ(d.relay_for(3, any_member())->id.str(), "d");
  EXPECT_FALSE(d.relay_for(6, any_member()));  // nobody in ranks 6..8
  EXPECT_EQ(d.direct_beaters(7), 3u);
  // b is no member at rank 1 any more: c takes over, and b is forgotten.
  auto not_b = [](const node_id& id, int32_t) { return id.str() != "b"; };
  EXPECT_EQ(d.relay_for(0, not_b)->id.str(), "c");
  EXPECT_EQ(d.relay_for(0, any_member())->id.str(), "c");
  // Ranks moved (an adopted plan): d is at rank 0 now, c gone.
  d.renumber([](const node_id& id) { return id.str() == "d" ? 0 : -1; });
  EXPECT_EQ(d.relay_for(1, any_member())->id.str(), "d");
  EXPECT_FALSE(d.relay_for(3, any_member()));
  d.erase(node_id{"d"});
  EXPECT_FALSE(d.relay_for(0, any_member()));
  relay_directory never({64, 0});
  never.set(node_id{"a"}, 0, "tcp://a:1");
  never.update(100000);
  EXPECT_FALSE(never.relay_for(0, any_member()));
}

TEST(relay_directory, comes_on_at_the_threshold_and_goes_off_only_below_three_quarters_of_it) {
  relay_directory d({64, 1000});
  d.update(999);
  EXPECT_FALSE(d.active());
  d.update(1000);
  EXPECT_TRUE(d.active());
  d.update(751);  // a few losses at the threshold
  EXPECT_TRUE(d.active());
  d.update(749);
  EXPECT_FALSE(d.active());
  d.update(999);
  EXPECT_FALSE(d.active());
}

TEST(relay_hub, passes_on_each_members_newest_beat_with_its_age_until_the_timeout_and_a_refusal_once) {
  relay_hub hub(2);
  const clock_time t0{std::chrono::hours(5)};
  hub.heard("a", {7, 3, 40, t0});
  hub.heard("b", {8, 3, 41, t0 + 100ms});
  hub.heard("a", {7, 4, 42, t0 + 200ms});
  pb::heartbeat hb;
  hub.fill(hb, t0 + 250ms, 1000ms);
  ASSERT_EQ(hb.relayed_size(), 2);
  EXPECT_EQ(hb.relayed(0).node_id(), "a");
  EXPECT_EQ(hb.relayed(0).generation(), 4u);
  EXPECT_EQ(hb.relayed(0).step(), 42);
  EXPECT_EQ(hb.relayed(0).age_ms(), 50u);
  EXPECT_EQ(hb.relayed(1).incarnation(), 8u);
  EXPECT_EQ(hb.relayed(1).age_ms(), 150u);
  // A third member replaces the stalest (b) at capacity 2.
  hub.heard("c", {9, 4, 42, t0 + 300ms});
  hb.Clear();
  hub.fill(hb, t0 + 1150ms, 1000ms);  // a's beat is 950 ms old, c's 850 ms
  ASSERT_EQ(hb.relayed_size(), 2);
  EXPECT_EQ(hb.relayed(0).node_id(), "a");
  EXPECT_EQ(hb.relayed(1).node_id(), "c");
  hb.Clear();
  hub.fill(hb, t0 + 1200ms, 1000ms);  // a's is 1 s old now: gone
  ASSERT_EQ(hb.relayed_size(), 1);
  EXPECT_EQ(hub.size(), 1u);
  hub.refuse({"c"});
  EXPECT_EQ(hub.size(), 0u);
  EXPECT_TRUE(hub.take_refusal("c"));
  EXPECT_FALSE(hub.take_refusal("c"));
  EXPECT_FALSE(hub.take_refusal("a"));
}

TEST(relay_link, follows_its_assignment_and_gives_a_silent_relay_up_for_a_while) {
  relay_link l;
  const clock_time t0{std::chrono::hours(5)};
  pb::relay_assignment r;
  r.set_endpoint("tcp://r:1");
  r.set_node_id("r");
  r.set_interval_ms(250);
  EXPECT_EQ(l.assign(r, "m", t0), std::optional<std::string>("tcp://r:1"));
  EXPECT_EQ(l.assign(r, "m", t0), std::nullopt);  // nothing changes
  EXPECT_EQ(l.member_interval(), 250ms);
  EXPECT_FALSE(l.is_relay());
  // Answered beats keep it; one unanswered for the grace gives it up.
  l.beat(t0);
  l.acked(t0 + 5ms);
  l.beat(t0 + 250ms);
  EXPECT_FALSE(l.given_up(t0 + 340ms, 100ms, 250ms, 2000ms));
  l.beat(t0 + 300ms);  // a second unanswered beat does not restart the wait
  EXPECT_TRUE(l.given_up(t0 + 350ms, 100ms, 250ms, 2000ms));
  EXPECT_EQ(l.endpoint(), "");
  EXPECT_FALSE(l.given_up(t0 + 400ms, 100ms, 250ms, 2000ms));
  // Named again while avoided: the coordinator it is.
  EXPECT_EQ(l.assign(r, "m", t0 + 1s), std::nullopt);
  EXPECT_EQ(l.endpoint(), "");
  EXPECT_EQ(l.assign(r, "m", t0 + 2500ms), std::optional<std::string>("tcp://r:1"));
  // Dialled again: before its first answer it has the longer grace.
  l.beat(t0 + 2500ms);
  EXPECT_FALSE(l.given_up(t0 + 2700ms, 100ms, 250ms, 2000ms));
  EXPECT_TRUE(l.given_up(t0 + 2750ms, 100ms, 250ms, 2000ms));
  EXPECT_EQ(l.assign(r, "m", t0 + 5s), std::optional<std::string>("tcp://r:1"));
  // The relay is the node itself: it beats the coordinator.
  EXPECT_EQ(l.assign(r, "r", t0 + 3s), std::optional<std::string>(""));
  EXPECT_TRUE(l.is_relay());
  pb::relay_assignment none;
  EXPECT_EQ(l.assign(none, "r", t0 + 3s), std::nullopt);
  EXPECT_FALSE(l.is_relay());
}

TEST(relay_grace, is_a_third_of_the_timeout_and_a_quarter_before_a_relays_first_answer) {
  EXPECT_EQ(relay_grace(liveness_options{100ms, 1200ms}), clock_duration(400ms));
  EXPECT_EQ(relay_first_grace(liveness_options{100ms, 1200ms}), clock_duration(300ms));
}

// -- a coordinator and five nodes in memory ---------------------------------

namespace {

class idle_launcher : public process_launcher {
 public:
  result<int32_t> spawn(int32_t) override { return next_pid++; }
  void terminate(int32_t) override {}
  void kill(int32_t) override {}
  int32_t next_pid = 1000;
};

// Routes envelopes between the coordinator, the node agents and their
// relays; a partitioned node neither sends nor receives anything.
struct relay_net {
  membership_handle coordinator;
  std::map<std::string, node_agent_handle> agents;  // by node id
  std::map<std::string, std::string> dialled;       // node id -> the relay endpoint its links::relay is open to
  std::set<std::string> partitioned;
  std::map<std::string, size_t> beats_to_coordinator;  // heartbeats by sender

  static std::string endpoint_of(const std::string& id) { return "tcp://" + id + ":7000"; }
  static std::string owner_of(const std::string& endpoint) { return endpoint.substr(6, endpoint.find(':', 6) - 6); }

  outbound coordinator_out() {
    return [this](const std::string&, const std::string& peer, pb::envelope env) {
      const auto id = peer.substr(5);
      if (partitioned.count(id)) return;
      caf::anon_send(agents.at(id), inbound{links::coordinator, "", std::move(env)});
    };
  }
  outbound agent_out(const std::string& id) {
    return [this, id](const std::string& link, const std::string& peer, pb::envelope env) {
      if (link == links::ranks || partitioned.count(id)) return;
      if (link == links::relay) {
        const auto to = owner_of(dialled.at(id));
        if (!partitioned.count(to)) caf::anon_send(agents.at(to), inbound{links::relay_in, "peer-" + id, std::move(env)});
        return;
      }
      if (link == links::relay_in) {
        const auto to = peer.substr(5);
        if (!partitioned.count(to) && dialled[to] == endpoint_of(id)) caf::anon_send(agents.at(to), inbound{links::relay, "", std::move(env)});
        return;
      }
      if (env.body_case() == pb::envelope::kHeartbeat) ++beats_to_coordinator[id];
      caf::anon_send(coordinator, inbound{links::nodes, "peer-" + id, std::move(env)});
    };
  }
};

class relay_cluster : public ::testing::Test, public caf_fixture {
 protected:
  // Five nodes a..e (node ranks 0..4); relays from 4 members, 3 a group:
  // a relays for b and c, d for e.
  void start() {
    coordinator_options co;
    co.membership.min_nodes = 1;
    co.liveness = liveness_options{100ms, 1000ms};
    co.relays = relay_options{3, 4};
    co.header = envelope_header{1, "job", "coordinator", 1};
    net.coordinator = spawn(membership_actor, co, net.coordinator_out(), job_handle{});
    for (std::string id : {"a", "b", "c", "d", "e"}) {
      node_agent_options o;
      o.node_id = node_id{id};
      o.advertise_addr = id + ".local";
      o.nproc = 1;
      o.header = envelope_header{1, "", "node/" + id, 7};
      o.liveness = liveness_options{100ms, 1000ms};
      o.relay_endpoint = relay_net::endpoint_of(id);
      o.dial_relay = [this, id](const std::string& endpoint) { net.dialled[id] = endpoint; };
      net.agents[id] = spawn(node_agent, o, net.agent_out(id), std::make_shared<idle_launcher>());
      caf::anon_send(net.agents[id], start_atom::value);
      advance(20ms);  // registered in this order: node ranks 0..4
    }
    advance(500ms);
  }
  node_agent_state& agent(const std::string& id) { return state_of<node_agent_state>(net.agents.at(id)); }
  membership_actor_state& coord() { return state_of<membership_actor_state>(net.coordinator); }
  // Advances until the coordinator has declared `n` nodes lost (at most `limit`); the time it took.
  std::chrono::milliseconds until_lost(size_t n, std::chrono::milliseconds limit) {
    auto t = 0ms;
    while (coord().lost.size() < n && t < limit) {
      advance(10ms);
      t += 10ms;
    }
    return t;
  }
  // Cuts `id` off and advances until a node is lost (at most 3 s), which
  // must be `id` alone; the time it took.
  std::chrono::milliseconds cut_until_lost(const std::string& id) {
    net.partitioned.insert(id);
    const auto took = until_lost(1, 3s);
    EXPECT_EQ(coord().lost.size(), 1u);
    if (!coord().lost.empty()) {
      EXPECT_EQ(coord().lost[0].peer.str(), id);
    }
    return took;
  }

  relay_net net;
};

}  // namespace

TEST_F(relay_cluster, members_beat_their_relay_and_the_coordinator_hears_only_the_relays) {
  start();
  for (std::string id : {"a", "b", "c", "d", "e"}) ASSERT_EQ(agent(id).phase, node_phase::registered) << id;
  EXPECT_EQ(agent("b").relay.endpoint(), relay_net::endpoint_of("a"));
  EXPECT_EQ(agent("c").relay.endpoint(), relay_net::endpoint_of("a"));
  EXPECT_EQ(agent("e").relay.endpoint(), relay_net::endpoint_of("d"));
  EXPECT_TRUE(agent("a").relay.is_relay());
  EXPECT_TRUE(agent("d").relay.is_relay());
  net.beats_to_coordinator.clear();
  advance(3s);
  EXPECT_TRUE(coord().lost.empty());
  EXPECT_EQ(net.beats_to_coordinator.count("b") + net.beats_to_coordinator.count("c") + net.beats_to_coordinator.count("e"), 0u);
  EXPECT_GE(net.beats_to_coordinator["a"], 25u);
  EXPECT_GE(coord().relayed_beats, 100u);  // b, c and e, about 30 times each
  for (std::string id : {"b", "c", "e"}) EXPECT_EQ(agent(id).phase, node_phase::registered) << id;  // they heard the coordinator through the relay
}

TEST_F(relay_cluster, a_silent_member_is_lost_within_the_timeout_of_its_last_beat_and_nobody_else) {
  start();
  const auto took = cut_until_lost("c");
  ASSERT_EQ(coord().lost.size(), 1u);
  // Its last beat reached a up to one interval before the cut; the
  // coordinator judges it by that beat's age, not by when a passed it on.
  EXPECT_GE(took, 900ms);
  EXPECT_LE(took, 1200ms);
  EXPECT_LE(coord().lost[0].detected_after_s, 1.15);
  advance(2s);
  EXPECT_EQ(coord().lost.size(), 1u);
}

TEST_F(relay_cluster, a_lost_relays_members_go_back_to_the_coordinator_in_time_and_one_of_them_relays_next) {
  start();
  const auto took = cut_until_lost("a");
  EXPECT_LE(took, 1200ms);
  EXPECT_EQ(agent("b").relay.endpoint(), "");  // b gave a up and beat the coordinator
  advance(3s);
  EXPECT_EQ(coord().lost.size(), 1u);  // b and c were never lost
  // b has the lowest rank of the group left: c beats it now.
  EXPECT_TRUE(agent("b").relay.is_relay());
  EXPECT_EQ(agent("c").relay.endpoint(), relay_net::endpoint_of("b"));
  EXPECT_EQ(agent("e").relay.endpoint(), relay_net::endpoint_of("d"));
}

TEST_F(relay_cluster, a_member_the_coordinator_no_longer_knows_is_told_through_its_relay_to_register_again) {
  start();
  // The coordinator loses e (cut off from it alone), while e still reaches d.
  auto& co = coord();
  ASSERT_TRUE(co.members.find(node_id{"e"}));
  const auto inc = co.members.find(node_id{"e"})->incarnation;
  co.members.remove(node_id{"e"}, now());
  advance(500ms);
  // e was refused through d, registered again with the coordinator, and is
  // a member of the same incarnation again, beating d.
  ASSERT_TRUE(co.members.find(node_id{"e"}));
  EXPECT_EQ(co.members.find(node_id{"e"})->incarnation, inc);
  EXPECT_EQ(agent("e").phase, node_phase::registered);
  EXPECT_EQ(agent("e").relay.endpoint(), relay_net::endpoint_of("d"));
  EXPECT_GE(agent("e").registers_sent, 2u);
}

namespace {
class relay_coordinator : public ::testing::Test, public caf_fixture {
 protected:
  // A coordinator with these relay options, and nodes `ids` registered in
  // that order (node ranks 0, 1, ...), each listening at tcp://<id>:7000.
  membership_handle start(relay_options relays, const std::vector<std::string>& ids, int32_t max_nodes = 64) {
    coordinator_options co;
    co.membership.min_nodes = 1;
    co.membership.max_nodes = max_nodes;
    co.liveness = liveness_options{100ms, 1000ms};
    co.relays = relays;
    co.header = envelope_header{1, "job", "coordinator", 1};
    auto m = spawn(membership_actor, co, wire.sink(), job_handle{});
    for (const auto& id : ids) {
      auto in = register_from(id, 1);
      in.env.mutable_register_node()->set_relay_endpoint("tcp://" + id + ":7000");
      caf::anon_send(m, in);
    }
    run();
    return m;
  }

  wire_log wire;
};
}  // namespace

// 2,500 nodes that can relay, 64 a group: the members are told their
// group's relay and beat it at the members' interval (250 ms, as without
// relays); the 40 relays beat the coordinator at the configured 100 ms.
TEST_F(relay_coordinator, at_scale_members_are_sent_to_their_relay_and_relays_beat_at_the_configured_interval) {
  std::vector<std::string> ids;
  for (int i = 0; i < 2500; ++i) ids.push_back("n" + std::to_string(i));
  auto m = start(relay_options{}, ids, 3000);
  const auto acks = wire.with(pb::envelope::kRegisterAck);
  ASSERT_EQ(acks.size(), 2500u);
  EXPECT_EQ(acks[998].env.register_ack().relay().endpoint(), "");  // the 999th: below relay_from_nodes
  EXPECT_EQ(acks[1000].env.register_ack().relay().node_id(), "n960");  // rank 1000's group starts at 960
  // n7 (rank 7) beats its relay n0; n0 relays and beats the coordinator.
  auto beat_of = [&](const std::string& id) {
    caf::anon_send(m, heartbeat_from(id, 1));
    run();
    return wire.with(pb::envelope::kHeartbeatAck, "peer-" + id).back().env.heartbeat_ack();
  };
  const auto member = beat_of("n7");
  EXPECT_EQ(member.relay().node_id(), "n0");
  EXPECT_EQ(member.relay().endpoint(), "tcp://n0:7000");
  EXPECT_EQ(member.relay().interval_ms(), 250u);
  EXPECT_EQ(member.interval_ms(), 250u);
  const auto relay = beat_of("n0");
  EXPECT_EQ(relay.relay().node_id(), "n0");
  EXPECT_EQ(relay.interval_ms(), 0u);  // 40 relays: as configured
  // A relayed beat of a member and of a stranger: the stranger is refused.
  auto in = heartbeat_from("n0", 2);
  auto* r = in.env.mutable_heartbeat()->add_relayed();
  r->set_node_id("n7");
  r->set_incarnation(1);
  r->set_age_ms(30);
  r = in.env.mutable_heartbeat()->add_relayed();
  r->set_node_id("zz");
  r->set_incarnation(1);
  in.env.mutable_heartbeat()->set_no_ack(true);  // an ack comes anyway: it names the refused
  caf::anon_send(m, in);
  run();
  const auto ack = wire.with(pb::envelope::kHeartbeatAck, "peer-n0").back().env.heartbeat_ack();
  EXPECT_EQ(ack.seq(), 2u);
  ASSERT_EQ(ack.refused_size(), 1);
  EXPECT_EQ(ack.refused(0), "zz");
  EXPECT_EQ(state_of<membership_actor_state>(m).relayed_beats, 1u);
}

TEST_F(relay_cluster, a_member_cut_off_with_its_relay_is_lost_with_it_and_the_other_member_is_not) {
  start();
  net.partitioned.insert("a");
  net.partitioned.insert("c");
  const auto took = until_lost(2, 3s);
  ASSERT_EQ(coord().lost.size(), 2u);
  EXPECT_LE(took, 1200ms);
  std::set<std::string> lost{coord().lost[0].peer.str(), coord().lost[1].peer.str()};
  EXPECT_EQ(lost, (std::set<std::string>{"a", "c"}));
  advance(3s);
  EXPECT_EQ(coord().lost.size(), 2u);  // b went back to the coordinator in time
  EXPECT_TRUE(agent("b").relay.is_relay());
}

// n0 relays for n1 and passes on n1's last beat for 500 ms, then falls
// silent. n1's silence is judged from n0's last beat, not its own (it had
// no way to be heard meanwhile): not lost 500 ms later, and back in time
// with a beat of its own; n0 is lost the timeout after its last beat.
TEST_F(relay_coordinator, a_member_is_judged_from_its_silent_relays_last_beat_and_is_not_lost_before_it) {
  auto m = start(relay_options{2, 2}, {"n0", "n1"});
  auto relay_beat = [&](uint32_t age_ms) {
    auto in = heartbeat_from("n0", 1);
    auto* r = in.env.mutable_heartbeat()->add_relayed();
    r->set_node_id("n1");
    r->set_incarnation(1);
    r->set_age_ms(age_ms);
    caf::anon_send(m, in);
    run();
  };
  // n0 beats for 500 ms, passing on n1's beat of t0 at its growing age.
  for (uint32_t age = 0; age <= 500; age += 100) {
    relay_beat(age);
    if (age < 500) advance(100ms);
  }
  auto& st = state_of<membership_actor_state>(m);
  advance(800ms);
  EXPECT_TRUE(st.lost.empty());  // n1's own beat is 1.3 s old, but n0 has been silent for 800 ms
  caf::anon_send(m, heartbeat_from("n1", 2));  // n1 gave n0 up and beats the coordinator
  run();
  advance(400ms);
  ASSERT_EQ(st.lost.size(), 1u);
  EXPECT_EQ(st.lost[0].peer.str(), "n0");
  EXPECT_TRUE(st.members.find(node_id{"n1"}));
}

// n1 beats through n0. Its connection to the coordinator closes: lost
// three intervals later while n0's beats carry only its older beat (it
// died); kept when n0 passes on a beat n1 sent after the close (only its
// connection dropped).
TEST_F(relay_coordinator, a_relayed_members_closed_connection_is_a_loss_after_the_grace_unless_its_relay_hears_it_after) {
  auto m = start(relay_options{2, 2}, {"n0", "n1", "n2", "n3"});
  std::map<std::string, uint32_t> age{{"n1", 0}, {"n3", 0}};
  auto relay_beats = [&]() {
    for (auto [relay, member] : {std::pair{"n0", "n1"}, std::pair{"n2", "n3"}}) {
      auto in = heartbeat_from(relay, 1);
      auto* r = in.env.mutable_heartbeat()->add_relayed();
      r->set_node_id(member);
      r->set_incarnation(1);
      r->set_age_ms(age[member]);
      caf::anon_send(m, in);
    }
    run();
  };
  for (int i = 0; i < 3; ++i) {
    relay_beats();
    advance(100ms);
  }
  caf::anon_send(m, closed_atom::value, std::string("peer-n1"));
  caf::anon_send(m, closed_atom::value, std::string("peer-n3"));
  run();
  auto& st = state_of<membership_actor_state>(m);
  for (int i = 0; i < 4; ++i) {
    age["n1"] += 100;  // n1 is gone: its last beat ages at n0
    age["n3"] = i == 1 ? 0 : age["n3"] + 100;  // n3 beats n2 again 200 ms after the close
    advance(100ms);
    relay_beats();
  }
  ASSERT_EQ(st.lost.size(), 1u);
  EXPECT_EQ(st.lost[0].peer.str(), "n1");
  EXPECT_TRUE(st.lost[0].closed);
  EXPECT_TRUE(st.members.find(node_id{"n3"}));
}
