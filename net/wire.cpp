#include "net/wire.hpp"

#include <chrono>
#include <climits>
#include <mutex>
#include <random>
#include <thread>

#include <google/protobuf/stubs/logging.h>

#include "base/log_limiter.hpp"
#include "base/printable.hpp"

namespace dtactor::wire {

const char* to_string(drop_kind kind) noexcept {
  switch (kind) {
    case drop_kind::garbage: return "garbage";
    case drop_kind::empty: return "empty";
    case drop_kind::version_mismatch: return "version_mismatch";
    case drop_kind::foreign_job: return "foreign_job";
    case drop_kind::bad_multipart: return "bad_multipart";
    case drop_kind::unroutable: return "unroutable";
    case drop_kind::send_overflow: return "send_overflow";
    case drop_kind::stale_epoch: return "stale_epoch";
    case drop_kind::count_: break;
  }
  return "unknown";
}

namespace {

void on_protobuf_log(google::protobuf::LogLevel level, const char* file, int line, const std::string& message) {
  static log_limiter limit;
  static const char* const names[] = {"INFO", "WARNING", "ERROR", "FATAL"};
  const char* name = level >= 0 && level <= google::protobuf::LOGLEVEL_FATAL ? names[level] : "?";
  // One cause per place in libprotobuf that logs (the same complaint about
  // every hostile frame comes from the same line).
  const std::string where = std::string(file ? file : "?") + ":" + std::to_string(line);
  limit.log(where, std::string("dtactor: libprotobuf ") + name + " " + where + ": " + printable(message, printable_max_detail_chars));
}

}  // namespace

void route_protobuf_logs() {
  static std::once_flag once;
  std::call_once(once, [] { google::protobuf::SetLogHandler(&on_protobuf_log); });
}

result<std::string> encode(const pb::envelope& env) {
  if (env.body_case() == pb::envelope::BODY_NOT_SET)
    return make_error("wire: refusing to encode an envelope without a body (sender '" +
                      env.sender() + "'); set exactly one message in it");
  const std::size_t size = env.ByteSizeLong();
  if (size > static_cast<std::size_t>(INT_MAX))
    return make_error("wire: envelope '" + std::string(body_name(env)) + "' is " +
                      std::to_string(size) +
                      " bytes, over protobuf's 2 GiB limit; split it into smaller messages");
  std::string out;
  if (!env.SerializeToString(&out))
    return make_error("wire: could not serialize envelope '" + std::string(body_name(env)) + "'");
  return out;
}

decoded decode(const void* data, std::size_t size, std::string_view expected_job_id) {
  if (size == 0) return decoded(drop_kind::empty, make_error("wire: empty frame"));
  pb::envelope env;
  if (size > static_cast<std::size_t>(INT_MAX) || !env.ParseFromArray(data, static_cast<int>(size)))
    return decoded(drop_kind::garbage, make_error("wire: frame of " + std::to_string(size) +
                                                      " bytes does not parse as an envelope"));
  const bool has_body = env.body_case() != pb::envelope::BODY_NOT_SET;
  if (env.protocol_version() == 0 && !has_body)
    return decoded(drop_kind::garbage, make_error("wire: frame of " + std::to_string(size) +
                                                      " bytes is no envelope (no version, no body)"));
  if (env.protocol_version() != protocol_version)
    return decoded(drop_kind::version_mismatch,
                   make_error("wire: peer '" + printable(env.sender()) + "' speaks protocol version " +
                              std::to_string(env.protocol_version()) + ", this build speaks " +
                              std::to_string(protocol_version) +
                              "; run the same dtactor release everywhere"));
  if (!has_body)
    return decoded(drop_kind::garbage,
                   make_error("wire: envelope from '" + printable(env.sender()) +
                              "' has no body (a message type this build does not know?)"));
  if (!expected_job_id.empty() && !env.job_id().empty() && env.job_id() != expected_job_id)
    return decoded(drop_kind::foreign_job,
                   make_error("wire: peer '" + printable(env.sender()) + "' belongs to job '" + printable(env.job_id()) +
                              "', this process to job '" + std::string(expected_job_id) +
                              "'; check the --coordinator address"));
  return decoded(std::move(env));
}

uint64_t new_incarnation() {
  // random_device alone may be deterministic on odd platforms; mixing in the
  // clock and the thread id keeps restarts distinct even then.
  std::random_device rd;
  std::seed_seq seq{rd(), rd(), rd(), rd(),
                    static_cast<unsigned>(std::chrono::steady_clock::now().time_since_epoch().count()),
                    static_cast<unsigned>(std::chrono::system_clock::now().time_since_epoch().count()),
                    static_cast<unsigned>(std::hash<std::thread::id>{}(std::this_thread::get_id()))};
  std::mt19937_64 gen(seq);
  uint64_t v = 0;
  while (v == 0) v = gen();
  return v;
}

const char* body_name(const pb::envelope& env) noexcept {
  const auto* oneof = pb::envelope::descriptor()->FindOneofByName("body");
  const auto* field = oneof ? env.GetReflection()->GetOneofFieldDescriptor(env, oneof) : nullptr;
  return field ? field->name().c_str() : "none";
}

}  // namespace dtactor::wire
