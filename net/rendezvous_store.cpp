#include "net/rendezvous_store.hpp"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <thread>
#include <vector>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "base/async_log.hpp"
#include "base/log_limiter.hpp"
#include "base/printable.hpp"
#include "net/handshake_gate.hpp"
#include "net/rendezvous_protocol.hpp"
#include "net/wire.hpp"
#include "net/zap_handler.hpp"

namespace dtactor {

namespace proto = rendezvous_protocol;
using clock_type = std::chrono::steady_clock;
static_assert(proto::max_message_bytes == wire::max_control_message_bytes, "the store's frames are control frames");

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

// The generation of a key under a generation's prefix ("g12/..." -> 12).
std::optional<uint64_t> generation_of(const std::string& key) {
  if (key.size() < 3 || key[0] != 'g') return std::nullopt;
  uint64_t g = 0;
  std::size_t i = 1;
  for (; i < key.size() && i < 21 && key[i] >= '0' && key[i] <= '9'; ++i) g = g * 10 + static_cast<uint64_t>(key[i] - '0');
  if (i == 1 || i >= key.size() || key[i] != '/') return std::nullopt;
  return g;
}

}  // namespace

rendezvous_limits rendezvous_limits_for(int64_t world) {
  const auto w = static_cast<std::size_t>(std::clamp<int64_t>(world, 0, 1 << 20));
  rendezvous_limits l;
  l.max_value_bytes = std::min<std::size_t>((std::size_t{64} << 10) + 256 * w, proto::max_message_bytes - 4096);
  l.max_total_bytes = (std::size_t{8} << 20) + 256 * w * w;
  l.max_parked = 1024 + 8 * w;
  return l;
}

std::size_t rendezvous_table::parked_bytes(const parked_request& p) {
  std::size_t n = rendezvous_entry_overhead + p.peer.size() + p.id.size();
  for (const auto& k : p.keys) n += k.size();
  return n;
}

void rendezvous_table::store(const std::string& key, std::string value) {
  largest_value_ = std::max(largest_value_, value.size());
  auto [it, fresh] = kv_.try_emplace(key);
  if (fresh) bytes_ += rendezvous_entry_overhead + key.size();
  bytes_ = bytes_ - it->second.size() + value.size();
  it->second = std::move(value);
}

void rendezvous_table::erase(std::map<std::string, std::string>::iterator it) {
  bytes_ -= rendezvous_entry_overhead + it->first.size() + it->second.size();
  kv_.erase(it);
}

std::optional<uint64_t> rendezvous_table::generation_to_evict(const std::string& incoming) const {
  const auto own = generation_of(incoming);
  std::optional<uint64_t> oldest, newest = own, unplanned;
  for (const auto& [k, v] : kv_) {
    const auto g = generation_of(k);
    if (!g) continue;
    oldest = std::min(oldest.value_or(*g), *g);
    newest = std::max(newest.value_or(*g), *g);
    if (planned_ > 0 && *g > planned_ + 1 && g != own) unplanned = std::max(unplanned.value_or(*g), *g);
  }
  if (!oldest) return std::nullopt;
  if (planned_ == 0) return *oldest == *newest ? std::nullopt : oldest;
  if (*oldest < planned_) return oldest;
  return unplanned;
}

bool rendezvous_table::evict_a_generation(const std::string& incoming) {
  const auto victim = generation_to_evict(incoming);
  if (!victim) return false;
  for (auto it = kv_.begin(); it != kv_.end();) {
    auto next = std::next(it);
    if (generation_of(it->first) == victim) erase(it);
    it = next;
  }
  return true;
}

std::string rendezvous_table::make_room(const std::string& key, std::size_t value_bytes) {
  if (value_bytes > limits_.max_value_bytes)
    return "a value of " + std::to_string(value_bytes) + " bytes is over the rendezvous store's limit of " +
           std::to_string(limits_.max_value_bytes) + " bytes a value";
  auto need = [&] {
    auto it = kv_.find(key);
    const std::size_t now = it == kv_.end() ? 0 : rendezvous_entry_overhead + key.size() + it->second.size();
    return bytes_ - now + rendezvous_entry_overhead + key.size() + value_bytes;
  };
  while (need() > limits_.max_total_bytes)
    if (!evict_a_generation(key))
      return "the rendezvous store is full (" + std::to_string(bytes_) + " of " + std::to_string(limits_.max_total_bytes) + " bytes)";
  return {};
}

bool rendezvous_table::all_present(const std::vector<std::string>& keys) const {
  return std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return kv_.count(k) != 0; });
}

std::vector<rendezvous_table::message> rendezvous_table::release(time_point now) {
  std::vector<message> out;
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    if (all_present(it->keys)) {
      if (it->is_get)
        out.push_back({it->peer, it->id, "ok", kv_[it->keys[0]]});
      else
        out.push_back({it->peer, it->id, "ok"});
      bytes_ -= parked_bytes(*it);
      it = waiting_.erase(it);
    } else if (now >= it->deadline) {
      out.push_back({it->peer, it->id, "err", "timed out waiting for key '" + it->keys[0] + "' in the rendezvous store"});
      bytes_ -= parked_bytes(*it);
      it = waiting_.erase(it);
    } else {
      ++it;
    }
  }
  return out;
}

// One request being answered: who asked, what, and where the reasons go.
struct rendezvous_table::request {
  std::string peer, id, op;
  std::vector<std::string> args;
  std::string* why = nullptr;
  std::string* refused = nullptr;
  std::vector<message> reply(const std::string& status, std::vector<std::string> results = {}) const {
    message r{peer, id, status};
    for (auto& x : results) r.push_back(std::move(x));
    return {std::move(r)};
  }
};

std::vector<rendezvous_table::message> rendezvous_table::ignore(request& r, const char* reason) {
  ++malformed_;
  if (r.why) *r.why = reason;
  return {};
}

std::vector<rendezvous_table::message> rendezvous_table::refuse(request& r, std::string reason) {
  ++refused_;
  if (r.refused) *r.refused = r.op + ": " + reason;
  return r.reply("err", {std::move(reason)});
}

std::vector<rendezvous_table::message> rendezvous_table::park(request& r, bool is_get, std::vector<std::string> keys, time_point deadline) {
  parked_request p{r.peer, r.id, is_get, std::move(keys), deadline};
  const std::size_t n = parked_bytes(p);
  if (waiting_.size() >= limits_.max_parked || bytes_ + n > limits_.max_total_bytes)
    return refuse(r, "the rendezvous store has " + std::to_string(waiting_.size()) + " requests waiting, its limit");
  bytes_ += n;
  waiting_.push_back(std::move(p));
  return {};
}

// set, add and cas: the operations that store a value (within the limits).
std::optional<std::vector<rendezvous_table::message>> rendezvous_table::write(request& r) {
  auto& args = r.args;
  const auto n = args.size();
  auto put = [&](const std::string& key, std::string value, std::vector<std::string> results) -> std::vector<message> {
    if (auto full = make_room(key, value.size()); !full.empty()) return refuse(r, full);
    store(key, std::move(value));
    return r.reply("ok", std::move(results));
  };
  if (r.op == "set" && n == 2) return put(args[0], std::move(args[1]), {});
  if (r.op == "add" && n == 2) {
    int64_t delta = 0, value = 0;
    if (!parse_int64(args[1], delta)) return ignore(r, "bad add delta");
    auto it = kv_.find(args[0]);
    if (it != kv_.end() && !it->second.empty() && !parse_int64(it->second, value))
      return r.reply("err", {"key '" + args[0] + "' does not hold a number"});
    int64_t sum = 0;
    if (__builtin_add_overflow(value, delta, &sum)) return r.reply("err", {"adding " + args[1] + " to key '" + args[0] + "' overflows"});
    return put(args[0], std::to_string(sum), {std::to_string(sum)});
  }
  if (r.op == "cas" && n == 3) {
    auto it = kv_.find(args[0]);
    // TCPStore's semantics: an absent key is created only when the expected
    // value is empty; otherwise the expected value comes back.
    const bool writes = it == kv_.end() ? args[1].empty() : it->second == args[1];
    if (writes) return put(args[0], args[2], {args[2]});
    return r.reply("ok", {it == kv_.end() ? args[1] : it->second});
  }
  return std::nullopt;
}

std::vector<rendezvous_table::message> rendezvous_table::handle(message m, time_point now, std::string* why, std::string* refused) {
  request r;
  r.why = why;
  r.refused = refused;
  if (m.size() < 3) return ignore(r, "fewer than 3 frames");
  r.peer = std::move(m[0]);
  r.id = std::move(m[1]);
  r.op = std::move(m[2]);
  if (r.id.size() != proto::id_bytes) return ignore(r, "bad request id");
  r.args.assign(std::make_move_iterator(m.begin() + 3), std::make_move_iterator(m.end()));
  auto& args = r.args;
  const auto n = args.size();
  auto deadline_of = [&](const std::string& timeout_ms, bool& ok) {
    int64_t ms = 0;
    ok = parse_int64(timeout_ms, ms) && ms >= 0;
    const auto limit = ms == 0 ? timeout_ : std::min(timeout_, std::chrono::milliseconds(ms));
    return now + limit;
  };
  if (auto written = write(r)) return std::move(*written);
  if (r.op == "get" && n == 2) {
    bool ok = false;
    const auto deadline = deadline_of(args[1], ok);
    if (!ok) return ignore(r, "bad timeout");
    if (auto it = kv_.find(args[0]); it != kv_.end()) return r.reply("ok", {it->second});
    return park(r, true, {args[0]}, deadline);
  }
  if (r.op == "check") return r.reply("ok", {all_present(args) ? "1" : "0"});
  if (r.op == "del" && n == 1) {
    auto it = kv_.find(args[0]);
    if (it == kv_.end()) return r.reply("ok", {"0"});
    erase(it);
    return r.reply("ok", {"1"});
  }
  if (r.op == "num" && n == 0) return r.reply("ok", {std::to_string(kv_.size())});
  if (r.op == "wait" && n >= 1) {
    bool ok = false;
    const auto deadline = deadline_of(args[0], ok);
    if (!ok) return ignore(r, "bad timeout");
    args.erase(args.begin());
    if (args.empty() || all_present(args)) return r.reply("ok");
    return park(r, false, std::move(args), deadline);
  }
  return ignore(r, "unknown operation or wrong number of arguments");
}

struct rendezvous_store::impl {
  zmq::context_t ctx{1};
  zmq::socket_t sock{ctx, zmq::socket_type::router};
  std::unique_ptr<zap_handler> zap;  // with a key; destroyed before sock and ctx
  // libzmq's socket monitor of sock, and the gate that bounds connections in
  // their handshake (net/handshake_gate.hpp).
  zmq::socket_t monitor{ctx, zmq::socket_type::pair};
  std::optional<handshake_gate> gate;
  uint64_t shed_logged = 0;
  rendezvous_table table{std::chrono::milliseconds(0)};
  int port = 0;
  std::atomic<bool> stop{false};
  std::atomic<int64_t> world{0};  // the largest world planned (expect_world)
  std::atomic<uint64_t> generation{0};  // the newest generation planned (expect_generation)
  int64_t limits_world = 0;       // the world table's limits are for (store thread)
  // The table's figures, published by the store thread for usage().
  std::atomic<std::size_t> keys{0}, bytes{0}, largest_value{0};
  std::atomic<uint64_t> refused{0};
  log_limiter log_limit;
  std::thread thread;

  void send_all(std::vector<rendezvous_table::message> replies) {
    for (auto& r : replies) {
      zmq::multipart_t m;
      for (auto& f : r) m.addstr(std::move(f));
      // A peer gone since it asked is dropped by ROUTER silently; a full
      // queue (a peer that does not read) must not block the store either.
      try {
        m.send(sock, static_cast<int>(zmq::send_flags::dontwait));
      } catch (const zmq::error_t&) {
      }
    }
  }

  void handle(zmq::multipart_t& m) {
    rendezvous_table::message request;
    while (!m.empty()) request.push_back(m.popstr());
    std::string why, refused;
    const std::string peer = request.empty() ? std::string() : request[0];
    send_all(table.handle(std::move(request), clock_type::now(), &why, &refused));
    if (!why.empty() && table.malformed() <= static_cast<uint64_t>(max_logged))
      stderr_line("dtactor: rendezvous store: ignored a malformed request (" + why + ")" +
                  (table.malformed() == static_cast<uint64_t>(max_logged) ? "; further ones are not logged" : ""));
    if (!refused.empty())
      log_limit.log("refused", "dtactor: rendezvous store: refused a request of peer " + printable(peer.size() == 5 && peer[0] == '\0' ? "(anonymous)" : peer) +
                                   ": " + refused);
  }

  void read_monitor() {
    for (int i = 0; i < 256; ++i) {
      zmq::message_t head, where;
      if (!monitor.recv(head, zmq::recv_flags::dontwait)) return;
      if (head.more()) (void)monitor.recv(where, zmq::recv_flags::dontwait);
      if (head.size() < 6 || !gate) continue;
      uint16_t event = 0;
      uint32_t value = 0;
      std::memcpy(&event, head.data(), sizeof event);
      std::memcpy(&value, static_cast<const char*>(head.data()) + 2, sizeof value);
      if (gate->on_event(event, value, clock_type::now()) == handshake_gate::verdict::shed)
        log_limit.log("shed", "dtactor: rendezvous store: shut down a connection as it came: " + std::to_string(gate->max_pending()) +
                                  " others were in their handshake (a flood?); " + std::to_string(gate->shed()) + " so far");
    }
  }

  void run() {
    while (!stop.load()) {
      if (const int64_t w = world.load(); w > limits_world) {
        limits_world = w;
        table.set_limits(rendezvous_limits_for(w));
      }
      table.set_planned_generation(generation.load());
      zmq::pollitem_t items[] = {{static_cast<void*>(sock), 0, ZMQ_POLLIN, 0}, {static_cast<void*>(monitor), 0, ZMQ_POLLIN, 0}};
      try {
        zmq::poll(items, 2, poll_step);
        if (items[1].revents & ZMQ_POLLIN) read_monitor();
        for (int i = 0; i < 256 && (items[0].revents & ZMQ_POLLIN); ++i) {
          zmq::multipart_t m;
          if (!m.recv(sock, static_cast<int>(zmq::recv_flags::dontwait))) break;
          handle(m);
        }
      } catch (const zmq::error_t& e) {
        if (e.num() == ETERM) return;
        stderr_line(std::string("dtactor: rendezvous store: ") + e.what());
      }
      send_all(table.release(clock_type::now()));
      keys.store(table.keys());
      bytes.store(table.bytes());
      largest_value.store(table.largest_value());
      refused.store(table.refused());
    }
  }
};

rendezvous_store::rendezvous_store(std::unique_ptr<impl> im) : im_(std::move(im)) {}

rendezvous_store::~rendezvous_store() {
  im_->stop = true;
  if (im_->thread.joinable()) im_->thread.join();
}

int rendezvous_store::port() const { return im_->port; }

void rendezvous_store::expect_world(int64_t world) {
  int64_t seen = im_->world.load();
  while (world > seen && !im_->world.compare_exchange_weak(seen, world)) {
  }
}

void rendezvous_store::expect_generation(uint64_t g) {
  uint64_t seen = im_->generation.load();
  while (g > seen && !im_->generation.compare_exchange_weak(seen, g)) {
  }
}

rendezvous_store::usage_stats rendezvous_store::usage() const {
  return {im_->keys.load(), im_->bytes.load(), im_->largest_value.load(), im_->refused.load()};
}

uint64_t rendezvous_store::refused_handshakes() const { return im_->zap ? im_->zap->refused() : 0; }

result<std::unique_ptr<rendezvous_store>> rendezvous_store::start(int port, std::chrono::milliseconds timeout,
                                                                  std::shared_ptr<const job_key> key, const std::string& host) {
  auto im = std::make_unique<impl>();
  im->table = rendezvous_table(timeout);
  if (key) {
    auto zap = zap_handler::start(im->ctx, {curve_key_binary(key->client_public)}, "rendezvous store");
    if (!zap) return zap.err();
    im->zap = std::move(zap.value());
  }
  try {
    if (key) make_curve_server(im->sock, key->server_secret);
    im->sock.set(zmq::sockopt::linger, 0);
    im->sock.set(zmq::sockopt::maxmsgsize, proto::max_message_bytes);
    im->sock.set(zmq::sockopt::handshake_ivl, wire::handshake_timeout_ms);
    static std::atomic<uint64_t> monitors{0};
    const std::string monitor_ep = "inproc://dtactor-store-monitor-" + std::to_string(monitors.fetch_add(1));
    if (zmq_socket_monitor(im->sock.handle(), monitor_ep.c_str(), handshake_gate::monitored_events()) != 0) throw zmq::error_t();
    im->monitor.set(zmq::sockopt::linger, 0);
    im->monitor.connect(monitor_ep);
    im->sock.bind("tcp://" + host + ":" + std::to_string(port));
    const std::string ep = im->sock.get(zmq::sockopt::last_endpoint);
    im->port = std::stoi(ep.substr(ep.rfind(':') + 1));
    im->gate.emplace(wire::max_pending_handshakes, wire::max_pending_handshakes_per_address, im->port, std::chrono::milliseconds(wire::handshake_timeout_ms));
  } catch (const std::exception& e) {
    return make_error("cannot start the rendezvous store on port " + std::to_string(port) + " of " + host + ": " + e.what() +
                      (port != 0 ? " (another process may listen there)" : ""));
  }
  auto* raw = im.get();
  im->thread = std::thread([raw] { raw->run(); });
  return std::unique_ptr<rendezvous_store>(new rendezvous_store(std::move(im)));
}

}  // namespace dtactor
