#pragma once
// Small helpers shared by the cluster roles.
#include <string>
#include <vector>

#include "storage/fs.hpp"
#include "dtactor/result.hpp"

namespace dtactor {

struct tcp_endpoint {
  std::string host;
  int port = 0;
};

// "tcp://HOST:PORT" -> {HOST, PORT}; errors say what is wrong with the text.
// With `free_port_allowed` (an address to bind), port 0 asks for a free port.
result<tcp_endpoint> parse_tcp_endpoint(const std::string& endpoint, const std::string& what, bool free_port_allowed = false);
// A comma-separated list of them (a node's --coordinator A,B: a coordinator
// and its standbys); at least one, at most 8.
result<std::vector<tcp_endpoint>> parse_tcp_endpoints(const std::string& endpoints, const std::string& what);

// Empty when `host` resolves to an IPv4 address, else one line saying it
// does not (a node then fails at once instead of timing out).
std::string resolution_error(const std::string& host, int port);

// The local address this machine uses to reach `host` (no packet is sent):
// a node's default --advertise-addr. Error: the name does not resolve, or
// no route leads there.
result<std::string> local_address_towards(const std::string& host, int port);

// A node id claimed on this machine for the job at `coordinator`: two node
// processes of one job on one host never share an id (each would take the
// other's registration for a restart). Released when the process ends, so a
// restarted node gets its id back.
struct node_id_claim {
  std::string id;
  std::string note;  // one line when the id differs from the one asked for
  file_lock lock;
};

// An explicit id (--node-id) is taken or refused with one line naming the
// live holder; the default (the host name) falls back to "<host>-2",
// "<host>-3", ... when taken.
result<node_id_claim> claim_node_id(const std::string& wanted, bool explicit_id, const std::string& coordinator);

// The host name, for default node ids.
std::string host_name();

// Job id shared by every process of a run: stable across coordinator restarts
// of the same run directory.
std::string job_id_for(const std::string& run_dir);

}  // namespace dtactor
