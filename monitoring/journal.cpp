#include "monitoring/journal.hpp"

#include <cerrno>
#include <chrono>
#include <cstring>

namespace dtactor {

double unix_time_now() {
  using namespace std::chrono;
  return duration_cast<duration<double>>(system_clock::now().time_since_epoch()).count();
}

journal::~journal() {
  if (f_) std::fclose(f_);
}

status journal::open(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  if (f_) std::fclose(f_);
  f_ = std::fopen(path.c_str(), "a");
  if (!f_) return make_error("cannot open journal '" + path + "': " + std::strerror(errno));
  path_ = path;
  return {};
}

void journal::write(const std::string& event, nlohmann::json fields) {
  nlohmann::json line = nlohmann::json::object();
  line["t"] = unix_time_now();
  line["event"] = event;
  for (auto& [k, v] : fields.items()) line[k] = v;
  // Non-finite floats are not JSON; the replacement keeps the line parseable.
  std::string text = line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  std::lock_guard<std::mutex> lock(mu_);
  if (!f_) return;
  std::fwrite(text.data(), 1, text.size(), f_);
  std::fflush(f_);
}

}  // namespace dtactor
