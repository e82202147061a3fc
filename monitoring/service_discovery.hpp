#pragma once
// Prometheus HTTP service discovery (http_sd_configs) served by the
// coordinator on its metrics port: GET /sd returns the JSON target list
//   [{"targets": ["HOST:PORT"], "labels": {"job": JOB_ID, "role": "coordinator"}},
//    {"targets": ["ADDR:PORT"], "labels": {"job": JOB_ID, "role": "node", "node": NODE_ID}}, ...]
// with the coordinator's own /metrics and every accepted node's. Prometheus
// polls it (refresh_interval), so nodes are scraped as they join and a
// replacement node is picked up without touching Prometheus's config.
//
// Why HTTP SD rather than file_sd: the coordinator may run on another machine
// than Prometheus, and a URL needs no shared file system; Prometheus 2.28+
// (Debian ships 2.42) supports it. A node stays listed after it is lost, so
// that its `up` series turns 0 (the "target down" alert) instead of vanishing;
// a node that registers again under the same id replaces its address.
// Thread-safe: the coordinator's bridge thread updates, the metrics thread reads.
#include <map>
#include <mutex>
#include <string>

namespace dtactor {

class sd_targets {
 public:
  // job_id: the `job` label of every target (the same value as the constant
  // `job` label on the coordinator's series; prometheus.yml sets
  // honor_labels so both agree).
  explicit sd_targets(std::string job_id) : job_id_(std::move(job_id)) {}

  // The coordinator's own metrics endpoint ("" or port 0: not listed).
  void set_coordinator(const std::string& host, int port);
  // A node asked to register (not yet accepted): remembered by link peer.
  void note_registration(const std::string& peer, const std::string& node_id, const std::string& addr, int metrics_port);
  // The node behind `peer` was accepted: listed from now on (when it serves metrics).
  void admit(const std::string& peer);
  // Takes a node off the list (e.g. it left for good).
  void remove_node(const std::string& node_id);

  // The http_sd JSON document.
  std::string json() const;

 private:
  struct node {
    std::string addr;
    int port = 0;
  };
  const std::string job_id_;
  mutable std::mutex mu_;
  std::string coord_host_;
  int coord_port_ = 0;
  std::map<std::string, std::pair<std::string, node>> pending_;  // peer -> (node id, endpoint)
  std::map<std::string, node> nodes_;                            // node id -> endpoint
};

}  // namespace dtactor
