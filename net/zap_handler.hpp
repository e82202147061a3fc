#pragma once
// A ZAP handler (ZeroMQ RFC 27) for one ZeroMQ context: a thread of its own
// that answers libzmq's authentication requests on inproc://zeromq.zap.01
// and admits CURVE clients whose public key is in the allow-list, nothing
// else (no NULL or PLAIN peer, no other key). Create it before the
// context's first CURVE server socket binds; destroy it before the context
// is closed. Used by zmq_bridge and rendezvous_store when a job key is set.
#include <atomic>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "dtactor/result.hpp"

namespace zmq {
class context_t;
class socket_t;
}  // namespace zmq

namespace dtactor {

// The answer to one ZAP request (RFC 27: version, request id, domain,
// address, identity, mechanism, credentials...): a CURVE client whose public
// key is in `allowed` is admitted, anything else refused. Pure, so that the
// fuzz target (fuzz/zap_request.cpp) and tests need no sockets.
struct zap_decision {
  std::vector<std::string> reply;  // version, request id, status code, status text, user id, metadata
  bool admitted = false;
  std::string mechanism;  // as the request named it (empty: malformed)
  std::string address;    // the peer's, for the log
};
zap_decision decide_zap_request(const std::vector<std::string>& request, const std::set<std::string>& allowed);

class zap_handler {
 public:
  // `allowed`: 32-byte binary CURVE public keys. `who`: for log lines.
  static result<std::unique_ptr<zap_handler>> start(zmq::context_t& context, std::set<std::string> allowed, std::string who);
  ~zap_handler();  // stops and joins the thread, closes its socket
  zap_handler(const zap_handler&) = delete;
  zap_handler& operator=(const zap_handler&) = delete;

  uint64_t admitted() const { return admitted_.load(); }
  uint64_t refused() const { return refused_.load(); }

 private:
  zap_handler() = default;
  void run();

  std::unique_ptr<zmq::socket_t> socket_;
  std::set<std::string> allowed_;
  std::string who_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> admitted_{0}, refused_{0};
  std::thread thread_;
};

// The ZeroMQ socket options of a CURVE server / client with the job's keys
// (Z85 text). Throws zmq::error_t as socket_t::set does.
void make_curve_server(zmq::socket_t& socket, const std::string& server_secret);
void make_curve_client(zmq::socket_t& socket, const std::string& server_public, const std::string& client_public,
                       const std::string& client_secret);

}  // namespace dtactor
