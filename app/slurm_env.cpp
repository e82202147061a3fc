// dtactor under srun (app/slurm_env.hpp).
#include "app/slurm_env.hpp"

#include <cstdio>
#include <cstdlib>

namespace dtactor {

namespace {

// Splits at commas outside brackets.
std::vector<std::string> top_level_items(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  int depth = 0;
  for (char c : s) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (c == ',' && depth == 0) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

bool all_digits(const std::string& s) { return !s.empty() && s.find_first_not_of("0123456789") == std::string::npos; }

// A host list names at most this many hosts (Slurm's largest clusters have
// tens of thousands): a list of huge ranges is refused, not expanded.
constexpr size_t max_hosts = 100000;

// A range bound: digits only, at most 18 of them (no overflow, no throw).
std::optional<long> range_bound(const std::string& s) {
  if (!all_digits(s) || s.size() > 18) return std::nullopt;
  long v = 0;
  for (char c : s) v = v * 10 + (c - '0');
  return v;
}

std::optional<long> to_long(const char* v) {
  if (!v || !*v) return std::nullopt;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*end != '\0' && *end != '(') return std::nullopt;  // SLURM_NTASKS_PER_NODE-style "2(x3)"
  return x;
}

}  // namespace

std::vector<std::string> expand_slurm_hostlist(const std::string& list, std::string& error) {
  std::vector<std::string> out;
  for (const auto& item : top_level_items(list)) {
    const auto lb = item.find('[');
    if (lb == std::string::npos) {
      if (out.size() >= max_hosts) {
        error = "Slurm host list '" + list.substr(0, 200) + "' names more than " + std::to_string(max_hosts) + " hosts";
        return {};
      }
      out.push_back(item);
      continue;
    }
    const auto rb = item.find(']', lb);
    if (rb == std::string::npos) {
      error = "malformed Slurm host list '" + list + "'";
      return {};
    }
    const std::string prefix = item.substr(0, lb), suffix = item.substr(rb + 1), ranges = item.substr(lb + 1, rb - lb - 1);
    std::string r;
    for (size_t i = 0; i <= ranges.size(); ++i) {
      if (i < ranges.size() && ranges[i] != ',') {
        r += ranges[i];
        continue;
      }
      const auto dash = r.find('-');
      const std::string a = r.substr(0, dash), b = dash == std::string::npos ? a : r.substr(dash + 1);
      const auto first = range_bound(a), last = range_bound(b);
      if (!first || !last || *last < *first) {
        error = "malformed Slurm host list '" + list + "'";
        return {};
      }
      if (static_cast<size_t>(*last - *first) >= max_hosts - out.size()) {
        error = "Slurm host list '" + list.substr(0, 200) + "' names more than " + std::to_string(max_hosts) + " hosts";
        return {};
      }
      // Zero padding as written ("[01-10]").
      for (long n = *first; n <= *last; ++n) {
        std::string num = std::to_string(n);
        while (num.size() < a.size()) num = "0" + num;
        out.push_back(prefix + num + suffix);
      }
      r.clear();
    }
  }
  if (out.empty()) error = "empty Slurm host list";
  return out;
}

bool under_srun(const std::function<const char*(const char*)>& getenv_fn) { return getenv_fn("SLURM_JOB_ID") && getenv_fn("SLURM_STEP_ID"); }

std::optional<slurm_launch> slurm_launch_from(const std::function<const char*(const char*)>& getenv_fn,
                                              const std::function<std::string(const std::string&)>& node_addr, std::string& error) {
  auto get = [&](const char* k) -> std::string {
    const char* v = getenv_fn(k);
    return v ? v : "";
  };
  slurm_launch l;
  l.job_id = get("SLURM_JOB_ID");
  l.node_name = get("SLURMD_NODENAME");
  const std::string nodelist = get("SLURM_JOB_NODELIST").empty() ? get("SLURM_NODELIST") : get("SLURM_JOB_NODELIST");
  if (l.job_id.empty() || l.node_name.empty() || nodelist.empty()) {
    error = "not inside a Slurm job step (SLURM_JOB_ID, SLURMD_NODENAME and SLURM_JOB_NODELIST are needed); give --coordinator";
    return std::nullopt;
  }
  auto hosts = expand_slurm_hostlist(nodelist, error);
  if (hosts.empty()) return std::nullopt;
  auto nodeid = to_long(getenv_fn("SLURM_NODEID"));
  if (!nodeid || *nodeid < 0) {
    // Without SLURM_NODEID: the position of this node in the list.
    nodeid = -1;
    for (size_t i = 0; i < hosts.size(); ++i)
      if (hosts[i] == l.node_name) nodeid = static_cast<long>(i);
    if (*nodeid < 0) {
      error = "Slurm node '" + l.node_name + "' is not in SLURM_JOB_NODELIST '" + nodelist + "'";
      return std::nullopt;
    }
  }
  l.node_index = static_cast<int>(*nodeid);
  auto nn = to_long(getenv_fn("SLURM_JOB_NUM_NODES"));
  if (!nn) nn = to_long(getenv_fn("SLURM_NNODES"));
  l.nnodes = nn && *nn > 0 ? static_cast<int>(*nn) : static_cast<int>(hosts.size());
  l.coordinator_host = node_addr(hosts.front());
  if (auto p = to_long(getenv_fn("DTACTOR_COORDINATOR_PORT"))) {
    if (*p < 1 || *p > 65535) {
      error = "DTACTOR_COORDINATOR_PORT must be a port number 1..65535";
      return std::nullopt;
    }
    l.port = static_cast<int>(*p);
  } else {
    auto id = to_long(l.job_id.c_str());
    l.port = 20000 + static_cast<int>((id ? *id : 0) % 10000);
  }
  if (auto g = to_long(getenv_fn("SLURM_GPUS_ON_NODE")); g && *g > 0) l.gpus_on_node = static_cast<int>(*g);
  if (auto r = to_long(getenv_fn("SLURM_RESTART_COUNT")); r && *r > 0) l.restart_count = static_cast<int>(*r);
  return l;
}

std::string scontrol_node_addr(const std::string& name) {
  if (name.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.") != std::string::npos) return name;
  FILE* f = ::popen(("scontrol show node '" + name + "' -o 2>/dev/null").c_str(), "r");
  if (!f) return name;
  std::string out;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof buf, f)) out.append(buf, n);
  ::pclose(f);
  const auto at = out.find("NodeAddr=");
  if (at == std::string::npos) return name;
  const auto end = out.find_first_of(" \n", at);
  const std::string addr = out.substr(at + 9, end == std::string::npos ? std::string::npos : end - at - 9);
  return addr.empty() ? name : addr;
}

}  // namespace dtactor
