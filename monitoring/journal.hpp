#pragma once
// The run's journal: JSON Lines, one event per line, each with `t` (unix time,
// seconds, float) and `event`. Lines are written whole and flushed, so a
// crash never leaves a half line for readers (at worst a missing one).
#include <nlohmann/json.hpp>

#include <cstdio>
#include <mutex>
#include <string>

#include "runtime/result.hpp"

namespace dtactor {

class journal {
 public:
  journal() = default;
  ~journal();
  journal(const journal&) = delete;
  journal& operator=(const journal&) = delete;

  // Opens (appends to) the file, creating it.
  status open(const std::string& path);
  bool is_open() const { return f_ != nullptr; }
  const std::string& path() const { return path_; }

  // Writes {"t": now, "event": event, ...fields}. Thread-safe.
  void write(const std::string& event, nlohmann::json fields = nlohmann::json::object());

 private:
  std::mutex mu_;
  std::FILE* f_ = nullptr;
  std::string path_;
};

double unix_time_now();

}  // namespace dtactor
