#include "bench/scale_nodes_args.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <exception>

#include "base/printable.hpp"

namespace dtactor::scale_sim {

namespace {

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t comma = s.find(',', start);
    const std::string part = s.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (!part.empty()) out.push_back(part);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

}  // namespace

// As many descriptors as the hard limit allows: eight a node (its TCP
// connection, its socket's mailbox, its monitor's two; its relay DEALER's
// connection and mailbox; the listener's end of a member's connection)
// and some.
void raise_fd_limit(int nodes) {
  rlimit r{};
  if (getrlimit(RLIMIT_NOFILE, &r) != 0) return;
  const rlim_t want = static_cast<rlim_t>(nodes) * 8 + 256;
  if (r.rlim_cur >= want) return;
  r.rlim_cur = std::min(want, r.rlim_max);
  setrlimit(RLIMIT_NOFILE, &r);
}

const char* usage =
    "usage: scale_nodes --coordinator tcp://HOST:PORT --key FILE [--nodes K] [--prefix P]\n"
    "                   [--sources 127.0.0.2,127.0.0.3] [--report-every-s S] [--io-threads T] [--stats-every-s S]\n"
    "                   [--zmtp-heartbeat-ms MS (0: off)] [--reconnect-max-ms MS] [--register-cap-ms MS] [--immediate 0|1]\n"
    "                   [--shed-redial-max-ms MS (0: no redial backoff)]\n";

result<sim_options> parse_args(int argc, char** argv) {
  sim_options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) return make_error("missing value after " + printable(a));
    const std::string v = argv[++i];
    try {
      if (a == "--coordinator") o.coordinator = v;
      else if (a == "--key") o.key_path = v;
      else if (a == "--nodes") o.nodes = std::stoi(v);
      else if (a == "--prefix") o.prefix = v;
      else if (a == "--sources") o.sources = split_commas(v);
      else if (a == "--report-every-s") o.report_every_s = std::stod(v);
      else if (a == "--io-threads") o.io_threads = std::stoi(v);
      else if (a == "--stats-every-s") o.stats_every_s = std::stod(v);
      else if (a == "--zmtp-heartbeat-ms") o.zmtp_heartbeat_ms = std::stoi(v);
      else if (a == "--reconnect-max-ms") o.reconnect_max_ms = std::stoi(v);
      else if (a == "--register-cap-ms") o.register_cap_ms = std::stoi(v);
      else if (a == "--immediate") o.immediate = v == "1";
      else if (a == "--shed-redial-max-ms") o.shed_redial_max_ms = std::stoi(v);
      else return make_error("unknown option " + printable(a));
    } catch (const std::exception&) {
      return make_error("bad value for " + printable(a) + ": " + printable(v));
    }
  }
  if (o.coordinator.rfind("tcp://", 0) != 0) return make_error("--coordinator must be tcp://HOST:PORT");
  if (o.key_path.empty()) return make_error("--key is required (CURVE is on: dtactor keygen)");
  if (o.nodes < 1 || o.nodes > 20000) return make_error("--nodes must be 1..20000");
  if (o.report_every_s <= 0 || o.io_threads < 1 || o.stats_every_s <= 0) return make_error("--report-every-s, --io-threads and --stats-every-s must be positive");
  return o;
}


}  // namespace dtactor::scale_sim
