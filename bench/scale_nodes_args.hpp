#pragma once
// The scale bench's simulator (bench/scale_nodes.cpp): its options and
// their parsing from the command line.
#include <string>
#include <vector>

#include "dtactor/result.hpp"

namespace dtactor::scale_sim {

struct sim_options {
  std::string coordinator;           // tcp://HOST:PORT
  std::string key_path;              // the job key (dtactor keygen)
  int nodes = 100;
  std::string prefix = "sim";        // node ids: PREFIX-<i>
  std::vector<std::string> sources;  // loopback source addresses, round robin
  double report_every_s = 5;         // step reports at wall-clock multiples of this
  int64_t steps_per_report = 50;     // train.log_every_steps' worth of steps per report
  int io_threads = 1;
  double stats_every_s = 5;
  int zmtp_heartbeat_ms = 1000;  // as a node's bridge (0: off, for experiments)
  // What-ifs for the storm (defaults: as a node): the reconnect backoff's
  // cap (0: a dial every 100 ms, as app/node.cpp sets it), the register
  // retries' cap (0: node_agent's), and ZMQ_IMMEDIATE (no queueing of
  // registers while the connection is not up).
  int reconnect_max_ms = 0;
  int register_cap_ms = 0;
  bool immediate = false;
  // As zmq_bridge's DEALER (net/redial_backoff.hpp): after a connection
  // shut before its handshake, disconnect and dial again later, up to this
  // (zmq_bridge_options' shed_redial_max_ms); 0: no socket monitor, libzmq's
  // redial every 100 ms (a node before that backoff).
  int shed_redial_max_ms = 5000;
};

extern const char* usage;

// The options, or one line saying what is wrong.
result<sim_options> parse_args(int argc, char** argv);

// Raises the open-file limit (up to the hard limit) for `nodes` simulated nodes.
void raise_fd_limit(int nodes);

}  // namespace dtactor::scale_sim
