#pragma once
// The HTTP endpoint of a coordinator or node (/metrics, /sd, the status
// page): civetweb, the server prometheus-cpp's Exposer is built on, used
// directly. civetweb parses the requests and serves them from a pool of
// worker threads with a time limit per request, so one slow or idle client
// holds one worker for at most `request_timeout_ms`, never the endpoint.
//
// What is served is decided by a pure function of (method, path): the
// server never sees the handlers' state, and tests call the function
// without a socket.
//
// civetweb's Debian build asks for a fixed 100 KiB thread stack, too small
// beside LibTorch's static TLS; http_server.cpp raises such requests to what
// the process's TLS needs (a program on the C++ API runs the coordinator in
// its own, torch-linked process).
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "dtactor/result.hpp"

namespace dtactor {

struct http_response {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
};

// (method, path without the query) -> the reply. Called on civetweb's
// worker threads, several at once: must be thread-safe.
using http_handler = std::function<http_response(const std::string& method, const std::string& path)>;

struct http_limits {
  // Workers: concurrent requests (idle ones cost a thread each, its 100 KiB
  // stack mapped but barely touched). A slow client holds one for at most
  // request_timeout_ms, so `workers - 1` slow clients cannot delay a scrape.
  int workers = 128;
  int request_timeout_ms = 2000;
  int max_request_bytes = 16384;  // request line and headers
};

// accept() calls that failed for want of file descriptors since the process
// started (each then waited 50 ms instead of letting civetweb spin).
uint64_t http_accepts_without_descriptors();

class http_server {
 public:
  // Serves `handler` on host:port (an IPv4 address; port 0: a free port,
  // then port() says which). Fails with one clear line when the address is
  // bad or the port taken.
  static result<std::unique_ptr<http_server>> start(const std::string& host, int port, http_handler handler, http_limits limits = {});
  ~http_server();
  http_server(const http_server&) = delete;
  http_server& operator=(const http_server&) = delete;

  int port() const { return port_; }

  struct impl;  // civetweb's context and the handler

 private:
  http_server() = default;
  std::unique_ptr<impl> impl_;
  int port_ = 0;
};

}  // namespace dtactor
