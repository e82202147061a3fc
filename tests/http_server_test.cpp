// The HTTP endpoint out of file descriptors: civetweb's accept loop must not
// spin, and the waiting client is served once descriptors free.
#include "monitoring/http_server.hpp"
#include "net/zmq_bridge.hpp"  // pick_free_tcp_port

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace dtactor {
namespace {

using namespace std::chrono_literals;

TEST(HttpServer, OutOfDescriptorsTheAcceptLoopWaitsInsteadOfSpinning) {
  auto port = pick_free_tcp_port();
  ASSERT_TRUE(port);
  auto server = http_server::start("127.0.0.1", port.value(), [](const std::string&, const std::string&) { return http_response{200, "text/plain", "ok"}; });
  ASSERT_TRUE(server) << server.message();
  const int client = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(client, 0);
  timeval tv{10, 0};
  ::setsockopt(client, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  // Every descriptor taken, under a lowered soft limit: the server cannot
  // accept the client that then connects (the kernel completes it).
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &saved), 0);
  rlimit low = saved;
  low.rlim_cur = 256;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  std::vector<int> taken;
  for (int fd; (fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0;) taken.push_back(fd);
  ASSERT_EQ(errno, EMFILE);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(server.value()->port()));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(client, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  const std::string request = "GET / HTTP/1.0\r\n\r\n";
  ASSERT_EQ(::send(client, request.data(), request.size(), 0), static_cast<ssize_t>(request.size()));
  // A spinning loop fails accept() hundreds of thousands of times a second.
  const uint64_t before = http_accepts_without_descriptors();
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (http_accepts_without_descriptors() == before && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(10ms);
  const uint64_t first = http_accepts_without_descriptors();
  ASSERT_GT(first, before) << "the server never tried to accept the client";
  std::this_thread::sleep_for(1s);
  const uint64_t tries = http_accepts_without_descriptors() - first;
  for (int fd : taken) ::close(fd);
  ::setrlimit(RLIMIT_NOFILE, &saved);
  EXPECT_LE(tries, 40u) << "accept() failed " << tries << " times in a second: the accept loop spins";
  // Descriptors free: the client that waited is served.
  std::string response;
  char buf[1024];
  for (ssize_t n; (n = ::recv(client, buf, sizeof buf, 0)) > 0;) response.append(buf, static_cast<std::size_t>(n));
  ::close(client);
  EXPECT_NE(response.find("200"), std::string::npos) << response;
}

}  // namespace
}  // namespace dtactor
