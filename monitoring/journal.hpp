#pragma once
// The run's journal: JSON Lines, one event per line, each with `t` (unix time,
// seconds, float) and `event`; the events and their fields are the schema's
// (job/journal_events.hpp). Lines are written whole and flushed, so a
// crash never leaves a half line for readers (at worst a missing one).
#include <nlohmann/json.hpp>

#include <cstdio>
#include <mutex>
#include <string>

#include "job/journal_events.hpp"
#include "storage/fs.hpp"
#include "dtactor/result.hpp"
#include "base/unix_time.hpp"

namespace dtactor {

class journal {
 public:
  journal() = default;
  ~journal();
  journal(const journal&) = delete;
  journal& operator=(const journal&) = delete;

  // Opens (appends to) the file, creating it. Lines reach the disk through
  // `env` (which must outlive the journal).
  status open(const std::string& path, fs_env& env = default_fs_env());
  bool is_open() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }

  // Writes {"t": now, "event": name_of(e), ...to_json(e)}. Thread-safe. A
  // line the disk refuses (full, I/O error) is cut back off, so the file
  // never holds half a line; the first such failure is reported on stderr in
  // one line, and every one is counted.
  void write(const ev::journal_event& e);
  uint64_t failed_writes() const;

 private:
  void write(std::string_view event, const nlohmann::json& fields);

  mutable std::mutex mu_;
  int fd_ = -1;
  fs_env* env_ = nullptr;
  std::string path_;
  uint64_t failed_ = 0;
};


}  // namespace dtactor
