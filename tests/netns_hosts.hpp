#pragma once
// Separate hosts on this one machine, for tests and benchmarks: Linux
// network namespaces, each with one interface (eth0, an address in
// 198.18.0.0/15, the range set aside for benchmark networks) on a test
// switch (a bridge in a namespace of its own). No namespace has a route
// anywhere else: all traffic stays between these hosts. Faults:
//  - cut(h): h's switch port passes nothing, either way: nothing arrives,
//    nothing is reset, new connections time out; TCP's queued data arrives
//    after heal(h). The link keeps its carrier, as a host cut off beyond its
//    own switch sees it (taking the veth down would tell the host's kernel
//    at once, and its sockets would fail). Done with a tbf that drops every
//    packet (a burst of 1 byte): tc's classifiers and actions are not
//    available here, netem neither;
//  - cut_one_way(from, to): from's packets to `to` go to a MAC nobody has
//    (a permanent neighbour entry), the other direction still works;
//  - cap(h, "100mbit"): tbf on both directions of h's link (netem is not
//    available here).
// Needs root and iproute2; make() says in one line why it cannot.
// Namespace and interface names carry this process's pid, so tests running
// at once (ctest -j2) never share a switch.
#include <signal.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace dtactor::testing {

class test_network {
 public:
  // Runs a command line; true when it exited 0.
  static bool sh(const std::string& cmd) { return std::system((cmd + " >/dev/null 2>&1").c_str()) == 0; }

  static std::optional<test_network> make(int hosts, std::string* why) {
    if (::geteuid() != 0) {
      *why = "separate hosts need root (network namespaces)";
      return std::nullopt;
    }
    if (!sh("command -v ip") || !sh("command -v tc")) {
      *why = "separate hosts need iproute2 (ip, tc)";
      return std::nullopt;
    }
    sweep_stale();
    test_network n;
    n.tag_ = "dt" + std::to_string(::getpid());
    n.hosts_ = hosts;
    n.made_ = true;
    const std::string sw = n.switch_ns();
    if (!sh("ip netns add " + sw) || !sh("ip -n " + sw + " link add br0 type bridge") || !sh("ip -n " + sw + " link set br0 up")) {
      *why = "cannot make network namespaces here (ip netns add failed)";
      return std::nullopt;
    }
    for (int h = 0; h < hosts; ++h) {
      const std::string ns = n.ns(h), a = n.tag_ + "a" + std::to_string(h), b = n.port(h);
      if (!sh("ip netns add " + ns) || !sh("ip link add " + a + " type veth peer name " + b) || !sh("ip link set " + a + " netns " + ns) ||
          !sh("ip link set " + b + " netns " + sw) || !sh("ip -n " + ns + " link set " + a + " name eth0") ||
          !sh("ip -n " + ns + " addr add " + n.addr(h) + "/24 dev eth0") || !sh("ip -n " + ns + " link set eth0 up") ||
          !sh("ip -n " + ns + " link set lo up") || !sh("ip -n " + sw + " link set " + b + " master br0") ||
          !sh("ip -n " + sw + " link set " + b + " up")) {
        *why = "cannot wire host " + std::to_string(h) + " to the test switch (veth/bridge)";
        return std::nullopt;
      }
    }
    return n;
  }

  test_network(test_network&& o) noexcept : tag_(o.tag_), caps_(o.caps_), hosts_(o.hosts_), made_(o.made_) { o.made_ = false; }
  test_network(const test_network&) = delete;
  ~test_network() {
    if (!made_) return;
    for (int h = 0; h < hosts_; ++h) sh("ip netns del " + ns(h));
    sh("ip netns del " + switch_ns());
  }

  // Namespaces a test process killed mid-test left behind (their pid is gone).
  static void sweep_stale() {
    FILE* p = ::popen("ip netns list 2>/dev/null", "r");
    if (!p) return;
    char line[256];
    std::vector<std::string> stale;
    while (std::fgets(line, sizeof line, p)) {
      std::string name(line);
      name = name.substr(0, name.find_first_of(" \n"));
      if (name.rfind("dt", 0) != 0) continue;
      size_t i = 2;
      while (i < name.size() && std::isdigit(static_cast<unsigned char>(name[i]))) ++i;
      if (i == 2 || i == name.size() || (name.compare(i, 2, "sw") != 0 && name[i] != 'h')) continue;
      const long pid = std::strtol(name.substr(2, i - 2).c_str(), nullptr, 10);
      if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) stale.push_back(name);
    }
    ::pclose(p);
    for (const auto& n : stale) sh("ip netns del " + n);
  }

  int hosts() const { return hosts_; }
  std::string ns(int h) const { return tag_ + "h" + std::to_string(h); }
  std::string switch_ns() const { return tag_ + "sw"; }
  std::string port(int h) const { return tag_ + "p" + std::to_string(h); }
  std::string addr(int h) const { return "198.18.0." + std::to_string(h + 1); }
  // Prepended to a command to run it on host h (same pid: ip execs it).
  std::vector<std::string> on(int h) const { return {"/usr/sbin/ip", "netns", "exec", ns(h)}; }

  bool cut(int h) const {
    const std::string drop = " root tbf rate 8bit burst 1 limit 1";
    return sh("ip netns exec " + switch_ns() + " tc qdisc replace dev " + port(h) + drop) && sh("ip netns exec " + ns(h) + " tc qdisc replace dev eth0" + drop);
  }
  bool heal(int h) const {
    if (caps_.count(h)) return cap(h, caps_.at(h));
    return sh("ip netns exec " + switch_ns() + " tc qdisc del dev " + port(h) + " root") && sh("ip netns exec " + ns(h) + " tc qdisc del dev eth0 root");
  }
  bool cut_one_way(int from, int to) const {
    return sh("ip -n " + ns(from) + " neigh replace " + addr(to) + " lladdr 02:00:00:00:de:ad dev eth0 nud permanent");
  }
  bool heal_one_way(int from, int to) const { return sh("ip -n " + ns(from) + " neigh del " + addr(to) + " dev eth0"); }
  // Caps both directions of h's link ("100mbit", "1gbit").
  bool cap(int h, const std::string& rate) {
    caps_[h] = rate;
    return static_cast<const test_network*>(this)->cap(h, rate);
  }
  bool cap(int h, const std::string& rate) const {
    const std::string tbf = " root tbf rate " + rate + " burst 256kb latency 50ms";
    return sh("ip netns exec " + ns(h) + " tc qdisc replace dev eth0" + tbf) && sh("ip netns exec " + switch_ns() + " tc qdisc replace dev " + port(h) + tbf);
  }

 private:
  test_network() = default;
  std::string tag_;
  std::map<int, std::string> caps_;
  int hosts_ = 0;
  bool made_ = false;
};

}  // namespace dtactor::testing
