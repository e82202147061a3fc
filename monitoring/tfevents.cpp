#include "monitoring/tfevents.hpp"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "monitoring/journal.hpp"  // unix_time_now
#include "tfevents.pb.h"

namespace dtactor {

namespace {

struct crc32c_table {
  uint32_t t[256];
  crc32c_table() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
  }
};

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  static const crc32c_table table;
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = table.t[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return ~crc;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

tfevents_writer::~tfevents_writer() {
  if (f_) std::fclose(f_);
}

status tfevents_writer::open(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return make_error("tensorboard: cannot create '" + dir + "': " + ec.message());
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0 || !host[0]) std::strcpy(host, "localhost");
  const double now = unix_time_now();
  const std::string path = dir + "/events.out.tfevents." + std::to_string(static_cast<long long>(now)) + "." + host;
  std::lock_guard<std::mutex> lock(mu_);
  if (f_) std::fclose(f_);
  f_ = std::fopen(path.c_str(), "ab");
  if (!f_) return make_error("tensorboard: cannot open '" + path + "': " + std::strerror(errno));
  path_ = path;
  tensorboard::Event ev;
  ev.set_wall_time(now);
  ev.set_file_version("brain.Event:2");
  write_record(ev.SerializeAsString());
  return {};
}

void tfevents_writer::add_scalars(int64_t step, const std::map<std::string, double>& values, double wall_time) {
  if (values.empty()) return;
  tensorboard::Event ev;
  ev.set_wall_time(wall_time < 0 ? unix_time_now() : wall_time);
  ev.set_step(step);
  for (const auto& [tag, v] : values) {
    auto* val = ev.mutable_summary()->add_value();
    val->set_tag(tag);
    val->set_simple_value(static_cast<float>(v));
  }
  const std::string data = ev.SerializeAsString();
  std::lock_guard<std::mutex> lock(mu_);
  if (f_) write_record(data);
}

void tfevents_writer::write_record(const std::string& data) {
  std::string rec;
  rec.reserve(data.size() + 16);
  put_le(rec, data.size(), 8);
  put_le(rec, masked_crc32c(rec.data(), 8), 4);
  rec += data;
  put_le(rec, masked_crc32c(data.data(), data.size()), 4);
  std::fwrite(rec.data(), 1, rec.size(), f_);
  std::fflush(f_);
}

}  // namespace dtactor
