#pragma once
// Helpers shared by the fuzz targets (docs/fuzzing.md). No LibTorch here.
//
// Inputs that carry several messages (a conversation with an actor, a
// request of several frames) use one record format, so that seeds are easy
// to write from captured bytes (fuzz/seeds/) and mutations stay local:
//   record = u8 tag, u16 little-endian length, that many bytes
// A record cut short by the end of the input takes what is left.
#include <google/protobuf/util/field_comparator.h>
#include <google/protobuf/util/message_differencer.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

namespace dtactor::fuzz {

class reader {
 public:
  reader(const uint8_t* data, size_t size) : p_(data), n_(size) {}
  bool empty() const { return at_ >= n_; }
  size_t left() const { return n_ - at_; }
  uint8_t u8() { return at_ < n_ ? p_[at_++] : 0; }
  uint16_t u16() {
    const uint16_t lo = u8();
    return static_cast<uint16_t>(lo | (u8() << 8));
  }
  uint32_t u32() {
    const uint32_t lo = u16();
    return lo | (static_cast<uint32_t>(u16()) << 16);
  }
  std::string bytes(size_t n) {
    n = n < left() ? n : left();
    std::string s(reinterpret_cast<const char*>(p_ + at_), n);
    at_ += n;
    return s;
  }
  std::string rest() { return bytes(left()); }
  // One record's payload (its tag read by the caller first).
  std::string payload() { return bytes(u16()); }

 private:
  const uint8_t* p_;
  size_t n_;
  size_t at_ = 0;
};

// Calls fn(tag, payload) for each record of the input, in order.
template <class F>
void for_each_record(const uint8_t* data, size_t size, F&& fn) {
  reader in(data, size);
  while (!in.empty()) {
    const uint8_t tag = in.u8();
    fn(tag, in.payload());
  }
}

// Appends one record (for seed writers and regression inputs).
inline void put_record(std::string& out, uint8_t tag, std::string_view payload) {
  const size_t n = payload.size() < 0xffff ? payload.size() : 0xffff;
  out.push_back(static_cast<char>(tag));
  out.push_back(static_cast<char>(n & 0xff));
  out.push_back(static_cast<char>(n >> 8));
  out.append(payload.data(), n);
}

// The bytes as a file that exists only in memory, for readers that take a
// path (memory-mapped .npy and .bin files): "/proc/self/fd/N".
class memory_file {
 public:
  explicit memory_file(std::string_view bytes) {
    fd_ = ::memfd_create("dtactor-fuzz", MFD_CLOEXEC);
    if (fd_ < 0) std::abort();
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::write(fd_, bytes.data() + done, bytes.size() - done);
      if (n <= 0) std::abort();
      done += static_cast<size_t>(n);
    }
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  ~memory_file() { ::close(fd_); }
  memory_file(const memory_file&) = delete;
  memory_file& operator=(const memory_file&) = delete;
  const std::string& path() const { return path_; }

 private:
  int fd_ = -1;
  std::string path_;
};

// Two messages hold the same values (a NaN equals a NaN: a double field
// may carry any bits).
inline bool same_message(const google::protobuf::Message& a, const google::protobuf::Message& b) {
  google::protobuf::util::DefaultFieldComparator cmp;
  cmp.set_treat_nan_as_equal(true);
  google::protobuf::util::MessageDifferencer d;
  d.set_field_comparator(&cmp);
  return d.Compare(a, b);
}

// A property of the code under test does not hold: report it as a crash.
[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "fuzz property violated: %s\n", what);
  std::abort();
}

}  // namespace dtactor::fuzz
