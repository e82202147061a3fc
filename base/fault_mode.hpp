#pragma once
// Fault injection for tests (--fail-at-step / --fail-mode on a node): what
// the rank does right after the first step it completes at or after the
// given step (rank-oom: as it begins the next one). Parsed once on the command line; the node passes it on to its
// ranks by name.
#include <map>
#include <string>

namespace dtactor {

enum class fault_mode {
  crash,       // kill -9 of the node agent and of the rank itself (a spot machine gone)
  hang,        // SIGSTOP of the node agent and of the rank (a silent machine)
  leave,       // SIGTERM to the node agent (a preemption notice)
  rank_crash,  // kill -9 of the rank only (the node restarts it)
  // kill -9 of the rank as it begins the step after step N, before it
  // completes it, in every process of local rank 0 the node starts: a rank
  // the kernel's OOM killer ends at the same step each time.
  rank_oom,
};

// The command-line names, one table for parsing and for printing.
inline const std::map<std::string, fault_mode>& fault_mode_names() {
  static const std::map<std::string, fault_mode> names{
      {"crash", fault_mode::crash}, {"hang", fault_mode::hang}, {"leave", fault_mode::leave}, {"rank-crash", fault_mode::rank_crash},
      {"rank-oom", fault_mode::rank_oom}};
  return names;
}

inline std::string to_string(fault_mode m) {
  for (const auto& [name, mode] : fault_mode_names())
    if (mode == m) return name;
  return "crash";
}

}  // namespace dtactor
