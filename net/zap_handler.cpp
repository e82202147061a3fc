#include "net/zap_handler.hpp"

#include <cstdio>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "base/async_log.hpp"

namespace dtactor {

namespace {

constexpr const char* zap_endpoint = "inproc://zeromq.zap.01";
// How soon the thread sees stop: the only bound on the destructor's wait.
constexpr std::chrono::milliseconds poll_step{100};
constexpr uint64_t max_logged = 10;

}  // namespace

result<std::unique_ptr<zap_handler>> zap_handler::start(zmq::context_t& context, std::set<std::string> allowed, std::string who) {
  std::unique_ptr<zap_handler> h(new zap_handler());
  h->allowed_ = std::move(allowed);
  h->who_ = std::move(who);
  try {
    h->socket_ = std::make_unique<zmq::socket_t>(context, zmq::socket_type::rep);
    h->socket_->set(zmq::sockopt::linger, 0);
    h->socket_->bind(zap_endpoint);
  } catch (const zmq::error_t& e) {
    return make_error(h->who_ + ": cannot start the ZAP handler on " + zap_endpoint + ": " + e.what());
  }
  // Thread creation orders the socket's setup before its use there.
  auto* raw = h.get();
  h->thread_ = std::thread([raw] { raw->run(); });
  return h;
}

zap_handler::~zap_handler() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
  socket_.reset();
}

void zap_handler::run() {
  while (!stop_.load()) {
    zmq::pollitem_t item{static_cast<void*>(*socket_), 0, ZMQ_POLLIN, 0};
    try {
      zmq::poll(&item, 1, poll_step);
      if (!(item.revents & ZMQ_POLLIN)) continue;
      zmq::multipart_t request;
      if (!request.recv(*socket_, static_cast<int>(zmq::recv_flags::dontwait))) continue;
      std::vector<std::string> frames;
      for (const auto& f : request) frames.push_back(f.to_string());
      const auto d = decide_zap_request(frames, allowed_);
      zmq::multipart_t reply;
      for (const auto& f : d.reply) reply.addstr(f);
      reply.send(*socket_);
      if (d.admitted) {
        admitted_.fetch_add(1);
      } else {
        const auto n = refused_.fetch_add(1) + 1;
        if (n <= max_logged)
          stderr_line("dtactor: " + who_ + ": refused a " + (d.mechanism.empty() ? std::string("malformed") : d.mechanism) + " connection from " +
                      (d.address.empty() ? std::string("?") : d.address) + ": not a client of this job (no or another job key)" +
                      (n == max_logged ? "; further refusals are counted, not logged" : ""));
      }
    } catch (const zmq::error_t& e) {
      if (e.num() == ETERM) return;
      stderr_line("dtactor: " + who_ + ": ZAP handler: " + e.what());
    }
  }
}

zap_decision decide_zap_request(const std::vector<std::string>& request, const std::set<std::string>& allowed) {
  zap_decision d;
  std::string version, request_id, credential;
  if (request.size() >= 6) {
    version = request[0];
    request_id = request[1];
    d.address = request[3];
    d.mechanism = request[5];
    if (request.size() >= 7) credential = request[6];
  }
  d.admitted = version == "1.0" && d.mechanism == "CURVE" && allowed.count(credential) != 0;
  d.reply = {"1.0", request_id, d.admitted ? "200" : "400", d.admitted ? "OK" : "not a client of this job", "", ""};
  return d;
}

void make_curve_server(zmq::socket_t& socket, const std::string& server_secret) {
  socket.set(zmq::sockopt::curve_server, true);
  socket.set(zmq::sockopt::curve_secretkey, server_secret);
  // A domain makes libzmq consult the ZAP handler for every handshake.
  socket.set(zmq::sockopt::zap_domain, "dtactor");
}

void make_curve_client(zmq::socket_t& socket, const std::string& server_public, const std::string& client_public,
                       const std::string& client_secret) {
  socket.set(zmq::sockopt::curve_serverkey, server_public);
  socket.set(zmq::sockopt::curve_publickey, client_public);
  socket.set(zmq::sockopt::curve_secretkey, client_secret);
}

}  // namespace dtactor
