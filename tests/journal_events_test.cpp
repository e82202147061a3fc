// The journal's schema (job/journal_events.hpp): every event survives
// to_json -> from_json with every field set, the lines on disk keep their
// names and keys, and garbage is refused with one clear line.
#include "job/journal_events.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <set>
#include <type_traits>

#include "actors/wire_enums.hpp"

using namespace dtactor;
using nlohmann::json;

namespace {

template <class T>
struct is_optional : std::false_type {};
template <class T>
struct is_optional<std::optional<T>> : std::true_type {};

// Sets every listed field to a value other than its default, so that a field
// the codec drops shows up in the comparison.
struct filler {
  template <class T>
  void set(const char* key, T& v) {
    if constexpr (std::is_same_v<T, bool>) {
      v = !v;
    } else if constexpr (std::is_arithmetic_v<T>) {
      v = static_cast<T>(7 + std::string(key).size());
    } else if constexpr (std::is_enum_v<T>) {
      v = static_cast<T>(static_cast<int>(v) == 1 ? 2 : 1);
    } else if constexpr (std::is_same_v<T, std::string>) {
      v = std::string("value of ") + key;
    } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
      v = {"a", "b"};
    } else if constexpr (std::is_same_v<T, std::map<std::string, double>>) {
      v = {{"accuracy", 0.5}, {"val_loss", 1.25}};
    } else if constexpr (std::is_same_v<T, std::vector<ev::rank_resources>>) {
      ev::rank_resources r;
      filler f;
      ev::rank_resources::fields(r, f);
      v = {r, r};
    } else {
      static_assert(sizeof(T) == 0, "a field type the test does not fill");
    }
  }
  template <class T>
  void operator()(const char* key, T& v) {
    if constexpr (is_optional<T>::value) {
      typename T::value_type x{};
      set(key, x);
      v = x;
    } else {
      set(key, v);
    }
  }
};

struct key_lister {
  std::set<std::string> keys;
  template <class T>
  void operator()(const char* key, const T&) {
    if constexpr (!std::is_same_v<T, std::map<std::string, double>>) keys.insert(key);
  }
};

json line_of(const ev::journal_event& e, double t = 1700000000.5) {
  json j = ev::to_json(e);
  j["t"] = t;
  j["event"] = std::string(ev::name_of(e));
  return j;
}

template <size_t I = 0>
void round_trip_every_event(std::set<std::string>& names) {
  if constexpr (I < std::variant_size_v<ev::journal_event>) {
    using T = std::variant_alternative_t<I, ev::journal_event>;
    T x{};
    filler f;
    T::fields(x, f);
    const ev::journal_event e = x;
    const std::string name(ev::name_of(e));
    SCOPED_TRACE(name);
    names.insert(name);
    EXPECT_TRUE(ev::is_journal_event(name));

    const json written = ev::to_json(e);
    key_lister kl;
    T::fields(x, kl);
    for (const auto& k : kl.keys) EXPECT_TRUE(written.contains(k)) << "field " << k << " was not written: " << written.dump();

    const std::string text = line_of(e).dump();
    auto back = ev::parse_journal_line(text);
    ASSERT_TRUE(back) << back.message();
    EXPECT_DOUBLE_EQ(back->t, 1700000000.5);
    ASSERT_TRUE(std::holds_alternative<T>(back->event)) << text;
    EXPECT_EQ(ev::name_of(back->event), name);
    EXPECT_EQ(ev::to_json(back->event), written) << text;

    // A line with only the event's name reads as the defaults (an older writer's).
    auto bare = ev::from_json(json{{"event", name}});
    ASSERT_TRUE(bare) << bare.message();
    EXPECT_TRUE(std::holds_alternative<T>(bare.value()));
    round_trip_every_event<I + 1>(names);
  }
}

std::string error_of(const std::string& text) {
  auto r = ev::parse_journal_line(text);
  EXPECT_FALSE(r) << text << " was accepted";
  return r ? "" : r.message();
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST(journal_events, every_event_round_trips_with_every_field_set) {
  std::set<std::string> names;
  round_trip_every_event(names);
  // rank_down is two events on disk.
  ev::rank_down exited;
  exited.failed = false;
  auto back = ev::parse_journal_line(line_of(exited).dump());
  ASSERT_TRUE(back) << back.message();
  EXPECT_FALSE(std::get<ev::rank_down>(back->event).failed);
  EXPECT_EQ(ev::name_of(back->event), ev::rank_down::exited_name);
  EXPECT_TRUE(ev::is_journal_event(ev::rank_down::exited_name));
  EXPECT_EQ(names.size(), std::variant_size_v<ev::journal_event>);  // no two types share a name
}

TEST(journal_events, every_enum_value_has_one_name_that_reads_back) {
  auto check = [](auto last) {
    using E = decltype(last);
    std::set<std::string> seen;
    for (int i = 0; i <= static_cast<int>(last); ++i) {
      const E v = static_cast<E>(i);
      const std::string n = ev::to_string(v);
      EXPECT_NE(n, "unknown");
      EXPECT_TRUE(seen.insert(n).second) << n << " names two values";
      E back = static_cast<E>(last == static_cast<E>(0) ? 1 : 0);
      ASSERT_TRUE(ev::from_string(n, back)) << n;
      EXPECT_EQ(back, v) << n;
    }
    E untouched = last;
    EXPECT_FALSE(ev::from_string("no such name", untouched));
    EXPECT_EQ(untouched, last);
  };
  check(ev::plan_cause::adopted);
  check(ev::loss_cause::connection_closed);
  check(ev::state_source::fresh);
  check(ev::outcome::failed);
  EXPECT_STREQ(ev::to_string(ev::plan_cause::rank_exited), "rank_exited");  // the name recovery_done and the metrics use
}

// The sources and causes cross the wire as the protocol's enums: every
// value maps to its own wire value and back; a value this build does not
// know (a newer peer's, or unset) is no value, not a guess.
TEST(journal_events, sources_and_causes_cross_the_wire_as_enums_and_back) {
  auto check = [](auto last) {
    using E = decltype(last);
    std::set<int> wire;
    for (int i = 0; i <= static_cast<int>(last); ++i) {
      const E v = static_cast<E>(i);
      const auto w = to_wire(v);
      EXPECT_NE(static_cast<int>(w), 0) << ev::to_string(v) << " is unset on the wire";
      EXPECT_TRUE(wire.insert(static_cast<int>(w)).second) << ev::to_string(v) << " shares a wire value";
      const auto back = from_wire(w);
      ASSERT_TRUE(back.has_value()) << ev::to_string(v);
      EXPECT_EQ(*back, v) << ev::to_string(v);
    }
    EXPECT_FALSE(from_wire(static_cast<decltype(to_wire(last))>(0)).has_value());
    EXPECT_FALSE(from_wire(static_cast<decltype(to_wire(last))>(99)).has_value());
  };
  check(ev::state_source::fresh);
  check(ev::optimizer_source::restart);
  for (int i = 1; i <= static_cast<int>(ev::plan_cause::adopted); ++i) {
    const auto c = static_cast<ev::plan_cause>(i);
    EXPECT_EQ(from_wire(to_wire(c)), c) << ev::to_string(c);
  }
  EXPECT_EQ(from_wire(static_cast<pb::generation_plan::generation_cause>(99)), ev::plan_cause::none);
}

TEST(journal_events, lines_keep_the_names_and_keys_readers_know) {
  ev::step_completed s;
  s.step = 10;
  s.world_size = 2;
  s.generation = 3;
  s.loss = 1.5;
  s.lr = 0.1;
  s.samples_per_s = 100;
  s.allreduce_s = 0.25;
  s.allreduce_exposed_s = 0.125;
  s.step_s = 0.5;
  s.samples = 640;  // not journaled
  EXPECT_EQ(ev::name_of(s), "step");
  EXPECT_EQ(ev::to_json(s), json::parse(R"({"step":10,"world_size":2,"generation":3,"loss":1.5,"lr":0.1,"samples_per_s":100.0,"step_s":0.5,
                                             "allreduce_s":0.25,"allreduce_exposed_s":0.125})"));

  ev::eval_done e;
  e.step = 5;
  e.duration_s = 0.5;
  e.metrics = {{"accuracy", 0.75}};
  EXPECT_EQ(ev::name_of(e), "eval");
  EXPECT_EQ(ev::to_json(e), json::parse(R"({"step":5,"duration_s":0.5,"accuracy":0.75})"));  // no empty examples
  auto back = ev::parse_journal_line(R"({"event":"eval","step":5,"duration_s":0.5,"accuracy":0.75,"examples":["a -> b"],"t":1})");
  ASSERT_TRUE(back) << back.message();
  const auto& eb = std::get<ev::eval_done>(back->event);
  EXPECT_EQ(eb.metrics, (std::map<std::string, double>{{"accuracy", 0.75}}));
  EXPECT_EQ(eb.examples, std::vector<std::string>{"a -> b"});

  ev::generation_started g;
  g.cause = ev::plan_cause::node_lost;
  EXPECT_EQ(ev::to_json(g).at("cause"), "node_lost");
  EXPECT_EQ(ev::to_json(g).at("nodes"), json::array());  // always there
  EXPECT_EQ(ev::name_of(ev::job_error{"n0", "m"}), "job_error");
}

TEST(journal_events, a_non_finite_loss_is_null_on_disk_and_nan_read_back) {
  ev::step_completed s;
  s.loss = std::nan("");
  const std::string text = line_of(s).dump();
  EXPECT_TRUE(contains(text, "\"loss\":null")) << text;
  auto back = ev::parse_journal_line(text);
  ASSERT_TRUE(back) << back.message();
  EXPECT_TRUE(std::isnan(std::get<ev::step_completed>(back->event).loss));
}

TEST(journal_events, garbage_is_refused_with_one_clear_line) {
  EXPECT_TRUE(contains(error_of(""), "not a JSON object"));
  EXPECT_TRUE(contains(error_of("{\"event\":\"step\",\"step\":1"), "not a JSON object"));  // half a line
  EXPECT_TRUE(contains(error_of("[1,2]"), "not a JSON object"));
  EXPECT_TRUE(contains(error_of("{}"), "string field \"event\""));
  EXPECT_TRUE(contains(error_of(R"({"event":5})"), "string field \"event\""));
  EXPECT_TRUE(contains(error_of(R"({"event":"no_such_event"})"), "unknown journal event \"no_such_event\""));
  EXPECT_TRUE(contains(error_of(R"({"event":"step","step":"five"})"), "journal event \"step\": field \"step\" is not a number"));
  EXPECT_TRUE(contains(error_of(R"({"event":"step","step":1.5})"), "field \"step\" is not a whole number"));
  EXPECT_TRUE(contains(error_of(R"({"event":"job_waiting","generation":-1})"), "field \"generation\" is negative"));
  EXPECT_TRUE(contains(error_of(R"({"event":"node_lost","cause":"boredom"})"), "field \"cause\" has the unknown value \"boredom\""));
  EXPECT_TRUE(contains(error_of(R"({"event":"generation_started","nodes":[1]})"), "field \"nodes\" holds something other than strings"));
  EXPECT_TRUE(contains(error_of(R"({"event":"generation_started","drain":1})"), "field \"drain\" is not true or false"));
  EXPECT_TRUE(contains(error_of(R"({"event":"resources","ranks":[3]})"), "field \"ranks\""));
  EXPECT_TRUE(contains(error_of(R"({"event":"resources","ranks":[{"rank":"x"}]})"), "field \"rank\" is not a number"));
  EXPECT_TRUE(contains(error_of(R"({"event":"step","t":"noon"})"), "field \"t\" is not a number"));
  EXPECT_TRUE(contains(error_of(R"({"event":"checkpoint_restored","source":"cloud"})"), "unknown value \"cloud\""));
}

TEST(journal_events, a_newer_writers_event_can_be_passed_over) {
  auto r = ev::read_journal_line(R"({"event":"from_the_future","x":1,"t":5})");
  ASSERT_TRUE(r) << r.message();
  EXPECT_FALSE(r.value().has_value());
  EXPECT_FALSE(ev::read_journal_line("not json"));
  EXPECT_FALSE(ev::read_journal_line(R"({"event":"step","step":"x"})"));  // a known event still has to read
}
