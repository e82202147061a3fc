#include "app/cluster_util.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "runtime/hash.hpp"

namespace dtactor {

result<tcp_endpoint> parse_tcp_endpoint(const std::string& endpoint, const std::string& what) {
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
  if (port.empty() || *end != '\0' || p < 1 || p > 65535) return bad("port must be 1..65535");
  e.port = static_cast<int>(p);
  return e;
}

std::string local_address_towards(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res) return "";
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
  return out;
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
