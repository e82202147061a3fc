#include "comm/rendezvous_client.hpp"

#include <c10/util/Exception.h>

#include <cerrno>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "net/rendezvous_protocol.hpp"
#include "net/zap_handler.hpp"

namespace dtactor {

namespace proto = rendezvous_protocol;

struct rendezvous_client::impl {
  std::string endpoint;
  zmq::context_t ctx{1};
  zmq::socket_t sock{ctx, zmq::socket_type::dealer};
  uint64_t next_id = 1;
};

namespace {

std::string as_string(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
std::vector<uint8_t> as_bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

std::string millis(std::chrono::milliseconds t) { return std::to_string(t.count()); }

}  // namespace

rendezvous_client::rendezvous_client(const std::string& host, int port, std::chrono::milliseconds timeout, std::shared_ptr<const job_key> key)
    : c10d::Store(timeout), im_(std::make_unique<impl>()) {
  im_->endpoint = "tcp://" + host + ":" + std::to_string(port);
  try {
    im_->sock.set(zmq::sockopt::linger, 0);
    if (key) make_curve_client(im_->sock, key->server_public, key->client_public, key->client_secret);
    im_->sock.set(zmq::sockopt::reconnect_ivl, 100);
    im_->sock.set(zmq::sockopt::reconnect_ivl_max, 1000);
    im_->sock.connect(im_->endpoint);
  } catch (const zmq::error_t& e) {
    fail(e.what());
  }
}

rendezvous_client::~rendezvous_client() = default;

void rendezvous_client::fail(const std::string& what) const {
  throw rendezvous_error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, "rendezvous store at " + im_->endpoint + ": " + what);
}

std::vector<std::string> rendezvous_client::call(const std::vector<std::string>& request, std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t id = im_->next_id++;
  const std::string id_frame = proto::encode_id(id);
  zmq::multipart_t m;
  m.addstr(id_frame);
  for (const auto& r : request) m.addstr(r);
  try {
    m.send(im_->sock);
  } catch (const zmq::error_t& e) {
    fail(request[0] + " failed: " + e.what());
  }
  using clock_type = std::chrono::steady_clock;
  const bool forever = timeout.count() == 0;
  const auto deadline = clock_type::now() + timeout;
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock_type::now());
    if (!forever && left.count() <= 0) break;
    zmq::pollitem_t item{static_cast<void*>(im_->sock), 0, ZMQ_POLLIN, 0};
    // Bounded so that a huge timeout never overflows poll's argument.
    zmq::multipart_t answer;
    try {
      zmq::poll(&item, 1, forever ? std::chrono::milliseconds(1000) : std::min(left, std::chrono::milliseconds(1000)));
      if (!(item.revents & ZMQ_POLLIN)) continue;
      if (!answer.recv(im_->sock, static_cast<int>(zmq::recv_flags::dontwait))) continue;
    } catch (const zmq::error_t& e) {
      if (e.num() == EINTR) continue;
      fail(request[0] + " failed: " + e.what());
    }
    if (answer.size() < 2) continue;
    const std::string got_id = answer.popstr();
    // The late answer to an earlier request this client gave up on.
    if (got_id != id_frame) continue;
    const std::string status = answer.popstr();
    std::vector<std::string> results;
    while (!answer.empty()) results.push_back(answer.popstr());
    if (status != "ok") fail(results.empty() ? status : results[0]);
    return results;
  }
  std::string what = request[0];
  if (request.size() > 1 && (request[0] == "get" || request[0] == "wait"))
    what += " of key '" + (request[0] == "get" ? request[1] : request.size() > 2 ? request[2] : std::string()) + "'";
  fail(what + " timed out after " + std::to_string(timeout.count()) + " ms");
}

void rendezvous_client::set(const std::string& key, const std::vector<uint8_t>& value) { call({"set", key, as_string(value)}, timeout_); }

std::vector<uint8_t> rendezvous_client::compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                                   const std::vector<uint8_t>& desired) {
  auto r = call({"cas", key, as_string(expected), as_string(desired)}, timeout_);
  if (r.size() != 1) fail("malformed compareSet answer");
  return as_bytes(r[0]);
}

std::vector<uint8_t> rendezvous_client::get(const std::string& key) {
  auto r = call({"get", key, millis(timeout_)}, timeout_);
  if (r.size() != 1) fail("malformed get answer");
  return as_bytes(r[0]);
}

int64_t rendezvous_client::add(const std::string& key, int64_t value) {
  auto r = call({"add", key, std::to_string(value)}, timeout_);
  if (r.size() != 1) fail("malformed add answer");
  try {
    return std::stoll(r[0]);
  } catch (const std::exception&) {
    fail("add answered '" + r[0] + "', not a number");
  }
}

bool rendezvous_client::deleteKey(const std::string& key) {
  auto r = call({"del", key}, timeout_);
  return r.size() == 1 && r[0] == "1";
}

bool rendezvous_client::check(const std::vector<std::string>& keys) {
  std::vector<std::string> req{"check"};
  req.insert(req.end(), keys.begin(), keys.end());
  auto r = call(req, timeout_);
  return r.size() == 1 && r[0] == "1";
}

int64_t rendezvous_client::getNumKeys() {
  auto r = call({"num"}, timeout_);
  if (r.size() != 1) fail("malformed getNumKeys answer");
  return std::stoll(r[0]);
}

void rendezvous_client::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void rendezvous_client::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  std::vector<std::string> req{"wait", millis(timeout)};
  req.insert(req.end(), keys.begin(), keys.end());
  call(req, timeout);
}

}  // namespace dtactor
