#include "job/journal_events.hpp"

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <type_traits>
#include <utility>

namespace dtactor::ev {

namespace {

using nlohmann::json;

// ---- enum names: one table each ----

constexpr std::pair<plan_cause, const char*> plan_cause_names[] = {
    {plan_cause::none, "none"},
    {plan_cause::node_lost, "node_lost"},
    {plan_cause::rank_exited, "rank_exited"},
    {plan_cause::collective_failure, "collective_failure"},
    {plan_cause::node_left, "node_left"},
    {plan_cause::node_joined, "node_joined"},
    {plan_cause::rank_ready, "rank_ready"},
    {plan_cause::start, "start"},
    {plan_cause::restart, "restart"},
    {plan_cause::adopted, "adopted"},
};
constexpr std::pair<loss_cause, const char*> loss_cause_names[] = {
    {loss_cause::heartbeat_timeout, "heartbeat_timeout"},
    {loss_cause::suspected_after_collective_failure, "suspected_after_collective_failure"},
    {loss_cause::restarted, "restarted"},
    {loss_cause::connection_closed, "connection_closed"},
};
constexpr std::pair<state_source, const char*> state_source_names[] = {
    {state_source::local, "local"},
    {state_source::peer, "peer"},
    {state_source::disk, "disk"},
    {state_source::fresh, "fresh"},
};
constexpr std::pair<optimizer_source, const char*> optimizer_source_names[] = {
    {optimizer_source::own, "own"},
    {optimizer_source::replica, "replica"},
    {optimizer_source::checkpoint, "checkpoint"},
    {optimizer_source::restart, "restart"},
};
constexpr std::pair<outcome, const char*> outcome_names[] = {
    {outcome::finished, "finished"},
    {outcome::stopped, "stopped"},
    {outcome::failed, "failed"},
};

template <class E, size_t N>
const char* name_in(const std::pair<E, const char*> (&table)[N], E v) {
  for (const auto& [e, n] : table)
    if (e == v) return n;
  return "unknown";
}

template <class E, size_t N>
bool value_in(const std::pair<E, const char*> (&table)[N], std::string_view s, E& out) {
  for (const auto& [e, n] : table)
    if (s == n) {
      out = e;
      return true;
    }
  return false;
}

// ---- writing ----

template <class T>
struct is_optional : std::false_type {};
template <class T>
struct is_optional<std::optional<T>> : std::true_type {};

struct field_writer {
  json& j;

  template <class T>
  void operator()(const char* key, const T& v) {
    if constexpr (is_optional<T>::value) {
      if (v) (*this)(key, *v);
    } else if constexpr (std::is_enum_v<T>) {
      j[key] = to_string(v);
    } else if constexpr (std::is_same_v<T, std::map<std::string, double>>) {
      for (const auto& [k, x] : v) j[k] = x;  // flattened
    } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
      // An evaluation's examples are written only when there are some.
      if (!v.empty() || std::string_view(key) != "examples") j[key] = v;
    } else if constexpr (std::is_same_v<T, std::vector<rank_resources>>) {
      json a = json::array();
      for (const auto& r : v) {
        json o = json::object();
        field_writer w{o};
        rank_resources::fields(r, w);
        a.push_back(std::move(o));
      }
      j[key] = std::move(a);
    } else {
      j[key] = v;
    }
  }
};

// ---- reading ----

// The keys a type lists (a flattened map takes the others).
struct key_collector {
  std::set<std::string> keys;
  template <class T>
  void operator()(const char* key, const T&) {
    keys.insert(key);
  }
};

struct field_reader {
  const json& j;
  const std::set<std::string>& declared;
  std::string error;  // the first problem

  void fail(const char* key, const std::string& what) {
    if (error.empty()) error = "field \"" + std::string(key) + "\" " + what;
  }

  template <class T>
  void read(const char* key, const json& v, T& out) {
    if constexpr (std::is_same_v<T, bool>) {
      if (!v.is_boolean()) return fail(key, "is not true or false");
      out = v.get<bool>();
    } else if constexpr (std::is_floating_point_v<T>) {
      // A non-finite number is written as null.
      if (v.is_null()) {
        out = std::numeric_limits<T>::quiet_NaN();
        return;
      }
      if (!v.is_number()) return fail(key, "is not a number");
      out = v.get<T>();
    } else if constexpr (std::is_integral_v<T>) {
      // The range before the conversion: a number the field cannot hold is
      // refused, never converted (5e74 as an int64_t is undefined behaviour;
      // found by fuzz_journal_report).
      using limits = std::numeric_limits<T>;
      if (!v.is_number()) return fail(key, "is not a number");
      if (v.is_number_float()) {
        const double d = v.get<double>();
        if (!std::isfinite(d) || d != std::floor(d)) return fail(key, "is not a whole number");
        if (!(d >= static_cast<double>(limits::min()) && d < static_cast<double>(limits::max()) + 1.0)) return fail(key, "is out of range");
        out = static_cast<T>(d);
      } else if (v.is_number_unsigned()) {
        if (v.get<uint64_t>() > static_cast<uint64_t>(limits::max())) return fail(key, "is out of range");
        out = static_cast<T>(v.get<uint64_t>());
      } else {
        const int64_t i = v.get<int64_t>();
        if (std::is_unsigned_v<T> && i < 0) return fail(key, "is negative");
        if (i < static_cast<int64_t>(limits::min()) || (i > 0 && static_cast<uint64_t>(i) > static_cast<uint64_t>(limits::max())))
          return fail(key, "is out of range");
        out = static_cast<T>(i);
      }
    } else if constexpr (std::is_enum_v<T>) {
      if (!v.is_string()) return fail(key, "is not a string");
      if (!from_string(v.get_ref<const std::string&>(), out)) return fail(key, "has the unknown value \"" + v.get<std::string>() + "\"");
    } else if constexpr (std::is_same_v<T, std::string>) {
      if (!v.is_string()) return fail(key, "is not a string");
      out = v.get<std::string>();
    } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
      if (!v.is_array()) return fail(key, "is not a list");
      out.clear();
      for (const auto& x : v) {
        if (!x.is_string()) return fail(key, "holds something other than strings");
        out.push_back(x.get<std::string>());
      }
    } else if constexpr (std::is_same_v<T, std::vector<rank_resources>>) {
      if (!v.is_array()) return fail(key, "is not a list");
      out.clear();
      key_collector kc;
      const rank_resources proto{};
      rank_resources::fields(proto, kc);
      for (const auto& x : v) {
        if (!x.is_object()) return fail(key, "holds something other than objects");
        rank_resources r;
        field_reader inner{x, kc.keys, {}};
        rank_resources::fields(r, inner);
        if (!inner.error.empty()) return fail(key, "[...]: " + inner.error);
        out.push_back(std::move(r));
      }
    } else {
      static_assert(sizeof(T) == 0, "a journal field of a type the codec does not know");
    }
  }

  template <class T>
  void operator()(const char* key, T& out) {
    if (!error.empty()) return;
    if constexpr (std::is_same_v<T, std::map<std::string, double>>) {
      out.clear();
      for (auto it = j.begin(); it != j.end(); ++it)
        if (it.key() != "t" && it.key() != "event" && !declared.count(it.key()) && it->is_number()) out[it.key()] = it->template get<double>();
    } else {
      auto it = j.find(key);
      if (it == j.end()) return;  // missing: the default (an older writer's line)
      if constexpr (is_optional<T>::value) {
        typename T::value_type v{};
        read(key, *it, v);
        if (error.empty()) out = std::move(v);
      } else {
        read(key, *it, out);
      }
    }
  }
};

template <class T>
result<journal_event> read_as(const json& j, std::string_view name) {
  key_collector kc;
  const T proto{};
  T::fields(proto, kc);
  T out;
  if constexpr (std::is_same_v<T, rank_down>) out.failed = name == rank_down::failed_name;
  field_reader r{j, kc.keys, {}};
  T::fields(out, r);
  if (!r.error.empty()) return make_error("journal event \"" + std::string(name) + "\": " + r.error);
  return journal_event(std::move(out));
}

template <class T>
bool names(std::string_view name) {
  if constexpr (std::is_same_v<T, rank_down>)
    return name == rank_down::failed_name || name == rank_down::exited_name;
  else
    return name == T::name;
}

template <size_t I = 0>
std::optional<result<journal_event>> read_named(const json& j, std::string_view name) {
  if constexpr (I == std::variant_size_v<journal_event>) {
    return std::nullopt;
  } else {
    using T = std::variant_alternative_t<I, journal_event>;
    if (names<T>(name)) return read_as<T>(j, name);
    return read_named<I + 1>(j, name);
  }
}

template <size_t I = 0>
bool known(std::string_view name) {
  if constexpr (I == std::variant_size_v<journal_event>)
    return false;
  else
    return names<std::variant_alternative_t<I, journal_event>>(name) || known<I + 1>(name);
}

}  // namespace

const char* to_string(plan_cause c) { return name_in(plan_cause_names, c); }
const char* to_string(loss_cause c) { return name_in(loss_cause_names, c); }
const char* to_string(state_source s) { return name_in(state_source_names, s); }
const char* to_string(outcome o) { return name_in(outcome_names, o); }
const char* to_string(optimizer_source s) { return name_in(optimizer_source_names, s); }
bool from_string(std::string_view s, optimizer_source& out) { return value_in(optimizer_source_names, s, out); }
bool from_string(std::string_view s, plan_cause& out) { return value_in(plan_cause_names, s, out); }
bool from_string(std::string_view s, loss_cause& out) { return value_in(loss_cause_names, s, out); }
bool from_string(std::string_view s, state_source& out) { return value_in(state_source_names, s, out); }
bool from_string(std::string_view s, outcome& out) { return value_in(outcome_names, s, out); }

std::string_view name_of(const journal_event& e) {
  return std::visit(
      [](const auto& x) -> std::string_view {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, rank_down>)
          return x.failed ? rank_down::failed_name : rank_down::exited_name;
        else
          return T::name;
      },
      e);
}

bool is_journal_event(std::string_view name) { return known(name); }

json to_json(const journal_event& e) {
  json j = json::object();
  std::visit(
      [&j](const auto& x) {
        field_writer w{j};
        std::decay_t<decltype(x)>::fields(x, w);
      },
      e);
  return j;
}

result<journal_event> from_json(const json& j) {
  if (!j.is_object()) return make_error("a journal event is a JSON object");
  auto it = j.find("event");
  if (it == j.end() || !it->is_string()) return make_error("a journal event has a string field \"event\"");
  const std::string& name = it->get_ref<const std::string&>();
  if (auto r = read_named(j, name)) return std::move(*r);
  return make_error("unknown journal event \"" + name + "\"");
}

result<std::optional<journal_line>> read_journal_line(std::string_view text) {
  json j = json::parse(text.begin(), text.end(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) return make_error("not a JSON object");
  auto it = j.find("event");
  if (it != j.end() && it->is_string() && !is_journal_event(it->get_ref<const std::string&>())) return std::optional<journal_line>{};
  auto e = from_json(j);
  if (!e) return e.err();
  journal_line line{0, std::move(e.value())};
  if (auto t = j.find("t"); t != j.end()) {
    if (!t->is_number()) return make_error("field \"t\" is not a number");
    line.t = t->get<double>();
  }
  return std::optional<journal_line>(std::move(line));
}

result<journal_line> parse_journal_line(std::string_view text) {
  auto r = read_journal_line(text);
  if (!r) return r.err();
  if (!r.value()) {
    const json j = json::parse(text.begin(), text.end(), nullptr, false);
    return make_error("unknown journal event \"" + j.at("event").get<std::string>() + "\"");
  }
  return std::move(*r.value());
}

}  // namespace dtactor::ev
