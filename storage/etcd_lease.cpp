// The leader lease in etcd (leader_lease.hpp), over etcd v3's JSON gateway:
// a lease with a TTL, and a leader key created only where absent, attached
// to it. The epoch is the key's create revision.
#include <curl/curl.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <optional>

#include "base/printable.hpp"
#include "storage/leader_lease.hpp"

namespace dtactor {

using json = nlohmann::json;

namespace {

size_t append_body(char* p, size_t size, size_t n, void* out) {
  static_cast<std::string*>(out)->append(p, size * n);
  return size * n;
}

// etcd's JSON gateway writes 64-bit numbers as strings.
int64_t number_of(const json& j, const char* key) {
  if (!j.contains(key)) return 0;
  const json& v = j.at(key);
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_string()) return std::strtoll(v.get<std::string>().c_str(), nullptr, 10);
  return 0;
}

std::string base64(const std::string& in) {
  static const char* t = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    const uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8) | uint8_t(in[i + 2]);
    out += {t[v >> 18], t[(v >> 12) & 63], t[(v >> 6) & 63], t[v & 63]};
  }
  if (i + 1 == in.size()) {
    const uint32_t v = uint8_t(in[i]) << 16;
    out += {t[v >> 18], t[(v >> 12) & 63], '=', '='};
  } else if (i + 2 == in.size()) {
    const uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8);
    out += {t[v >> 18], t[(v >> 12) & 63], t[(v >> 6) & 63], '='};
  }
  return out;
}

std::string unbase64(const std::string& in) {
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    int v = c >= 'A' && c <= 'Z' ? c - 'A' : c >= 'a' && c <= 'z' ? c - 'a' + 26 : c >= '0' && c <= '9' ? c - '0' + 52 : c == '+' ? 62 : c == '/' ? 63 : -1;
    if (v < 0) continue;
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((acc >> bits) & 0xff);
    }
  }
  return out;
}

class etcd_lease final : public leader_lease {
 public:
  etcd_lease(std::string host_port, std::string prefix, lease_options o)
      : base_("http://" + host_port), key_(prefix + "/leader"), o_(std::move(o)) {}

  result<lease_claim> try_acquire(const lease_holder& me) override {
    const int64_t ttl_s = std::max<int64_t>(2, static_cast<int64_t>(std::ceil(o_.ttl.count() / 1000.0)));
    auto grant = post("/v3/lease/grant", {{"TTL", ttl_s}});
    if (!grant) return grant.err();
    const int64_t id = number_of(*grant, "ID");
    if (id == 0) return make_error("leader lease: etcd at " + base_ + " granted no lease: " + printable(grant->dump()));
    const std::string value = json{{"holder", me.holder}, {"address", me.address}}.dump();
    const json create_if_absent = {
        {"compare", {{{"key", base64(key_)}, {"target", "CREATE"}, {"create_revision", "0"}}}},
        {"success", {{{"request_put", {{"key", base64(key_)}, {"value", base64(value)}, {"lease", std::to_string(id)}}}}}},
        {"failure", {{{"request_range", {{"key", base64(key_)}}}}}}};
    auto txn = post("/v3/kv/txn", create_if_absent);
    if (!txn) return txn.err();
    if (!txn->value("succeeded", false)) {
      (void)post("/v3/lease/revoke", {{"ID", std::to_string(id)}});
      auto cur = current();
      if (!cur) return cur.err();
      return lease_claim{false, *cur};
    }
    lease_holder mine = me;
    mine.epoch = static_cast<uint64_t>(number_of(txn->value("header", json::object()), "revision"));
    held_ = mine;
    lease_id_ = id;
    return lease_claim{true, mine};
  }

  result<renewal> renew() override {
    if (!held_) return make_error("leader lease: renewed without holding it");
    auto alive = post("/v3/lease/keepalive", {{"ID", std::to_string(lease_id_)}});
    if (!alive) return alive.err();
    const json r = alive->contains("result") ? alive->at("result") : *alive;
    auto cur = current();
    if (!cur) return cur.err();
    if (number_of(r, "TTL") <= 0 || cur->epoch != held_->epoch) {
      held_.reset();
      return renewal::deposed;
    }
    return renewal::renewed;
  }

  // The server, not this process's clock, expires an etcd lease: while it
  // kept ours alive, the leader key is still ours and nobody else took it.
  result<std::optional<uint64_t>> reclaim() override {
    auto r = renew();
    if (!r) return r.err();
    if (*r == renewal::deposed) return std::optional<uint64_t>();
    return std::optional<uint64_t>(held_->epoch);
  }

  result<lease_holder> current() override {
    auto range = post("/v3/kv/range", {{"key", base64(key_)}});
    if (!range) return range.err();
    lease_holder h;
    if (!range->contains("kvs") || range->at("kvs").empty()) return h;
    const json& kv = range->at("kvs").at(0);
    h.epoch = static_cast<uint64_t>(number_of(kv, "create_revision"));
    const json v = json::parse(unbase64(kv.value("value", "")), nullptr, false);
    if (v.is_object()) {
      h.holder = v.value("holder", "");
      h.address = v.value("address", "");
    }
    return h;
  }

  status release() override {
    if (!held_) return {};
    held_.reset();
    auto r = post("/v3/lease/revoke", {{"ID", std::to_string(lease_id_)}});
    if (!r) return r.err();
    return {};
  }

 private:
  // One POST of `body` to the gateway; its JSON answer, or one line.
  result<json> post(const std::string& path, const json& body) {
    CURL* c = curl_easy_init();
    if (!c) return make_error("leader lease: curl_easy_init failed");
    std::string answer;
    const std::string text = body.dump();
    const std::string url = base_ + path;
    curl_slist* headers = curl_slist_append(nullptr, "Content-Type: application/json");
    curl_easy_setopt(c, CURLOPT_URL, url.c_str());
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, text.c_str());
    curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, static_cast<long>(text.size()));
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, append_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &answer);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_NOPROXY, "*");
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, static_cast<long>(o_.request_timeout.count()));
    const CURLcode rc = curl_easy_perform(c);
    long code = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
    curl_slist_free_all(headers);
    curl_easy_cleanup(c);
    if (rc != CURLE_OK) return make_error("leader lease: etcd at " + base_ + ": " + curl_easy_strerror(rc));
    json j = json::parse(answer, nullptr, false);
    if (code != 200 || !j.is_object())
      return make_error("leader lease: etcd at " + base_ + path + " answered " + std::to_string(code) + ": " + printable(answer));
    return j;
  }

  std::string base_, key_;
  lease_options o_;
  std::optional<lease_holder> held_;
  int64_t lease_id_ = 0;
};

}  // namespace

result<std::unique_ptr<leader_lease>> open_etcd_lease(const std::string& host_port, const std::string& prefix, lease_options o) {
  static const bool once = [] { return curl_global_init(CURL_GLOBAL_DEFAULT) == CURLE_OK; }();
  if (!once) return make_error("leader lease: libcurl could not start");
  return std::unique_ptr<leader_lease>(std::make_unique<etcd_lease>(host_port, prefix, std::move(o)));
}

}  // namespace dtactor
