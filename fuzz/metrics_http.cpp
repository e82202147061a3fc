// The /metrics HTTP server (monitoring/metrics.hpp): every coordinator and
// node serves Prometheus on a port anyone who reaches it may send bytes to;
// the coordinator also serves /sd (service discovery). The input is the
// request as read (the server reads at most 16 KiB). Properties: every
// request gets one well-formed reply whose Content-Length is its body's.
#include <algorithm>

#include "fuzz/fuzz_util.hpp"
#include "monitoring/metrics.hpp"
#include "monitoring/service_discovery.hpp"

using namespace dtactor;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static metrics* m = [] {
    auto* x = new metrics("job-fuzz");
    static sd_targets sd("job-fuzz");
    sd.set_coordinator("127.0.0.1", 9400);
    sd.note_registration("peer-0", "node-a", "10.0.0.2", 9401);
    sd.admit("peer-0");
    x->add_route("/sd", "application/json", [] { return sd.json(); });
    x->step().Set(42);
    return x;
  }();
  const std::string request(reinterpret_cast<const char*>(data), std::min<size_t>(size, 16384 + 2048));
  const std::string reply = m->http_reply(request);
  const auto head_end = reply.find("\r\n\r\n");
  if (reply.rfind("HTTP/1.1 ", 0) != 0 || head_end == std::string::npos) fuzz::fail("a reply that is not HTTP/1.1");
  const auto cl = reply.find("Content-Length: ");
  if (cl == std::string::npos || cl > head_end) fuzz::fail("a reply without Content-Length");
  const auto length = std::stoull(reply.substr(cl + 16, reply.find("\r\n", cl) - cl - 16));
  // The method as the server reads it: the request line up to its first space.
  const std::string line = request.substr(0, request.find_first_of("\r\n"));
  const bool head = line.substr(0, line.find(' ')) == "HEAD";
  if (!head && length != reply.size() - head_end - 4) fuzz::fail("Content-Length is not the body's");
  return 0;
}
