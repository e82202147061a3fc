#pragma once
// TensorBoard event files for scalars, written without TensorFlow.
//
// File format (TFRecord): each record is
//   uint64 length (little endian) | uint32 masked_crc32c(length bytes)
//   | data | uint32 masked_crc32c(data)
// and data is a serialized tensorflow.Event (proto/tfevents.proto). The first
// record carries file_version "brain.Event:2". Records are flushed as they
// are written, so TensorBoard shows a running job live, and a crash leaves at
// worst a truncated last record (which TensorBoard skips).
#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>

#include "dtactor/result.hpp"

namespace dtactor {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), as TFRecord uses.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);
// TFRecord's masking: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t masked_crc32c(const void* data, size_t n);

class tfevents_writer {
 public:
  tfevents_writer() = default;
  ~tfevents_writer();
  tfevents_writer(const tfevents_writer&) = delete;
  tfevents_writer& operator=(const tfevents_writer&) = delete;

  // Creates `dir` if needed and opens dir/events.out.tfevents.<unix_time>.<hostname>
  // (a new file per process start, as TensorFlow does; TensorBoard merges the
  // files of one directory), writing the file_version record.
  status open(const std::string& dir);
  bool is_open() const { return f_ != nullptr; }
  const std::string& path() const { return path_; }

  // One Event with one simple_value per entry at `step`. Thread-safe; a
  // no-op when not open. wall_time < 0 means now.
  void add_scalars(int64_t step, const std::map<std::string, double>& values, double wall_time = -1);
  void add_scalar(int64_t step, const std::string& tag, double value, double wall_time = -1) {
    add_scalars(step, {{tag, value}}, wall_time);
  }

 private:
  void write_record(const std::string& data);
  std::mutex mu_;
  std::FILE* f_ = nullptr;
  std::string path_;
};

}  // namespace dtactor
