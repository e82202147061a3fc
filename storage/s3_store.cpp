#include "storage/s3_store.hpp"

#include <curl/curl.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/sha.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <map>
#include <set>
#include <mutex>
#include <thread>
#include <vector>

namespace dtactor {

namespace {

std::string hex(const unsigned char* p, size_t n) {
  static const char* d = "0123456789abcdef";
  std::string out(n * 2, '0');
  for (size_t i = 0; i < n; ++i) {
    out[2 * i] = d[p[i] >> 4];
    out[2 * i + 1] = d[p[i] & 15];
  }
  return out;
}

std::string hmac(const std::string& key, const std::string& msg) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), out, &len);
  return std::string(reinterpret_cast<char*>(out), len);
}

std::string getenv_or(const char* name, const std::string& fallback = "") {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : fallback;
}

std::string trim(std::string s) {
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r' || s.back() == '\n')) s.pop_back();
  size_t i = 0;
  while (i < s.size() && (s[i] == ' ' || s[i] == '\t')) ++i;
  return s.substr(i);
}

// The text of every <tag>...</tag> in `xml`, in order (S3's responses are
// flat enough for this; entities are decoded for the few S3 uses).
std::vector<std::string> xml_all(const std::string& xml, const std::string& tag) {
  std::vector<std::string> out;
  const std::string open = "<" + tag + ">", close = "</" + tag + ">";
  for (size_t at = xml.find(open); at != std::string::npos; at = xml.find(open, at)) {
    const size_t b = at + open.size(), e = xml.find(close, b);
    if (e == std::string::npos) break;
    std::string v = xml.substr(b, e - b);
    for (const auto& [ent, ch] : std::vector<std::pair<std::string, std::string>>{{"&quot;", "\""}, {"&apos;", "'"}, {"&lt;", "<"}, {"&gt;", ">"}, {"&amp;", "&"}})
      for (size_t p = v.find(ent); p != std::string::npos; p = v.find(ent, p + ch.size())) v.replace(p, ent.size(), ch);
    out.push_back(std::move(v));
    at = e + close.size();
  }
  return out;
}

std::string xml_first(const std::string& xml, const std::string& tag) {
  auto all = xml_all(xml, tag);
  return all.empty() ? std::string() : all[0];
}

std::string amz_date(std::time_t t) {
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%dT%H%M%SZ", &tm);
  return buf;
}

// The most an answer's body may hold when it is read into memory (a LIST
// page, an upload id, an error): a LIST page of 1,000 keys is ~300 KB. A
// longer answer is refused, not buffered (a broken or hostile endpoint must
// not exhaust memory). Ranged reads go to the caller's buffer instead.
constexpr size_t max_answer_bytes = 16u << 20;

struct response {
  long code = 0;
  std::string body;
  std::map<std::string, std::string> headers;  // lower-case names
  std::string transport_error;                 // curl's, when no HTTP response came
  bool too_long = false;                       // the body passed max_answer_bytes (refused, not retried)
};

size_t to_string(char* p, size_t size, size_t n, void* ud) {
  auto* r = static_cast<response*>(ud);
  if (r->body.size() + size * n > max_answer_bytes) {
    r->too_long = true;
    return 0;  // curl aborts the transfer
  }
  r->body.append(p, size * n);
  return size * n;
}

struct span_sink {
  char* dst;
  uint64_t cap, used = 0;
  std::string overflow;  // an error body lands here when the status is not 2xx
};

size_t to_span(char* p, size_t size, size_t n, void* ud) {
  auto* s = static_cast<span_sink*>(ud);
  const size_t len = size * n;
  const size_t fit = static_cast<size_t>(std::min<uint64_t>(len, s->cap - s->used));
  std::memcpy(s->dst + s->used, p, fit);
  s->used += fit;
  if (fit < len) {
    // More than was asked for: an error body, kept for the message, bounded.
    if (s->overflow.size() + (len - fit) > max_answer_bytes) return 0;
    s->overflow.append(p + fit, len - fit);
  }
  return len;
}

size_t to_headers(char* p, size_t size, size_t n, void* ud) {
  auto* h = static_cast<std::map<std::string, std::string>*>(ud);
  std::string line(p, size * n);
  const auto colon = line.find(':');
  if (colon != std::string::npos) {
    std::string name = line.substr(0, colon);
    std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    (*h)[name] = trim(line.substr(colon + 1));
  }
  return size * n;
}

class s3_store;

class s3_writer : public object_writer {
 public:
  s3_writer(s3_store& s, std::string name) : s_(s), name_(std::move(name)) {}
  ~s3_writer() override;
  status write(const void* data, size_t size) override;
  status commit() override;

 private:
  status flush_part(const char* data, size_t size);
  s3_store& s_;
  std::string name_;
  std::string buf_;
  std::string upload_id_;
  std::vector<std::string> etags_;
  bool done_ = false;
};

class s3_store : public object_store {
 public:
  explicit s3_store(s3_options o) : o_(std::move(o)) {
    location_ = "s3://" + o_.bucket + (o_.prefix.empty() ? "" : "/" + o_.prefix);
    if (o_.endpoint.empty()) {
      scheme_host_ = "https://" + o_.bucket + ".s3." + o_.region + ".amazonaws.com";
      host_ = o_.bucket + ".s3." + o_.region + ".amazonaws.com";
      base_path_ = "/";
    } else {
      std::string ep = o_.endpoint;
      while (!ep.empty() && ep.back() == '/') ep.pop_back();
      scheme_host_ = ep;
      const auto s = ep.find("://");
      host_ = s == std::string::npos ? ep : ep.substr(s + 3);
      base_path_ = "/" + o_.bucket + "/";
    }
  }
  ~s3_store() override {
    std::lock_guard<std::mutex> lock(mu_);
    for (CURL* c : idle_) curl_easy_cleanup(c);
  }
  const std::string& location() const override { return location_; }

  result<std::unique_ptr<object_writer>> create(const std::string& name) override {
    if (name.empty() || name.find('/') != std::string::npos) return make_error("bad object name '" + name + "'");
    return std::unique_ptr<object_writer>(std::make_unique<s3_writer>(*this, name));
  }

  result<uint64_t> read(const std::string& name, uint64_t offset, void* dst, uint64_t size) override {
    if (size == 0) return uint64_t{0};
    span_sink sink{static_cast<char*>(dst), size, 0, {}};
    auto r = request("GET", key(name), {}, {{"range", "bytes=" + std::to_string(offset) + "-" + std::to_string(offset + size - 1)}}, nullptr, 0, &sink);
    if (!r) return r.err();
    if (r->code == 416) return uint64_t{0};  // offset at or past the end
    if (r->code == 404) return make_error("cannot read '" + where(name) + "': no such object");
    if (r->code != 206 && r->code != 200) return make_error(describe("GET", name, *r, sink.overflow));
    if (r->code == 200 && offset > 0) return make_error("cannot read '" + where(name) + "': the server ignored the byte range");
    return sink.used;
  }

  result<std::optional<uint64_t>> size_of(const std::string& name) override {
    auto r = request("HEAD", key(name), {}, {}, nullptr, 0, nullptr);
    if (!r) return r.err();
    if (r->code == 404) return std::optional<uint64_t>();
    if (r->code != 200) return make_error(describe("HEAD", name, *r, ""));
    auto it = r->headers.find("content-length");
    if (it == r->headers.end()) return make_error("HEAD '" + where(name) + "': no Content-Length");
    return std::optional<uint64_t>(std::strtoull(it->second.c_str(), nullptr, 10));
  }

  result<std::vector<object_info>> list() override {
    std::vector<object_info> out;
    const std::string pre = o_.prefix.empty() ? "" : o_.prefix + "/";
    std::string token;
    std::set<std::string> tokens_seen;  // a server that hands back a token twice would page forever
    for (;;) {
      std::map<std::string, std::string> q{{"list-type", "2"}, {"prefix", pre}};
      if (!token.empty()) q["continuation-token"] = token;
      auto r = request("GET", "", q, {}, nullptr, 0, nullptr);
      if (!r) return r.err();
      if (r->code != 200) return make_error(describe("LIST", "", *r, ""));
      auto page = parse_list_objects(r->body, pre);
      for (auto& o : page.objects) out.push_back(std::move(o));
      if (!page.truncated) break;
      token = page.next_token;
      if (token.empty()) break;
      if (!tokens_seen.insert(token).second)
        return make_error("LIST " + location_ + ": the server repeated continuation token '" + token.substr(0, 64) +
                          "' after " + std::to_string(out.size()) + " objects; refusing to page forever");
    }
    std::sort(out.begin(), out.end(), [](const object_info& a, const object_info& b) { return a.name < b.name; });
    return out;
  }

  // PUT with If-None-Match: *: 412 when the object exists; 409
  // (ConditionalRequestConflict) while another such PUT of it is in flight.
  result<bool> put_if_absent(const std::string& name, std::string_view bytes) override {
    if (name.empty() || name.find('/') != std::string::npos) return make_error("bad object name '" + name + "'");
    auto r = request("PUT", key(name), {}, {{"if-none-match", "*"}}, bytes.data(), bytes.size(), nullptr);
    if (!r) return r.err();
    if (r->code == 200) return true;
    if (r->code == 412 || r->code == 409) return false;
    return make_error(describe("PUT (only where absent)", name, *r, ""));
  }

  status remove(const std::string& name) override {
    auto r = request("DELETE", key(name), {}, {}, nullptr, 0, nullptr);
    if (!r) return r.err();
    if (r->code != 204 && r->code != 200 && r->code != 404) return make_error(describe("DELETE", name, *r, ""));
    return {};
  }

  void sweep_stale_writes(const std::function<bool(const std::string&)>& stale) override {
    const std::string prefix = o_.prefix.empty() ? "" : o_.prefix + "/";
    auto r = request("GET", "", {{"uploads", ""}, {"prefix", prefix}}, {}, nullptr, 0, nullptr);
    if (!r || r->code != 200) return;
    for (const auto& u : parse_multipart_uploads(r->body, prefix))
      if (!stale || stale(u.name)) (void)request("DELETE", u.key, {{"uploadId", u.upload_id}}, {}, nullptr, 0, nullptr);
  }

  // -- for the writer ----------------------------------------------------------
  std::string key(const std::string& name) const { return o_.prefix.empty() ? name : o_.prefix + "/" + name; }
  std::string where(const std::string& name) const { return location_ + "/" + name; }
  const s3_options& opts() const { return o_; }

  std::string describe(const std::string& what, const std::string& name, const response& r, const std::string& extra_body) const {
    const std::string body = r.body + extra_body;
    const auto e = parse_s3_error(body);
    const std::string &code = e.code, &msg = e.message;
    std::string out = "S3 " + what + " " + (name.empty() ? location_ : where(name)) + " failed: HTTP " + std::to_string(r.code);
    if (!code.empty()) out += " " + code;
    if (!msg.empty()) out += " (" + msg + ")";
    if (code == "SignatureDoesNotMatch") out += "; check AWS_SECRET_ACCESS_KEY";
    else if (code == "InvalidAccessKeyId") out += "; check AWS_ACCESS_KEY_ID";
    else if (code == "NoSuchBucket") out += "; create the bucket first";
    else if (code == "AccessDenied") out += "; check the credentials' permissions";
    return out;
  }

  // One signed request, retried on transient failures. `key` is the object
  // key (empty: the bucket). A body is sent when `body` is set.
  result<response> request(const std::string& method, const std::string& key, const std::map<std::string, std::string>& query,
                           const std::map<std::string, std::string>& extra_headers, const char* body, size_t body_size, span_sink* sink) {
    const std::string payload_hash = sha256_hex(body ? body : "", body ? body_size : 0);
    std::string last;
    for (int attempt = 0; attempt < std::max(1, o_.attempts); ++attempt) {
      if (attempt > 0) std::this_thread::sleep_for(std::chrono::milliseconds(100LL << std::min(attempt - 1, 6)));
      if (sink) {
        sink->used = 0;
        sink->overflow.clear();
      }
      auto r = once(method, key, query, extra_headers, body, body_size, payload_hash, sink);
      if (r.too_long)
        return make_error("S3 " + method + " " + location_ + (key.empty() ? "" : "/" + key.substr(o_.prefix.empty() ? 0 : o_.prefix.size() + 1)) +
                          ": the answer is longer than " + std::to_string(max_answer_bytes >> 20) + " MiB; refused (is the endpoint an S3 server?)");
      const bool transient = !r.transport_error.empty() || r.code >= 500 || r.code == 429 ||
                             (r.code == 503) || parse_s3_error(r.body).code == "SlowDown" || parse_s3_error(r.body).code == "RequestTimeout";
      if (!transient) return r;
      last = !r.transport_error.empty() ? r.transport_error : describe(method, key, r, sink ? sink->overflow : "");
    }
    return make_error("S3 " + method + " " + location_ + (key.empty() ? "" : "/" + key.substr(o_.prefix.empty() ? 0 : o_.prefix.size() + 1)) +
                      ": gave up after " + std::to_string(std::max(1, o_.attempts)) + " attempts: " + last);
  }

 private:
  // The request's headers, signed (SigV4, now): host, date, payload hash,
  // session token, `extra_headers`, Authorization; and Expect and
  // Content-Type cleared. The caller frees the list.
  curl_slist* signed_headers(const std::string& method, const std::string& path, const std::string& qs,
                             const std::map<std::string, std::string>& extra_headers, const std::string& payload_hash) const {
    const std::string date = amz_date(std::time(nullptr));
    std::map<std::string, std::string> h{{"host", host_}, {"x-amz-date", date}, {"x-amz-content-sha256", payload_hash}};
    if (!o_.credentials.session_token.empty()) h["x-amz-security-token"] = o_.credentials.session_token;
    for (const auto& [k, v] : extra_headers) h[k] = v;
    std::string canon_headers, signed_names;
    for (const auto& [k, v] : h) {
      canon_headers += k + ":" + trim(v) + "\n";
      signed_names += (signed_names.empty() ? "" : ";") + k;
    }
    const std::string canonical = method + "\n" + path + "\n" + qs + "\n" + canon_headers + "\n" + signed_names + "\n" + payload_hash;
    const std::string day = date.substr(0, 8);
    const std::string scope = day + "/" + o_.region + "/s3/aws4_request";
    const std::string to_sign = "AWS4-HMAC-SHA256\n" + date + "\n" + scope + "\n" + sha256_hex(canonical.data(), canonical.size());
    const std::string auth = "AWS4-HMAC-SHA256 Credential=" + o_.credentials.access_key + "/" + scope + ", SignedHeaders=" + signed_names +
                             ", Signature=" + sigv4_signature(o_.credentials.secret_key, day, o_.region, "s3", to_sign);
    curl_slist* hl = nullptr;
    for (const auto& [k, v] : h) hl = curl_slist_append(hl, (k + ": " + v).c_str());
    hl = curl_slist_append(hl, ("Authorization: " + auth).c_str());
    hl = curl_slist_append(hl, "Expect:");
    hl = curl_slist_append(hl, "Content-Type:");
    return hl;
  }

  response once(const std::string& method, const std::string& key, const std::map<std::string, std::string>& query,
                const std::map<std::string, std::string>& extra_headers, const char* body, size_t body_size, const std::string& payload_hash,
                span_sink* sink) {
    response r;
    const std::string path = base_path_ + uri_encode(key, true);
    std::string qs;
    for (const auto& [k, v] : query) qs += (qs.empty() ? "" : "&") + uri_encode(k, false) + "=" + uri_encode(v, false);
    curl_slist* hl = signed_headers(method, path, qs, extra_headers, payload_hash);
    CURL* c = take();
    const std::string url = scheme_host_ + path + (qs.empty() ? "" : "?" + qs);
    curl_easy_setopt(c, CURLOPT_URL, url.c_str());
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, hl);
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method.c_str());
    curl_easy_setopt(c, CURLOPT_NOBODY, method == "HEAD" ? 1L : 0L);
    if (body) {
      curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
      curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(body_size));
    }
    curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, to_headers);
    curl_easy_setopt(c, CURLOPT_HEADERDATA, &r.headers);
    if (sink) {
      curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, to_span);
      curl_easy_setopt(c, CURLOPT_WRITEDATA, sink);
    } else {
      curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, to_string);
      curl_easy_setopt(c, CURLOPT_WRITEDATA, &r);
    }
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, 10000L);
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_LIMIT, 1L);  // a stalled transfer is dropped after 60 s and retried
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_TIME, 60L);
    const CURLcode rc = curl_easy_perform(c);
    if (r.too_long) r.body.clear();
    if (rc != CURLE_OK && !r.too_long) r.transport_error = std::string("cannot reach ") + scheme_host_ + ": " + curl_easy_strerror(rc);
    else curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &r.code);
    if (sink && (r.code < 200 || r.code >= 300)) r.body = sink->overflow + std::string(sink->dst, sink->used);
    curl_slist_free_all(hl);
    give(c, rc == CURLE_OK);
    return r;
  }

  CURL* take() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!idle_.empty()) {
        CURL* c = idle_.back();
        idle_.pop_back();
        curl_easy_reset(c);
        return c;
      }
    }
    static std::once_flag once;
    std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
    return curl_easy_init();
  }
  void give(CURL* c, bool reuse) {
    if (!reuse) {
      curl_easy_cleanup(c);
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    idle_.push_back(c);  // keeps its connection alive for the next request
  }

  s3_options o_;
  std::string location_, scheme_host_, host_, base_path_;
  std::mutex mu_;
  std::vector<CURL*> idle_;
};

s3_writer::~s3_writer() {
  if (!done_ && !upload_id_.empty()) (void)s_.request("DELETE", s_.key(name_), {{"uploadId", upload_id_}}, {}, nullptr, 0, nullptr);
}

status s3_writer::flush_part(const char* data, size_t size) {
  if (upload_id_.empty()) {
    auto r = s_.request("POST", s_.key(name_), {{"uploads", ""}}, {}, "", 0, nullptr);
    if (!r) return r.err();
    if (r->code != 200) return make_error(s_.describe("CreateMultipartUpload", name_, *r, ""));
    upload_id_ = parse_upload_id(r->body);
    if (upload_id_.empty()) return make_error("S3 CreateMultipartUpload " + s_.where(name_) + ": no UploadId in the answer");
  }
  const int number = static_cast<int>(etags_.size()) + 1;
  auto r = s_.request("PUT", s_.key(name_), {{"partNumber", std::to_string(number)}, {"uploadId", upload_id_}}, {}, data, size, nullptr);
  if (!r) return r.err();
  if (r->code != 200) return make_error(s_.describe("UploadPart", name_, *r, ""));
  auto it = r->headers.find("etag");
  if (it == r->headers.end()) return make_error("S3 UploadPart " + s_.where(name_) + ": no ETag in the answer");
  etags_.push_back(it->second);
  return {};
}

status s3_writer::write(const void* data, size_t size) {
  if (done_) return make_error("S3 write " + s_.where(name_) + ": writer already committed");
  const char* p = static_cast<const char*>(data);
  const size_t part = static_cast<size_t>(s_.opts().part_bytes);
  while (size > 0) {
    if (buf_.empty() && size >= part) {  // a whole part straight from the caller's memory
      if (auto st = flush_part(p, part); !st) return st;
      p += part;
      size -= part;
      continue;
    }
    const size_t n = std::min(size, part - buf_.size());
    buf_.append(p, n);
    p += n;
    size -= n;
    if (buf_.size() == part) {
      if (auto st = flush_part(buf_.data(), buf_.size()); !st) return st;
      buf_.clear();
    }
  }
  return {};
}

status s3_writer::commit() {
  if (done_) return make_error("S3 write " + s_.where(name_) + ": writer already committed");
  if (upload_id_.empty()) {  // small: one PUT
    auto r = s_.request("PUT", s_.key(name_), {}, {}, buf_.data(), buf_.size(), nullptr);
    if (!r) return r.err();
    if (r->code != 200) return make_error(s_.describe("PUT", name_, *r, ""));
    done_ = true;
    return {};
  }
  if (!buf_.empty()) {
    if (auto st = flush_part(buf_.data(), buf_.size()); !st) return st;
    buf_.clear();
  }
  std::string xml = "<CompleteMultipartUpload>";
  for (size_t i = 0; i < etags_.size(); ++i)
    xml += "<Part><PartNumber>" + std::to_string(i + 1) + "</PartNumber><ETag>" + etags_[i] + "</ETag></Part>";
  xml += "</CompleteMultipartUpload>";
  auto r = s_.request("POST", s_.key(name_), {{"uploadId", upload_id_}}, {}, xml.data(), xml.size(), nullptr);
  if (!r) return r.err();
  // S3 may answer 200 with an error body when the completion fails late.
  if (r->code != 200 || !parse_s3_error(r->body).code.empty()) return make_error(s_.describe("CompleteMultipartUpload", name_, *r, ""));
  done_ = true;
  return {};
}

}  // namespace

std::string sha256_hex(const void* data, size_t size) {
  unsigned char d[SHA256_DIGEST_LENGTH];
  SHA256(static_cast<const unsigned char*>(data), size, d);
  return hex(d, sizeof d);
}

std::string sigv4_signature(const std::string& secret, const std::string& date, const std::string& region, const std::string& service,
                            const std::string& string_to_sign) {
  const std::string k = hmac(hmac(hmac(hmac("AWS4" + secret, date), region), service), "aws4_request");
  const std::string sig = hmac(k, string_to_sign);
  return hex(reinterpret_cast<const unsigned char*>(sig.data()), sig.size());
}

std::string uri_encode(const std::string& s, bool path) {
  static const char* d = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : s) {
    if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_' || c == '.' || c == '~' ||
        (path && c == '/'))
      out.push_back(static_cast<char>(c));
    else {
      out.push_back('%');
      out.push_back(d[c >> 4]);
      out.push_back(d[c & 15]);
    }
  }
  return out;
}

s3_list_page parse_list_objects(const std::string& xml, const std::string& prefix) {
  s3_list_page page;
  const auto keys = xml_all(xml, "Key"), sizes = xml_all(xml, "Size");
  for (size_t i = 0; i < keys.size() && i < sizes.size(); ++i) {
    if (keys[i].compare(0, prefix.size(), prefix) != 0) continue;
    std::string name = keys[i].substr(prefix.size());
    if (name.empty() || name.find('/') != std::string::npos) continue;
    page.objects.push_back({name, std::strtoull(sizes[i].c_str(), nullptr, 10)});
  }
  page.truncated = xml_first(xml, "IsTruncated") == "true";
  page.next_token = xml_first(xml, "NextContinuationToken");
  return page;
}

s3_error_body parse_s3_error(const std::string& xml) { return {xml_first(xml, "Code"), xml_first(xml, "Message")}; }

std::string parse_upload_id(const std::string& xml) { return xml_first(xml, "UploadId"); }

std::vector<s3_upload> parse_multipart_uploads(const std::string& xml, const std::string& prefix) {
  std::vector<s3_upload> out;
  const auto keys = xml_all(xml, "Key"), ids = xml_all(xml, "UploadId");
  for (size_t i = 0; i < keys.size() && i < ids.size(); ++i) {
    // Only uploads of objects directly under the prefix are the store's:
    // whatever else a server lists is not ours to abort.
    if (keys[i].size() <= prefix.size() || keys[i].compare(0, prefix.size(), prefix) != 0) continue;
    std::string name = keys[i].substr(prefix.size());
    if (name.find('/') != std::string::npos) continue;
    out.push_back({std::move(name), keys[i], ids[i]});
  }
  return out;
}

result<std::pair<std::string, std::string>> parse_s3_url(const std::string& url) {
  if (url.rfind("s3://", 0) != 0) return make_error("'" + url + "' is not an s3:// URL");
  std::string rest = url.substr(5);
  const auto slash = rest.find('/');
  std::string bucket = rest.substr(0, slash), prefix = slash == std::string::npos ? "" : rest.substr(slash + 1);
  while (!prefix.empty() && prefix.back() == '/') prefix.pop_back();
  while (!prefix.empty() && prefix.front() == '/') prefix.erase(0, 1);
  if (bucket.size() < 3 || bucket.size() > 63) return make_error("'" + url + "': a bucket name has 3 to 63 characters");
  for (char c : bucket)
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '.'))
      return make_error("'" + url + "': a bucket name has lower-case letters, digits, '-' and '.' only");
  return std::make_pair(bucket, prefix);
}

result<s3_credentials> s3_credentials_from_environment() {
  s3_credentials c{getenv_or("AWS_ACCESS_KEY_ID"), getenv_or("AWS_SECRET_ACCESS_KEY"), getenv_or("AWS_SESSION_TOKEN")};
  if (!c.access_key.empty() && !c.secret_key.empty()) return c;
  const std::string file = getenv_or("AWS_SHARED_CREDENTIALS_FILE", getenv_or("HOME") + "/.aws/credentials");
  const std::string profile = getenv_or("AWS_PROFILE", "default");
  std::ifstream in(file);
  std::string line, section;
  while (std::getline(in, line)) {
    line = trim(line);
    if (line.empty() || line[0] == '#' || line[0] == ';') continue;
    if (line.front() == '[' && line.back() == ']') {
      section = trim(line.substr(1, line.size() - 2));
      continue;
    }
    if (section != profile) continue;
    const auto eq = line.find('=');
    if (eq == std::string::npos) continue;
    const std::string k = trim(line.substr(0, eq)), v = trim(line.substr(eq + 1));
    if (k == "aws_access_key_id") c.access_key = v;
    else if (k == "aws_secret_access_key") c.secret_key = v;
    else if (k == "aws_session_token") c.session_token = v;
  }
  if (c.access_key.empty() || c.secret_key.empty())
    return make_error("no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or profile '" + profile + "' in " + file);
  return c;
}

result<s3_options> s3_options_for(const std::string& url, const std::string& endpoint) {
  auto bp = parse_s3_url(url);
  if (!bp) return bp.err();
  auto creds = s3_credentials_from_environment();
  if (!creds) return creds.err();
  s3_options o;
  o.bucket = bp->first;
  o.prefix = bp->second;
  o.credentials = std::move(creds.value());
  o.region = getenv_or("AWS_REGION", getenv_or("AWS_DEFAULT_REGION", "us-east-1"));
  o.endpoint = endpoint.empty() ? getenv_or("AWS_ENDPOINT_URL") : endpoint;
  if (!o.endpoint.empty() && o.endpoint.rfind("http://", 0) != 0 && o.endpoint.rfind("https://", 0) != 0)
    return make_error("S3 endpoint '" + o.endpoint + "' must start with http:// or https://");
  return o;
}

result<std::unique_ptr<object_store>> open_s3_store(s3_options options) {
  if (options.part_bytes < (5ull << 20)) return make_error("S3 part size must be at least 5 MiB");
  auto store = std::make_unique<s3_store>(std::move(options));
  // Prove the bucket is there and the credentials work: one list.
  auto probe = store->list();
  if (!probe) return probe.err();
  return std::unique_ptr<object_store>(std::move(store));
}

status s3_create_bucket(const s3_options& options) {
  s3_store store(options);
  auto r = store.request("PUT", "", {}, {}, "", 0, nullptr);
  if (!r) return r.err();
  if (r->code != 200 && parse_s3_error(r->body).code != "BucketAlreadyOwnedByYou") return make_error(store.describe("CreateBucket", "", *r, ""));
  return {};
}

}  // namespace dtactor
