// How one generation's gradients travel: every rank works it out through
// the generation's store (setup_exchange). See exchange.hpp.
#include "comm/exchange.hpp"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>

namespace dtactor {

std::vector<std::vector<int>> group_by_host(const std::vector<std::string>& keys) {
  std::vector<std::vector<int>> hosts;
  std::vector<std::string> seen;
  for (size_t r = 0; r < keys.size(); ++r) {
    const auto it = std::find(seen.begin(), seen.end(), keys[r]);
    if (it == seen.end()) {
      seen.push_back(keys[r]);
      hosts.push_back({static_cast<int>(r)});
    } else {
      hosts[static_cast<size_t>(it - seen.begin())].push_back(static_cast<int>(r));
    }
  }
  return hosts;
}

std::string exchange_plan::describe(const std::string& backend) const {
  if (hierarchical) {
    std::string s = host_ranks > 1 && shm ? "gradients over shared memory within the host (" + std::to_string(host_ranks) + " ranks)"
                                          : "gradients of this host's only rank";
    s += " and " + backend + " across " + std::to_string(host_count) + " hosts";
    return s + (hosts ? ", this rank exchanging for its host" : "");
  }
  if (shm) return "gradients over shared memory";
  return "gradients over " + backend + (why_not.empty() ? "" : " (no shared memory: " + why_not + ")");
}

namespace {
std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }
std::string string_of(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }
}  // namespace

namespace {

// Hierarchical: shared memory within each host (`hosts`: the ranks of each,
// this rank the `local`th of host `mine`), one rank per host on the wire.
// Into `out`: the host's segment and, on each host's first rank, the group
// of hosts; or why_not (and no segment) when some host could not map its
// segment. Throws what the store throws.
status join_hierarchical(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<std::vector<int>>& hosts, size_t mine, size_t local,
                         int64_t floats, int64_t largest_floats, int64_t ring_floats, const communicator_options& co, exchange_plan& out) {
  std::string problem;
  if (hosts[mine].size() > 1) {
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>("shm/h" + std::to_string(mine), store);
    std::string why;
    auto joined = shm_group::join(*prefixed, static_cast<int>(local), static_cast<int>(hosts[mine].size()),
                                  shm_slot_floats(floats, largest_floats, ring_floats, true), &why);
    if (!joined) return joined.err();
    if (!joined.value()) problem = "host " + std::to_string(mine) + ": " + why;
    out.shm = joined.value();
  }
  if (local == 0) store->set("hier/" + std::to_string(mine), bytes_of(problem.empty() ? "1" : "0" + problem));
  for (size_t h = 0; h < hosts.size(); ++h) {
    const std::string ok = string_of(store->get("hier/" + std::to_string(h)));
    if (ok != "1" && out.why_not.empty()) out.why_not = ok.size() > 1 ? ok.substr(1) : "host " + std::to_string(h) + " could not map it";
  }
  if (!out.why_not.empty()) {
    out.shm.reset();
    return {};
  }
  out.hierarchical = true;
  if (local == 0) {
    auto g = make_process_group(c10::make_intrusive<c10d::PrefixStore>("hosts", store), static_cast<int>(mine), out.host_count, co);
    if (!g) return make_error("the group of hosts: " + g.message());
    out.hosts = g.value();
  }
  return {};
}

}  // namespace

result<exchange_plan> setup_exchange(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world, int64_t floats,
                                     const communicator_options& co, const std::string& host_key, int64_t largest_floats,
                                     int64_t ring_floats) {
  exchange_plan out;
  try {
    store->set("host/" + std::to_string(rank), bytes_of(host_key));
    std::vector<std::string> keys;
    for (int r = 0; r < world; ++r) keys.push_back(string_of(store->get("host/" + std::to_string(r))));
    const auto hosts = group_by_host(keys);
    out.host_count = static_cast<int>(hosts.size());
    size_t mine = 0, local = 0, most = 0;
    for (size_t h = 0; h < hosts.size(); ++h) {
      most = std::max(most, hosts[h].size());
      for (size_t l = 0; l < hosts[h].size(); ++l)
        if (hosts[h][l] == rank) mine = h, local = l;
    }
    out.host_ranks = static_cast<int>(hosts[mine].size());
    out.host_members = hosts[mine];
    out.host_groups = hosts;
    if (hosts.size() == 1) {
      auto prefixed = c10::make_intrusive<c10d::PrefixStore>("shm", store);
      auto joined = shm_group::join(*prefixed, rank, world, shm_slot_floats(floats, largest_floats, ring_floats, false), &out.why_not);
      if (!joined) return joined.err();
      out.shm = joined.value();
      return out;
    }
    if (most == 1) {
      out.why_not = "every rank on a host of its own (another machine, host name or network namespace)";
      return out;
    }
    if (auto st = join_hierarchical(store, hosts, mine, local, floats, largest_floats, ring_floats, co, out); !st) return st.err();
  } catch (const std::exception& e) {
    std::string what = e.what();
    return make_error("gradient exchange rendezvous: " + what.substr(0, what.find('\n')));
  }
  return out;
}

status join_gather_segments(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world, int64_t floats, uint64_t generation,
                            exchange_plan& plan) {
  const std::string prefix = "g" + std::to_string(generation) + "/gather";
  floats = std::max<int64_t>(floats, 1024);
  try {
    if (!plan.hierarchical) {
      if (!plan.shm || plan.shm->world() != world) return {};
      std::string why;
      auto joined = shm_group::join(*c10::make_intrusive<c10d::PrefixStore>(prefix, store), rank, world, floats, &why);
      if (!joined) return joined.err();
      plan.gather = joined.value();  // null: not mapped (why), the gathers go over the group
      return {};
    }
    const auto& hosts = plan.host_groups;
    size_t mine = 0;
    while (mine < hosts.size() && std::find(hosts[mine].begin(), hosts[mine].end(), rank) == hosts[mine].end()) ++mine;
    if (mine == hosts.size()) return make_error("gather segments: rank " + std::to_string(rank) + " is on no host of the plan");
    const auto& members = hosts[mine];
    const int local = static_cast<int>(std::find(members.begin(), members.end(), rank) - members.begin());
    bool mapped = true;
    if (members.size() > 1) {
      std::string why;
      auto joined = shm_group::join(*c10::make_intrusive<c10d::PrefixStore>(prefix + "/h" + std::to_string(mine), store), local,
                                    static_cast<int>(members.size()), floats, &why);
      if (!joined) return joined.err();
      plan.gather = joined.value();
      mapped = plan.gather != nullptr;
    }
    if (local == 0) store->set(prefix + "/ok" + std::to_string(mine), bytes_of(mapped ? "1" : "0"));
    bool every = true;
    for (size_t h = 0; h < hosts.size(); ++h) every = every && string_of(store->get(prefix + "/ok" + std::to_string(h))) == "1";
    plan.host_gathers = every;
    if (!every) plan.gather.reset();
  } catch (const std::exception& e) {
    std::string what = e.what();
    return make_error("parameter gather segments: " + what.substr(0, what.find('\n')));
  }
  return {};
}

}  // namespace dtactor
