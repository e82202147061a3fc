#pragma once
// The cloud's preemption notice: a spot/preemptible machine is told, through
// its instance metadata service, that it is about to be taken (AWS about
// 2 min ahead, GCP about 30 s, Azure Scheduled Events' NotBefore). A
// preemption_watcher polls the service on a thread of its own and calls
// back once with the notice; the node then leaves at the next step boundary
// (app/node.cpp). A metadata service that does not answer never stops
// training: the watcher logs it once and keeps trying.
//
// HTTP reaches the logic through `http_call` so that tests drive the parsers
// and the watcher without sockets; curl_http() is the real one (libcurl, as
// the S3 store uses).
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace dtactor {

enum class cloud_kind { aws, gcp, azure };
const char* to_string(cloud_kind c);
// "aws", "gcp", "azure"; false for anything else.
bool cloud_from_string(const std::string& s, cloud_kind& out);

struct preemption_notice {
  cloud_kind cloud = cloud_kind::aws;
  std::string announced;        // the time as the cloud wrote it (empty for GCP, which gives none)
  double announced_unix_s = 0;  // GCP: noticed + 30 s, its documented notice
  double noticed_unix_s = 0;    // when this process saw it
  std::string detail;           // the action (AWS), event id (Azure)
};

struct http_reply {
  long code = 0;       // 0: no HTTP answer (see error)
  std::string body;
  std::string error;   // the transport's, when no answer came
};
using http_call = std::function<http_reply(const std::string& method, const std::string& url, const std::vector<std::string>& headers,
                                           std::chrono::milliseconds timeout)>;
// libcurl; never follows redirects, never uses a proxy (metadata services
// are link-local).
http_call curl_http();

// ---- the documented response shapes (pure) ----
// RFC 3339 "2026-11-25T08:30:00Z" (AWS) or RFC 1123 "Wed, 25 Nov 2026 08:30:00 GMT" (Azure).
std::optional<double> parse_utc_time(const std::string& s);
// AWS spot/instance-action: {"action": "terminate"|"stop"|"hibernate", "time": "...Z"}.
std::optional<preemption_notice> parse_aws_instance_action(const std::string& body, double now_unix_s);
// GCP instance/preempted: "TRUE" or "FALSE".
std::optional<preemption_notice> parse_gcp_preempted(const std::string& body, double now_unix_s);
// Azure scheduledevents: {"Events": [{"EventId", "EventType": "Preempt", "Resources": [...], "NotBefore"}]}.
// `vm_name` empty: any Preempt event; otherwise only one whose Resources name it.
std::optional<preemption_notice> parse_azure_events(const std::string& body, const std::string& vm_name, double now_unix_s);

// Base URLs (scheme://host[:port], no trailing slash), the way the clouds'
// SDKs let one override them: AWS_EC2_METADATA_SERVICE_ENDPOINT,
// GCE_METADATA_HOST (host[:port], http), and for Azure the option or
// DTACTOR_AZURE_METADATA_ENDPOINT.
struct metadata_endpoints {
  std::string aws = "http://169.254.169.254";
  std::string gcp = "http://metadata.google.internal";
  std::string azure = "http://169.254.169.254";
};
metadata_endpoints metadata_endpoints_from(const std::function<const char*(const char*)>& getenv_fn, const std::string& azure_option);

struct preemption_watch_options {
  std::string cloud = "auto";  // aws, gcp, azure, auto
  metadata_endpoints endpoints;
  std::chrono::milliseconds poll_interval{1000};
  std::chrono::milliseconds request_timeout{1000};
  // auto: how long each cloud has to answer the detection request.
  std::chrono::milliseconds detect_timeout{500};
};

// One cloud's state between polls (AWS's session token).
class metadata_poller {
 public:
  metadata_poller(cloud_kind c, metadata_endpoints ep, http_call http, std::chrono::milliseconds timeout);
  enum class outcome { none, notice, unreachable };
  // One poll: a notice, none yet, or no (valid) answer, with why in `error`.
  outcome poll(double now_unix_s, std::optional<preemption_notice>& notice, std::string& error);
  // Whether this cloud's service answers at all, as its API should (auto).
  bool detect();
  cloud_kind cloud() const { return cloud_; }

 private:
  bool refresh_token(std::string& error);
  cloud_kind cloud_;
  metadata_endpoints ep_;
  http_call http_;
  std::chrono::milliseconds timeout_;
  std::string token_;
  std::chrono::steady_clock::time_point token_at_{};
  std::optional<std::string> vm_name_;  // Azure, asked once
};

class preemption_watcher {
 public:
  using on_notice = std::function<void(const preemption_notice&)>;
  using log_fn = std::function<void(const std::string&)>;
  // Starts the thread; `notice` is called at most once, on that thread.
  preemption_watcher(preemption_watch_options o, http_call http, on_notice notice, log_fn log);
  ~preemption_watcher();  // stops and joins within one request timeout
  preemption_watcher(const preemption_watcher&) = delete;
  preemption_watcher& operator=(const preemption_watcher&) = delete;

 private:
  void run();
  bool wait(std::chrono::milliseconds d);  // false when stopping
  preemption_watch_options o_;
  http_call http_;
  on_notice notice_;
  log_fn log_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the members it uses
};

}  // namespace dtactor
