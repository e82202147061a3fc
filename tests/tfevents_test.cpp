// The TensorBoard writer, checked by a reader written here from the format's
// description (TFRecord framing, bitwise CRC-32C, protobuf wire format with
// TensorFlow's field numbers), independent of the writer's code and of the
// generated protobuf classes.
#include "monitoring/tfevents.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <vector>

#include "test_util.hpp"

namespace dtactor {
namespace {

uint32_t crc32c_bitwise(const std::string& s) {
  uint32_t crc = 0xffffffffu;
  for (unsigned char c : s) {
    crc ^= c;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
  }
  return ~crc;
}

uint32_t mask(uint32_t c) { return ((c >> 15) | (c << 17)) + 0xa282ead8u; }

uint64_t le(const std::string& s, size_t off, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(s[off + i]);
  return v;
}

// A protobuf wire-format reader: just enough for Event/Summary/Value.
struct pb_reader {
  const std::string& s;
  size_t pos = 0, end;
  explicit pb_reader(const std::string& str) : s(str), end(str.size()) {}
  bool done() const { return pos >= end; }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; pos < end; shift += 7) {
      const auto b = static_cast<unsigned char>(s[pos++]);
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) return v;
    }
    throw std::runtime_error("truncated varint");
  }
  std::string bytes() {
    const auto n = varint();
    if (pos + n > end) throw std::runtime_error("truncated field");
    std::string out = s.substr(pos, n);
    pos += n;
    return out;
  }
  uint64_t fixed(int n) {
    if (pos + n > end) throw std::runtime_error("truncated fixed");
    const uint64_t v = le(s, pos, n);
    pos += n;
    return v;
  }
};

struct decoded_event {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version;
  std::vector<std::pair<std::string, float>> values;
};

decoded_event decode_event(const std::string& data) {
  decoded_event ev;
  pb_reader r(data);
  while (!r.done()) {
    const uint64_t key = r.varint();
    const int field = static_cast<int>(key >> 3), wire = static_cast<int>(key & 7);
    if (field == 1 && wire == 1) {
      const uint64_t bits = r.fixed(8);
      std::memcpy(&ev.wall_time, &bits, 8);
    } else if (field == 2 && wire == 0) {
      ev.step = static_cast<int64_t>(r.varint());
    } else if (field == 3 && wire == 2) {
      ev.file_version = r.bytes();
    } else if (field == 5 && wire == 2) {
      const std::string summary = r.bytes();
      pb_reader sr(summary);
      while (!sr.done()) {
        const uint64_t sk = sr.varint();
        if (sk != ((1u << 3) | 2)) throw std::runtime_error("unexpected Summary field");
        const std::string value = sr.bytes();
        pb_reader vr(value);
        std::string tag;
        float f = NAN;
        while (!vr.done()) {
          const uint64_t vk = vr.varint();
          if (vk == ((1u << 3) | 2)) {
            tag = vr.bytes();
          } else if (vk == ((2u << 3) | 5)) {
            const auto bits = static_cast<uint32_t>(vr.fixed(4));
            std::memcpy(&f, &bits, 4);
          } else {
            throw std::runtime_error("unexpected Value field " + std::to_string(vk));
          }
        }
        ev.values.emplace_back(tag, f);
      }
    } else {
      throw std::runtime_error("unexpected Event field " + std::to_string(field));
    }
  }
  return ev;
}

// Reads every record, checking both CRCs of each; fails the test on a bad one.
std::vector<decoded_event> read_records(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<decoded_event> out;
  size_t off = 0;
  while (off < s.size()) {
    EXPECT_LE(off + 12, s.size()) << "truncated header at " << off;
    if (off + 12 > s.size()) break;
    const uint64_t len = le(s, off, 8);
    EXPECT_EQ(le(s, off + 8, 4), mask(crc32c_bitwise(s.substr(off, 8)))) << "length CRC of record " << out.size();
    EXPECT_LE(off + 12 + len + 4, s.size()) << "truncated record " << out.size();
    if (off + 12 + len + 4 > s.size()) break;
    const std::string data = s.substr(off + 12, len);
    EXPECT_EQ(le(s, off + 12 + len, 4), mask(crc32c_bitwise(data))) << "data CRC of record " << out.size();
    out.push_back(decode_event(data));
    off += 12 + len + 4;
  }
  return out;
}

TEST(tfevents, crc32c_known_vectors) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c("", 0), 0u);
  const std::string zeros(32, '\0'), ones(32, '\xff');
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);  // RFC 3720 B.4
  EXPECT_EQ(crc32c(ones.data(), ones.size()), 0x62A8AB43u);
  std::string inc;
  for (int i = 0; i < 32; ++i) inc.push_back(static_cast<char>(i));
  EXPECT_EQ(crc32c(inc.data(), inc.size()), 0x46DD794Eu);
  // Incremental use gives the same as one call.
  EXPECT_EQ(crc32c("6789", 4, crc32c("12345", 5)), 0xE3069283u);
  EXPECT_EQ(crc32c_bitwise("123456789"), 0xE3069283u);
  EXPECT_EQ(masked_crc32c("123456789", 9), mask(0xE3069283u));
}

TEST(tfevents, scalars_read_back_with_valid_crcs) {
  dtactor::testing::temp_dir dir;
  const std::string tb = dir.path() + "/tensorboard";
  tfevents_writer w;
  ASSERT_TRUE(w.open(tb));
  const std::string name = std::filesystem::path(w.path()).filename().string();
  EXPECT_EQ(name.rfind("events.out.tfevents.", 0), 0u) << name;
  EXPECT_EQ(std::filesystem::path(w.path()).parent_path().string(), tb);
  w.add_scalar(10, "train/loss", 2.5, 1700000000.25);
  w.add_scalars(20, {{"train/loss", 1.75}, {"train/lr", 0.001}, {"eval/accuracy", 0.875}}, 1700000001.5);
  w.add_scalar(1LL << 40, "cluster/world_size", 3);  // a large step: multi-byte varint

  const auto evs = read_records(w.path());
  ASSERT_EQ(evs.size(), 4u);
  EXPECT_EQ(evs[0].file_version, "brain.Event:2");
  EXPECT_TRUE(evs[0].values.empty());
  EXPECT_GT(evs[0].wall_time, 1.6e9);

  EXPECT_EQ(evs[1].step, 10);
  EXPECT_DOUBLE_EQ(evs[1].wall_time, 1700000000.25);
  ASSERT_EQ(evs[1].values.size(), 1u);
  EXPECT_EQ(evs[1].values[0].first, "train/loss");
  EXPECT_FLOAT_EQ(evs[1].values[0].second, 2.5f);

  EXPECT_EQ(evs[2].step, 20);
  ASSERT_EQ(evs[2].values.size(), 3u);
  std::map<std::string, float> v(evs[2].values.begin(), evs[2].values.end());
  EXPECT_FLOAT_EQ(v["train/loss"], 1.75f);
  EXPECT_FLOAT_EQ(v["train/lr"], 0.001f);
  EXPECT_FLOAT_EQ(v["eval/accuracy"], 0.875f);

  EXPECT_EQ(evs[3].step, 1LL << 40);
  ASSERT_EQ(evs[3].values.size(), 1u);
  EXPECT_FLOAT_EQ(evs[3].values[0].second, 3.0f);
}

TEST(tfevents, a_corrupted_byte_is_caught_by_the_reader) {
  // The reader above must be able to fail: flip one data byte.
  dtactor::testing::temp_dir dir;
  tfevents_writer w;
  ASSERT_TRUE(w.open(dir.path()));
  w.add_scalar(1, "x", 1.0);
  const std::string path = w.path();
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(0, std::ios::end);
  const auto size = static_cast<long>(f.tellg());
  f.seekp(size - 6);  // inside the last record's data
  f.put('\x7f');
  f.close();
  std::ifstream in(path, std::ios::binary);
  const std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const uint64_t len0 = le(s, 0, 8);
  const size_t off = 12 + len0 + 4;
  const uint64_t len1 = le(s, off, 8);
  const std::string data = s.substr(off + 12, len1);
  EXPECT_NE(le(s, off + 12 + len1, 4), mask(crc32c_bitwise(data)));
}

TEST(tfevents, unwritable_directory_is_one_clear_error) {
  dtactor::testing::temp_dir dir;
  const std::string file = dir.path() + "/a_file";
  std::ofstream(file) << "x";
  tfevents_writer w;
  auto st = w.open(file + "/tb");
  ASSERT_FALSE(st);
  EXPECT_NE(st.message().find("tensorboard"), std::string::npos) << st.message();
  w.add_scalar(1, "x", 1);  // not open: no-op, no crash
}

}  // namespace
}  // namespace dtactor
