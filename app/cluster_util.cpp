#include "app/cluster_util.hpp"

#include "base/process.hpp"

#include <algorithm>
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cctype>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "base/hash.hpp"

namespace dtactor {

result<tcp_endpoint> parse_tcp_endpoint(const std::string& endpoint, const std::string& what, bool free_port_allowed) {
  const std::string prefix = "tcp://";
  auto bad = [&](const std::string& why) { return make_error(what + " '" + endpoint + "' is not a tcp://HOST:PORT address: " + why); };
  if (endpoint.rfind(prefix, 0) != 0) return bad("it must start with tcp://");
  const std::string rest = endpoint.substr(prefix.size());
  const auto colon = rest.rfind(':');
  if (colon == std::string::npos || colon == 0) return bad("missing host or port");
  tcp_endpoint e;
  e.host = rest.substr(0, colon);
  if (e.host.size() > 2 && e.host.front() == '[' && e.host.back() == ']') e.host = e.host.substr(1, e.host.size() - 2);
  const std::string port = rest.substr(colon + 1);
  char* end = nullptr;
  const long p = std::strtol(port.c_str(), &end, 10);
  const long lowest = free_port_allowed ? 0 : 1;
  if (port.empty() || *end != '\0' || p < lowest || p > 65535) return bad(free_port_allowed ? "port must be 0..65535 (0: a free port)" : "port must be 1..65535");
  e.port = static_cast<int>(p);
  return e;
}

result<std::vector<tcp_endpoint>> parse_tcp_endpoints(const std::string& endpoints, const std::string& what) {
  std::vector<tcp_endpoint> out;
  size_t at = 0;
  while (at <= endpoints.size()) {
    const size_t comma = std::min(endpoints.find(',', at), endpoints.size());
    auto e = parse_tcp_endpoint(endpoints.substr(at, comma - at), what);
    if (!e) return e.err();
    out.push_back(e.value());
    at = comma + 1;
  }
  if (out.size() > 8) return make_error(what + " names " + std::to_string(out.size()) + " addresses; at most 8 (a coordinator and its standbys)");
  return out;
}

std::string resolution_error(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (res) ::freeaddrinfo(res);
  if (rc == 0 && res) return {};
  return "the coordinator's host name '" + host + "' does not resolve (" + (rc != 0 ? ::gai_strerror(rc) : "no address") +
         "); check --coordinator (an IP address works too)";
}

result<std::string> local_address_towards(const std::string& host, int port) {
  if (auto why = resolution_error(host, port); !why.empty()) return make_error(why);
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res) return make_error(resolution_error(host, port));
  std::string out;
  int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
  if (fd >= 0) {
    // connect() on a UDP socket only picks the route and source address.
    if (::connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
      sockaddr_in local{};
      socklen_t len = sizeof local;
      if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
        char buf[INET_ADDRSTRLEN];
        if (::inet_ntop(AF_INET, &local.sin_addr, buf, sizeof buf)) out = buf;
      }
    }
    ::close(fd);
  }
  ::freeaddrinfo(res);
  if (out.empty()) return make_error("no route from this machine to the coordinator at " + host + "; set --advertise-addr to this machine's address");
  return out;
}

namespace {

// Letters, digits, '-', '_' and '.' kept; anything else becomes '_'.
std::string file_safe(const std::string& s) {
  std::string out;
  for (char c : s) out += std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.' ? c : '_';
  return out;
}

}  // namespace

result<node_id_claim> claim_node_id(const std::string& wanted, bool explicit_id, const std::string& coordinator) {
  std::error_code ec;
  const auto dir = std::filesystem::temp_directory_path(ec) / "dtactor-node-ids";
  std::filesystem::create_directories(dir, ec);
  // Every user's nodes claim ids here.
  std::filesystem::permissions(dir, std::filesystem::perms::all | std::filesystem::perms::sticky_bit, ec);
  // The coordinator's address names one coordinator only within a network
  // namespace (separate "hosts" on one machine reuse addresses).
  const std::string where = coordinator + " " + net_namespace();
  const std::string job = file_safe(coordinator) + "_" + hex64(hash64(where.data(), where.size())).substr(0, 8);
  auto path = [&](const std::string& id) { return (dir / (job + "." + hex64(hash64(id.data(), id.size())).substr(0, 8) + "." + file_safe(id))).string(); };
  const std::string what = "dtactor node of " + coordinator;
  node_id_claim c;
  auto first = file_lock::try_acquire(path(wanted), what + " as '" + wanted + "'");
  if (first) {
    c.id = wanted;
    c.lock = std::move(first.value());
    return c;
  }
  if (first.code() != errc::busy) {
    // The lock directory is unusable (read-only /tmp): the coordinator still
    // refuses a second live process under one id.
    c.id = wanted;
    return c;
  }
  if (explicit_id)
    return make_error("node id '" + wanted + "' is already used by another node of this job on this machine (held by " + first.message() +
                      "); give every node its own --node-id");
  for (int i = 2; i <= 1024; ++i) {
    const std::string id = wanted + "-" + std::to_string(i);
    auto l = file_lock::try_acquire(path(id), what + " as '" + id + "'");
    if (!l) continue;
    c.id = id;
    c.lock = std::move(l.value());
    c.note = "another node of this job on this machine is '" + wanted + "'; this one is '" + id + "' (--node-id names a node)";
    return c;
  }
  return make_error("no free node id on this machine for '" + wanted + "'; give this node a --node-id");
}

std::string host_name() {
  char buf[HOST_NAME_MAX + 1] = {0};
  if (::gethostname(buf, sizeof buf - 1) != 0 || !buf[0]) return "node";
  return buf;
}

std::string job_id_for(const std::string& run_dir) {
  std::error_code ec;
  auto abs = std::filesystem::weakly_canonical(std::filesystem::absolute(run_dir, ec), ec).string();
  if (abs.empty()) abs = run_dir;
  return "job-" + hex64(hash64(abs.data(), abs.size())).substr(0, 12);
}

}  // namespace dtactor
