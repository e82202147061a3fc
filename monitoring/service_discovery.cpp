#include "monitoring/service_discovery.hpp"

#include <nlohmann/json.hpp>

namespace dtactor {

namespace {

// IPv6 literals need brackets in HOST:PORT.
std::string host_port(const std::string& host, int port) {
  const bool v6 = host.find(':') != std::string::npos && host.front() != '[';
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

}  // namespace

void sd_targets::set_coordinator(const std::string& host, int port) {
  std::lock_guard<std::mutex> lock(mu_);
  coord_host_ = host;
  coord_port_ = port;
}

void sd_targets::note_registration(const std::string& peer, const std::string& node_id, const std::string& addr, int metrics_port) {
  std::lock_guard<std::mutex> lock(mu_);
  pending_[peer] = {node_id, node{addr, metrics_port}};
}

void sd_targets::admit(const std::string& peer) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pending_.find(peer);
  if (it == pending_.end()) return;
  nodes_[it->second.first] = it->second.second;
  pending_.erase(it);
}

void sd_targets::remove_node(const std::string& node_id) {
  std::lock_guard<std::mutex> lock(mu_);
  nodes_.erase(node_id);
}

std::string sd_targets::json() const {
  std::lock_guard<std::mutex> lock(mu_);
  nlohmann::json out = nlohmann::json::array();
  if (!coord_host_.empty() && coord_port_ > 0)
    out.push_back({{"targets", {host_port(coord_host_, coord_port_)}}, {"labels", {{"job", job_id_}, {"role", "coordinator"}}}});
  for (const auto& [id, n] : nodes_) {
    if (n.addr.empty() || n.port <= 0) continue;
    out.push_back({{"targets", {host_port(n.addr, n.port)}}, {"labels", {{"job", job_id_}, {"role", "node"}, {"node", id}}}});
  }
  return out.dump() + "\n";
}

}  // namespace dtactor
