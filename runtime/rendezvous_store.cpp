#include "runtime/rendezvous_store.hpp"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <map>
#include <thread>
#include <vector>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "runtime/rendezvous_protocol.hpp"
#include "runtime/zap_handler.hpp"

namespace dtactor {

namespace proto = rendezvous_protocol;
using clock_type = std::chrono::steady_clock;

namespace {

// Upper bound on one poll: how soon stop() and parked deadlines are seen.
constexpr std::chrono::milliseconds poll_step{50};
// Malformed requests logged; beyond it they are only counted.
constexpr int max_logged = 20;

bool parse_int64(const std::string& s, int64_t& out) {
  if (s.empty() || s.size() > 20) return false;
  std::size_t i = s[0] == '-' ? 1 : 0;
  if (i == s.size()) return false;
  int64_t v = 0;
  for (; i < s.size(); ++i) {
    if (s[i] < '0' || s[i] > '9') return false;
    if (v > (INT64_MAX - (s[i] - '0')) / 10) return false;
    v = v * 10 + (s[i] - '0');
  }
  out = s[0] == '-' ? -v : v;
  return true;
}

}  // namespace

struct rendezvous_store::impl {
  struct parked {
    std::string peer;
    std::string id;
    bool is_get = false;
    std::vector<std::string> keys;
    clock_type::time_point deadline;
  };

  zmq::context_t ctx{1};
  zmq::socket_t sock{ctx, zmq::socket_type::router};
  std::unique_ptr<zap_handler> zap;  // with a key; destroyed before sock and ctx
  std::chrono::milliseconds timeout{0};
  int port = 0;
  std::atomic<bool> stop{false};
  std::thread thread;
  std::map<std::string, std::string> kv;
  std::vector<parked> waiting;
  int malformed = 0;

  void ignore(const std::string& why) {
    ++malformed;
    if (malformed <= max_logged)
      std::fprintf(stderr, "dtactor: rendezvous store: ignored a malformed request (%s)%s\n", why.c_str(),
                   malformed == max_logged ? "; further ones are not logged" : "");
  }

  void reply(const std::string& peer, const std::string& id, const std::string& status, const std::vector<std::string>& results = {}) {
    zmq::multipart_t m;
    m.addstr(peer);
    m.addstr(id);
    m.addstr(status);
    for (const auto& r : results) m.addstr(r);
    // A peer gone since it asked is dropped by ROUTER silently; a full
    // queue (a peer that does not read) must not block the store either.
    try {
      m.send(sock, static_cast<int>(zmq::send_flags::dontwait));
    } catch (const zmq::error_t&) {
    }
  }

  bool all_present(const std::vector<std::string>& keys) const {
    return std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return kv.count(k) != 0; });
  }

  // Answers the parked requests whose keys are all there, and times out the
  // ones past their deadline.
  void release(clock_type::time_point now) {
    for (auto it = waiting.begin(); it != waiting.end();) {
      if (all_present(it->keys)) {
        if (it->is_get)
          reply(it->peer, it->id, "ok", {kv[it->keys[0]]});
        else
          reply(it->peer, it->id, "ok");
        it = waiting.erase(it);
      } else if (now >= it->deadline) {
        reply(it->peer, it->id, "err", {"timed out waiting for key '" + it->keys[0] + "' in the rendezvous store"});
        it = waiting.erase(it);
      } else {
        ++it;
      }
    }
  }

  clock_type::time_point deadline_of(const std::string& timeout_ms, bool& ok) {
    int64_t ms = 0;
    ok = parse_int64(timeout_ms, ms) && ms >= 0;
    const auto limit = ms == 0 ? timeout : std::min(timeout, std::chrono::milliseconds(ms));
    return clock_type::now() + limit;
  }

  void handle(zmq::multipart_t& m) {
    if (m.size() < 3) return ignore("fewer than 3 frames");
    const std::string peer = m.popstr();
    const std::string id = m.popstr();
    if (id.size() != proto::id_bytes) return ignore("bad request id");
    const std::string op = m.popstr();
    std::vector<std::string> args;
    while (!m.empty()) args.push_back(m.popstr());
    const auto n = args.size();
    if (op == "set" && n == 2) {
      kv[args[0]] = std::move(args[1]);
      reply(peer, id, "ok");
    } else if (op == "get" && n == 2) {
      bool ok = false;
      const auto deadline = deadline_of(args[1], ok);
      if (!ok) return ignore("bad timeout");
      if (auto it = kv.find(args[0]); it != kv.end())
        reply(peer, id, "ok", {it->second});
      else
        waiting.push_back({peer, id, true, {args[0]}, deadline});
    } else if (op == "add" && n == 2) {
      int64_t delta = 0, now = 0;
      if (!parse_int64(args[1], delta)) return ignore("bad add delta");
      auto& v = kv[args[0]];
      if (!v.empty() && !parse_int64(v, now)) return reply(peer, id, "err", {"key '" + args[0] + "' does not hold a number"});
      v = std::to_string(now + delta);
      reply(peer, id, "ok", {v});
    } else if (op == "cas" && n == 3) {
      auto it = kv.find(args[0]);
      if (it == kv.end()) {
        // TCPStore's semantics: an absent key is created only when the
        // expected value is empty; otherwise the expected value comes back.
        if (args[1].empty()) kv[args[0]] = args[2];
        reply(peer, id, "ok", {args[1].empty() ? args[2] : args[1]});
      } else {
        if (it->second == args[1]) it->second = std::move(args[2]);
        reply(peer, id, "ok", {it->second});
      }
    } else if (op == "check") {
      reply(peer, id, "ok", {all_present(args) ? "1" : "0"});
    } else if (op == "del" && n == 1) {
      reply(peer, id, "ok", {kv.erase(args[0]) ? "1" : "0"});
    } else if (op == "num" && n == 0) {
      reply(peer, id, "ok", {std::to_string(kv.size())});
    } else if (op == "wait" && n >= 1) {
      bool ok = false;
      const auto deadline = deadline_of(args[0], ok);
      if (!ok) return ignore("bad timeout");
      args.erase(args.begin());
      if (all_present(args))
        reply(peer, id, "ok");
      else if (args.empty())
        reply(peer, id, "ok");
      else
        waiting.push_back({peer, id, false, std::move(args), deadline});
    } else {
      return ignore("unknown operation or wrong number of arguments");
    }
  }

  void run() {
    while (!stop.load()) {
      zmq::pollitem_t item{static_cast<void*>(sock), 0, ZMQ_POLLIN, 0};
      try {
        zmq::poll(&item, 1, poll_step);
        for (int i = 0; i < 256 && (item.revents & ZMQ_POLLIN); ++i) {
          zmq::multipart_t m;
          if (!m.recv(sock, static_cast<int>(zmq::recv_flags::dontwait))) break;
          handle(m);
        }
      } catch (const zmq::error_t& e) {
        if (e.num() == ETERM) return;
        std::fprintf(stderr, "dtactor: rendezvous store: %s\n", e.what());
      }
      release(clock_type::now());
    }
  }
};

rendezvous_store::rendezvous_store(std::unique_ptr<impl> im) : im_(std::move(im)) {}

rendezvous_store::~rendezvous_store() {
  im_->stop = true;
  if (im_->thread.joinable()) im_->thread.join();
}

int rendezvous_store::port() const { return im_->port; }

uint64_t rendezvous_store::refused_handshakes() const { return im_->zap ? im_->zap->refused() : 0; }

result<std::unique_ptr<rendezvous_store>> rendezvous_store::start(int port, std::chrono::milliseconds timeout,
                                                                  std::shared_ptr<const job_key> key) {
  auto im = std::make_unique<impl>();
  im->timeout = timeout;
  if (key) {
    auto zap = zap_handler::start(im->ctx, {curve_key_binary(key->client_public)}, "rendezvous store");
    if (!zap) return zap.err();
    im->zap = std::move(zap.value());
  }
  try {
    if (key) make_curve_server(im->sock, key->server_secret);
    im->sock.set(zmq::sockopt::linger, 0);
    im->sock.set(zmq::sockopt::maxmsgsize, proto::max_message_bytes);
    im->sock.bind("tcp://*:" + std::to_string(port));
    const std::string ep = im->sock.get(zmq::sockopt::last_endpoint);
    im->port = std::stoi(ep.substr(ep.rfind(':') + 1));
  } catch (const std::exception& e) {
    return make_error("cannot start the rendezvous store on port " + std::to_string(port) + ": " + e.what() +
                      (port != 0 ? " (another process may listen there)" : ""));
  }
  auto* raw = im.get();
  im->thread = std::thread([raw] { raw->run(); });
  return std::unique_ptr<rendezvous_store>(new rendezvous_store(std::move(im)));
}

}  // namespace dtactor
