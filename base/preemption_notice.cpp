// The cloud preemption notice watcher (base/preemption_notice.hpp).
#include "base/preemption_notice.hpp"

#include <curl/curl.h>

#include <nlohmann/json.hpp>

#include <cctype>
#include <cstdlib>
#include <cstring>
#include <ctime>

#include "base/unix_time.hpp"

namespace dtactor {

const char* to_string(cloud_kind c) {
  switch (c) {
    case cloud_kind::aws: return "aws";
    case cloud_kind::gcp: return "gcp";
    case cloud_kind::azure: return "azure";
  }
  return "?";
}

bool cloud_from_string(const std::string& s, cloud_kind& out) {
  if (s == "aws") out = cloud_kind::aws;
  else if (s == "gcp") out = cloud_kind::gcp;
  else if (s == "azure") out = cloud_kind::azure;
  else return false;
  return true;
}

namespace {

size_t append_body(char* p, size_t size, size_t n, void* user) {
  static_cast<std::string*>(user)->append(p, size * n);
  return size * n;
}

std::string trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  return s.substr(i);
}

std::string strip_slash(std::string s) {
  while (!s.empty() && s.back() == '/') s.pop_back();
  return s;
}

}  // namespace

http_call curl_http() {
  static const bool once = [] { return curl_global_init(CURL_GLOBAL_DEFAULT) == CURLE_OK; }();
  (void)once;
  return [](const std::string& method, const std::string& url, const std::vector<std::string>& headers, std::chrono::milliseconds timeout) {
    http_reply r;
    CURL* c = curl_easy_init();
    if (!c) {
      r.error = "curl_easy_init failed";
      return r;
    }
    curl_slist* hl = nullptr;
    for (const auto& h : headers) hl = curl_slist_append(hl, h.c_str());
    curl_easy_setopt(c, CURLOPT_URL, url.c_str());
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, hl);
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method.c_str());
    if (method == "PUT") {
      curl_easy_setopt(c, CURLOPT_POSTFIELDS, "");
      curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, 0L);
    }
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, append_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &r.body);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_NOPROXY, "*");
    curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 0L);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(timeout.count()));
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, static_cast<long>(timeout.count()));
    const CURLcode rc = curl_easy_perform(c);
    if (rc != CURLE_OK) r.error = std::string(curl_easy_strerror(rc));
    else curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &r.code);
    curl_slist_free_all(hl);
    curl_easy_cleanup(c);
    return r;
  };
}

std::optional<double> parse_utc_time(const std::string& in) {
  const std::string s = trim(in);
  std::tm tm{};
  const char* end = ::strptime(s.c_str(), "%Y-%m-%dT%H:%M:%S", &tm);
  double frac = 0;
  if (end) {
    if (*end == '.') {
      char* after = nullptr;
      frac = std::strtod(end, &after);
      end = after;
    }
    if (std::strcmp(end, "Z") != 0 && std::strcmp(end, "+00:00") != 0) return std::nullopt;
  } else {
    tm = {};
    end = ::strptime(s.c_str(), "%a, %d %b %Y %H:%M:%S", &tm);
    if (!end || (std::strcmp(end, " GMT") != 0 && std::strcmp(end, " UTC") != 0)) return std::nullopt;
  }
  const time_t t = ::timegm(&tm);
  if (t == static_cast<time_t>(-1)) return std::nullopt;
  return static_cast<double>(t) + frac;
}

std::optional<preemption_notice> parse_aws_instance_action(const std::string& body, double now) {
  auto j = nlohmann::json::parse(body, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("action") || !j["action"].is_string()) return std::nullopt;
  preemption_notice n;
  n.cloud = cloud_kind::aws;
  n.detail = j["action"].get<std::string>();
  n.noticed_unix_s = now;
  if (j.contains("time") && j["time"].is_string()) n.announced = j["time"].get<std::string>();
  auto t = parse_utc_time(n.announced);
  // AWS documents two minutes; a time it does not give is taken as that.
  n.announced_unix_s = t ? *t : now + 120;
  return n;
}

std::optional<preemption_notice> parse_gcp_preempted(const std::string& body, double now) {
  if (trim(body) != "TRUE") return std::nullopt;
  preemption_notice n;
  n.cloud = cloud_kind::gcp;
  n.noticed_unix_s = now;
  n.announced_unix_s = now + 30;
  n.detail = "preempted";
  return n;
}

namespace {
// A string member, or "" when it is missing or of another type (json::value
// would throw on a number where a string is expected).
std::string string_member(const nlohmann::json& o, const char* key) {
  auto it = o.find(key);
  return it != o.end() && it->is_string() ? it->get<std::string>() : std::string();
}
}  // namespace

std::optional<preemption_notice> parse_azure_events(const std::string& body, const std::string& vm_name, double now) {
  auto j = nlohmann::json::parse(body, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("Events") || !j["Events"].is_array()) return std::nullopt;
  for (const auto& e : j["Events"]) {
    if (!e.is_object() || string_member(e, "EventType") != "Preempt") continue;
    if (!vm_name.empty() && e.contains("Resources") && e["Resources"].is_array()) {
      bool ours = false;
      for (const auto& r : e["Resources"])
        if (r.is_string() && r.get<std::string>() == vm_name) ours = true;
      if (!ours) continue;
    }
    preemption_notice n;
    n.cloud = cloud_kind::azure;
    n.noticed_unix_s = now;
    n.announced = string_member(e, "NotBefore");
    n.detail = string_member(e, "EventId");
    auto t = parse_utc_time(n.announced);
    // Azure documents at least 30 s for Preempt; NotBefore is empty once started.
    n.announced_unix_s = t ? *t : now + 30;
    return n;
  }
  return std::nullopt;
}

metadata_endpoints metadata_endpoints_from(const std::function<const char*(const char*)>& getenv_fn, const std::string& azure_option) {
  metadata_endpoints ep;
  auto get = [&](const char* k) -> std::string {
    const char* v = getenv_fn(k);
    return v ? std::string(v) : std::string();
  };
  if (auto v = get("AWS_EC2_METADATA_SERVICE_ENDPOINT"); !v.empty()) ep.aws = strip_slash(v);
  // The Google libraries take a host[:port], no scheme.
  if (auto v = get("GCE_METADATA_HOST"); !v.empty()) ep.gcp = "http://" + strip_slash(v);
  if (!azure_option.empty()) ep.azure = strip_slash(azure_option);
  else if (auto v = get("DTACTOR_AZURE_METADATA_ENDPOINT"); !v.empty()) ep.azure = strip_slash(v);
  return ep;
}

// ---- metadata_poller ----

metadata_poller::metadata_poller(cloud_kind c, metadata_endpoints ep, http_call http, std::chrono::milliseconds timeout)
    : cloud_(c), ep_(std::move(ep)), http_(std::move(http)), timeout_(timeout) {}

bool metadata_poller::refresh_token(std::string& error) {
  auto r = http_("PUT", ep_.aws + "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds: 21600"}, timeout_);
  if (r.code != 200 || trim(r.body).empty()) {
    error = r.code == 0 ? r.error : "token request answered HTTP " + std::to_string(r.code);
    token_.clear();
    return false;
  }
  token_ = trim(r.body);
  token_at_ = std::chrono::steady_clock::now();
  return true;
}

bool metadata_poller::detect() {
  std::string error;
  switch (cloud_) {
    case cloud_kind::aws: return refresh_token(error);
    case cloud_kind::gcp: {
      auto r = http_("GET", ep_.gcp + "/computeMetadata/v1/instance/preempted", {"Metadata-Flavor: Google"}, timeout_);
      const auto b = trim(r.body);
      return r.code == 200 && (b == "TRUE" || b == "FALSE");
    }
    case cloud_kind::azure: {
      auto r = http_("GET", ep_.azure + "/metadata/scheduledevents?api-version=2020-07-01", {"Metadata: true"}, timeout_);
      if (r.code != 200) return false;
      auto j = nlohmann::json::parse(r.body, nullptr, false);
      return !j.is_discarded() && j.is_object() && j.contains("Events");
    }
  }
  return false;
}

metadata_poller::outcome metadata_poller::poll(double now, std::optional<preemption_notice>& notice, std::string& error) {
  notice.reset();
  switch (cloud_) {
    case cloud_kind::aws: {
      // Tokens live 6 h; a new one well before that, and at once on a 401.
      if (token_.empty() || std::chrono::steady_clock::now() - token_at_ > std::chrono::hours(5))
        if (!refresh_token(error)) return outcome::unreachable;
      auto r = http_("GET", ep_.aws + "/latest/meta-data/spot/instance-action", {"X-aws-ec2-metadata-token: " + token_}, timeout_);
      if (r.code == 401) {
        if (!refresh_token(error)) return outcome::unreachable;
        r = http_("GET", ep_.aws + "/latest/meta-data/spot/instance-action", {"X-aws-ec2-metadata-token: " + token_}, timeout_);
      }
      if (r.code == 404) return outcome::none;
      if (r.code != 200) {
        error = r.code == 0 ? r.error : "spot/instance-action answered HTTP " + std::to_string(r.code);
        return outcome::unreachable;
      }
      notice = parse_aws_instance_action(r.body, now);
      if (!notice) error = "spot/instance-action: not the documented JSON: " + r.body.substr(0, 200);
      return notice ? outcome::notice : outcome::unreachable;
    }
    case cloud_kind::gcp: {
      auto r = http_("GET", ep_.gcp + "/computeMetadata/v1/instance/preempted", {"Metadata-Flavor: Google"}, timeout_);
      if (r.code != 200) {
        error = r.code == 0 ? r.error : "instance/preempted answered HTTP " + std::to_string(r.code);
        return outcome::unreachable;
      }
      notice = parse_gcp_preempted(r.body, now);
      return notice ? outcome::notice : outcome::none;
    }
    case cloud_kind::azure: {
      if (!vm_name_) {
        auto r = http_("GET", ep_.azure + "/metadata/instance/compute/name?api-version=2020-09-01&format=text", {"Metadata: true"}, timeout_);
        if (r.code == 200) vm_name_ = trim(r.body);
        else if (r.code != 0) vm_name_ = std::string();  // answers, but not the name: take any Preempt event
      }
      auto r = http_("GET", ep_.azure + "/metadata/scheduledevents?api-version=2020-07-01", {"Metadata: true"}, timeout_);
      if (r.code != 200) {
        error = r.code == 0 ? r.error : "scheduledevents answered HTTP " + std::to_string(r.code);
        return outcome::unreachable;
      }
      notice = parse_azure_events(r.body, vm_name_.value_or(""), now);
      return notice ? outcome::notice : outcome::none;
    }
  }
  return outcome::unreachable;
}

// ---- preemption_watcher ----

preemption_watcher::preemption_watcher(preemption_watch_options o, http_call http, on_notice notice, log_fn log)
    : o_(std::move(o)), http_(std::move(http)), notice_(std::move(notice)), log_(std::move(log)), thread_([this] { run(); }) {}

preemption_watcher::~preemption_watcher() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

bool preemption_watcher::wait(std::chrono::milliseconds d) {
  std::unique_lock<std::mutex> l(mu_);
  return !cv_.wait_for(l, d, [this] { return stop_; });
}

void preemption_watcher::run() {
  auto say = [this](const std::string& s) {
    if (log_) log_(s);
  };
  std::optional<metadata_poller> poller;
  cloud_kind c;
  if (cloud_from_string(o_.cloud, c)) {
    poller.emplace(c, o_.endpoints, http_, o_.request_timeout);
  } else {
    // auto: the first cloud whose service answers as its API does; quiet
    // (one line) where none does.
    for (cloud_kind k : {cloud_kind::aws, cloud_kind::gcp, cloud_kind::azure}) {
      metadata_poller p(k, o_.endpoints, http_, o_.detect_timeout);
      if (p.detect()) {
        poller.emplace(k, o_.endpoints, http_, o_.request_timeout);
        break;
      }
      if (!wait(std::chrono::milliseconds(0))) return;
    }
    if (!poller) {
      say("preemption notice: no cloud metadata service answered (aws, gcp, azure); not watching");
      return;
    }
  }
  say(std::string("preemption notice: watching ") + to_string(poller->cloud()) + "'s metadata service");
  bool unreachable_said = false;
  do {
    std::optional<preemption_notice> n;
    std::string error;
    const auto out = poller->poll(unix_time_now(), n, error);
    if (out == metadata_poller::outcome::notice) {
      if (notice_) notice_(*n);
      return;
    }
    if (out == metadata_poller::outcome::unreachable && !unreachable_said) {
      say(std::string("preemption notice: ") + to_string(poller->cloud()) + " metadata service: " + error + "; training goes on, still trying");
      unreachable_said = true;
    } else if (out == metadata_poller::outcome::none && unreachable_said) {
      say(std::string("preemption notice: ") + to_string(poller->cloud()) + " metadata service answers again");
      unreachable_said = false;
    }
  } while (wait(o_.poll_interval));
}

}  // namespace dtactor
