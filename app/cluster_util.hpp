#pragma once
// Small helpers shared by the cluster roles.
#include <string>

#include "runtime/result.hpp"

namespace dtactor {

struct tcp_endpoint {
  std::string host;
  int port = 0;
};

// "tcp://HOST:PORT" -> {HOST, PORT}; errors say what is wrong with the text.
result<tcp_endpoint> parse_tcp_endpoint(const std::string& endpoint, const std::string& what);

// The local address this machine uses to reach `host` (no packet is sent),
// or "" when it cannot be found: a node's default --advertise-addr.
std::string local_address_towards(const std::string& host, int port);

// The host name, for default node ids.
std::string host_name();

// Job id shared by every process of a run: stable across coordinator restarts
// of the same run directory.
std::string job_id_for(const std::string& run_dir);

}  // namespace dtactor
