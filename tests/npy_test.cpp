// NumPy .npy arrays read in place: the format byte for byte, every refusal
// as one clear line, and files written by real NumPy (python3-numpy).
#include "data/npy.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>

#include "test_util.hpp"

using namespace dtactor;

namespace {

// A .npy file as NumPy lays it out (version 1.0, header padded to 64 bytes).
std::string npy_bytes(const std::string& descr, const std::string& shape, const std::string& data, bool fortran = false, int major = 1) {
  std::string dict = "{'descr': '" + descr + "', 'fortran_order': " + (fortran ? "True" : "False") + ", 'shape': " + shape + ", }";
  const std::size_t prefix = major == 1 ? 10 : 12;
  while ((prefix + dict.size() + 1) % 64 != 0) dict += ' ';
  dict += '\n';
  std::string out("\x93NUMPY", 6);
  out += static_cast<char>(major);
  out += '\0';
  const std::size_t n = dict.size();
  out += static_cast<char>(n & 0xff);
  out += static_cast<char>((n >> 8) & 0xff);
  if (major != 1) {
    out += '\0';
    out += '\0';
  }
  return out + dict + data;
}

template <class T>
std::string raw(std::initializer_list<T> values) {
  std::string s;
  for (T v : values) s.append(reinterpret_cast<const char*>(&v), sizeof v);
  return s;
}

std::string write(const dtactor::testing::temp_dir& d, const std::string& name, const std::string& bytes) {
  const std::string path = d.path() + "/" + name;
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

std::string open_error(const std::string& path) {
  auto a = npy_array::open(path);
  return a ? std::string("(opened)") : a.message();
}

}  // namespace

TEST(npy, a_float32_matrix_is_read_in_place_row_by_row) {
  dtactor::testing::temp_dir d;
  auto path = write(d, "x.npy", npy_bytes("<f4", "(3, 2)", raw<float>({1, 2, 3, 4, 5, 6.5f})));
  auto a = npy_array::open(path);
  ASSERT_TRUE(a) << a.message();
  EXPECT_EQ(a->dtype(), npy_dtype::f4);
  EXPECT_EQ(a->rows(), 3);
  EXPECT_EQ(a->shape(), (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(a->row_bytes(), 8u);
  float second[2];
  std::memcpy(second, a->row(1), sizeof second);
  EXPECT_EQ(second[0], 3.f);
  EXPECT_EQ(second[1], 4.f);
  EXPECT_DOUBLE_EQ(a->at(5), 6.5);
}

TEST(npy, every_number_dtype_converts_to_double) {
  dtactor::testing::temp_dir d;
  struct one {
    std::string descr, data;
    double expect;
  };
  const uint16_t half_1_5 = 0x3E00, half_minus_2 = 0xC000;
  const std::vector<one> cases = {
      {"|u1", raw<uint8_t>({200}), 200},        {"|i1", raw<int8_t>({-5}), -5},          {"<u2", raw<uint16_t>({65535}), 65535},
      {"<i2", raw<int16_t>({-300}), -300},      {"<u4", raw<uint32_t>({4000000000u}), 4e9}, {"<i4", raw<int32_t>({-70000}), -70000},
      {"<u8", raw<uint64_t>({1ull << 40}), 1099511627776.0}, {"<i8", raw<int64_t>({-(1ll << 40)}), -1099511627776.0},
      {"<f2", raw<uint16_t>({half_1_5}), 1.5},  {"<f2", raw<uint16_t>({half_minus_2}), -2}, {"<f8", raw<double>({0.125}), 0.125},
      {"|b1", raw<uint8_t>({1}), 1},
  };
  for (const auto& c : cases) {
    auto path = write(d, "v.npy", npy_bytes(c.descr, "(1,)", c.data));
    auto a = npy_array::open(path);
    ASSERT_TRUE(a) << c.descr << ": " << a.message();
    EXPECT_DOUBLE_EQ(a->at(0), c.expect) << c.descr;
  }
}

TEST(npy, version_2_headers_are_read) {
  dtactor::testing::temp_dir d;
  auto a = npy_array::open(write(d, "v2.npy", npy_bytes("<i8", "(2,)", raw<int64_t>({7, 9}), false, 2)));
  ASSERT_TRUE(a) << a.message();
  EXPECT_DOUBLE_EQ(a->at(1), 9);
}

TEST(npy, bad_files_are_one_clear_line_naming_the_file) {
  dtactor::testing::temp_dir d;
  const std::string six = raw<float>({1, 2, 3, 4, 5, 6});
  struct bad {
    std::string name, bytes, says;
  };
  const std::vector<bad> cases = {
      {"garbage.npy", "hello, not an array", "not a .npy file"},
      {"empty.npy", "", "not a .npy file"},
      {"short.npy", npy_bytes("<f4", "(3, 2)", six.substr(0, 20)), "the header says 24 bytes of data (shape and dtype), the file holds 20 (truncated?)"},
      {"long.npy", npy_bytes("<f4", "(3, 2)", six + "xx"), "the header says 24 bytes of data (shape and dtype), the file holds 26"},
      {"big_endian.npy", npy_bytes(">f4", "(3, 2)", six), "dtype '>f4' is big-endian"},
      {"fortran.npy", npy_bytes("<f4", "(3, 2)", six, true), "Fortran order"},
      {"scalar.npy", npy_bytes("<f4", "()", raw<float>({1})), "scalar"},
      {"complex.npy", npy_bytes("<c8", "(3,)", six), "dtype '<c8' is not supported"},
      {"object.npy", npy_bytes("|O", "(3,)", six), "dtype '|O' is not supported"},
      {"version4.npy", npy_bytes("<f4", "(3, 2)", six, false, 4), "version 4 is not supported"},
      {"bad_shape.npy", npy_bytes("<f4", "(3, x)", six), "is not a tuple of sizes"},
  };
  for (const auto& c : cases) {
    const std::string why = open_error(write(d, c.name, c.bytes));
    EXPECT_NE(why.find(c.says), std::string::npos) << c.name << ": " << why;
    EXPECT_NE(why.find(c.name), std::string::npos) << why;
    EXPECT_EQ(why.find('\n'), std::string::npos) << why;
  }
  EXPECT_NE(open_error(d.path() + "/missing.npy").find("No such file"), std::string::npos);
  EXPECT_NE(open_error(d.path()).find("not a regular file"), std::string::npos);
}

TEST(npy, a_header_that_claims_more_than_the_file_is_refused) {
  std::string b = npy_bytes("<f4", "(1,)", raw<float>({1}));
  b[8] = '\xff';  // header length 0xff..
  b[9] = '\x7f';
  auto h = parse_npy_header(b, b.size());
  ASSERT_FALSE(h);
  EXPECT_NE(h.message().find("the file is shorter"), std::string::npos) << h.message();
}

// Any corruption of a valid header is an error or a header whose sizes add
// up to the file: never a crash, never a read past the end.
TEST(npy, corrupted_headers_never_crash_and_never_overrun) {
  const std::string good = npy_bytes("<f4", "(3, 2)", raw<float>({1, 2, 3, 4, 5, 6}));
  std::mt19937 rng(7);
  for (int i = 0; i < 20000; ++i) {
    std::string b = good;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) b[rng() % 80] = static_cast<char>(rng() % 256);
    if (rng() % 8 == 0) b.resize(rng() % b.size());
    auto h = parse_npy_header(b, b.size());
    if (h) {
      EXPECT_LE(h->data_offset + h->data_bytes, b.size());
      EXPECT_FALSE(h->shape.empty());
    }
  }
}

// Files written by NumPy itself (Debian's python3-numpy, installed by
// scripts/install-deps.sh).
TEST(npy, files_numpy_writes_read_back_the_same) {
  if (auto e = dtactor::testing::run_fixture("python3-numpy (scripts/install-deps.sh installs it)", "/usr/bin/python3.11 -c 'import numpy'"); !e.empty())
    SKIP_OR_FAIL_IN_CI(e);
  dtactor::testing::temp_dir d;
  const std::string script = d.path() + "/make.py";
  std::ofstream(script) << "import numpy as np, sys\n"
                           "d = sys.argv[1]\n"
                           "np.save(d + '/f32.npy', np.arange(24, dtype=np.float32).reshape(4, 3, 2) / 4)\n"
                           "np.save(d + '/u8.npy', np.arange(10, dtype=np.uint8) * 25)\n"
                           "np.save(d + '/i64.npy', -np.arange(5, dtype=np.int64) * (1 << 40))\n"
                           "np.save(d + '/f16.npy', np.array([0.5, -1.25, 65504], dtype=np.float16))\n"
                           "np.save(d + '/bool.npy', np.array([[True, False], [False, True]]))\n"
                           "np.save(d + '/f64.npy', np.linspace(0, 1, 7))\n"
                           "np.save(d + '/fortran.npy', np.asfortranarray(np.ones((3, 2), dtype=np.float32)))\n"
                           "np.save(d + '/be.npy', np.arange(3, dtype='>i4'))\n"
                           "with open(d + '/v2.npy', 'wb') as f: np.lib.format.write_array(f, np.arange(6, dtype=np.int16).reshape(2, 3), version=(2, 0))\n";
  ASSERT_EQ(std::system(("/usr/bin/python3.11 " + script + " " + d.path()).c_str()), 0);
  auto f32 = npy_array::open(d.path() + "/f32.npy");
  ASSERT_TRUE(f32) << f32.message();
  EXPECT_EQ(f32->shape(), (std::vector<int64_t>{4, 3, 2}));
  EXPECT_EQ(f32->row_bytes(), 24u);
  for (uint64_t k = 0; k < 24; ++k) EXPECT_DOUBLE_EQ(f32->at(k), k / 4.0);
  auto u8 = npy_array::open(d.path() + "/u8.npy");
  ASSERT_TRUE(u8) << u8.message();
  EXPECT_DOUBLE_EQ(u8->at(9), 225);
  auto i64 = npy_array::open(d.path() + "/i64.npy");
  ASSERT_TRUE(i64) << i64.message();
  EXPECT_DOUBLE_EQ(i64->at(4), -4.0 * (1ll << 40));
  auto f16 = npy_array::open(d.path() + "/f16.npy");
  ASSERT_TRUE(f16) << f16.message();
  EXPECT_DOUBLE_EQ(f16->at(1), -1.25);
  EXPECT_DOUBLE_EQ(f16->at(2), 65504);
  auto b = npy_array::open(d.path() + "/bool.npy");
  ASSERT_TRUE(b) << b.message();
  EXPECT_EQ(b->dtype(), npy_dtype::b1);
  EXPECT_DOUBLE_EQ(b->at(3), 1);
  EXPECT_DOUBLE_EQ(b->at(1), 0);
  auto f64 = npy_array::open(d.path() + "/f64.npy");
  ASSERT_TRUE(f64) << f64.message();
  EXPECT_DOUBLE_EQ(f64->at(6), 1.0);
  auto v2 = npy_array::open(d.path() + "/v2.npy");
  ASSERT_TRUE(v2) << v2.message();
  EXPECT_DOUBLE_EQ(v2->at(5), 5);
  EXPECT_NE(open_error(d.path() + "/fortran.npy").find("Fortran order"), std::string::npos);
  EXPECT_NE(open_error(d.path() + "/be.npy").find("big-endian"), std::string::npos);
}

// nanoGPT's .bin token streams.
TEST(token_file, ids_are_read_little_endian_and_windows_are_consecutive) {
  dtactor::testing::temp_dir d;
  auto path = write(d, "train.bin", raw<uint16_t>({5, 300, 65, 1000, 2}));
  auto t = token_file::open(path, 1024);
  ASSERT_TRUE(t) << t.message();
  EXPECT_EQ(t->size(), 5u);
  EXPECT_EQ(t->at(1), 300);
  std::vector<int64_t> w;
  t->window(1, 3, w);
  EXPECT_EQ(w, (std::vector<int64_t>{300, 65, 1000}));
}

TEST(token_file, bad_streams_are_one_clear_line) {
  dtactor::testing::temp_dir d;
  auto err = [&](const std::string& name, const std::string& bytes, uint32_t vocab, uint64_t min_tokens) {
    auto t = token_file::open(write(d, name, bytes), vocab, min_tokens);
    return t ? std::string("(opened)") : t.message();
  };
  EXPECT_NE(err("odd.bin", "abc", 100, 1).find("odd number"), std::string::npos);
  EXPECT_NE(err("short.bin", raw<uint16_t>({1, 2}), 100, 5).find("holds 2 tokens; at least 5 are needed"), std::string::npos);
  const auto range = err("range.bin", raw<uint16_t>({1, 2, 500, 3}), 256, 2);
  EXPECT_NE(range.find("token id 500 at position 2 is outside the model's vocabulary of 256"), std::string::npos) << range;
  EXPECT_NE(range.find("range.bin"), std::string::npos) << range;
}

TEST(token_file, a_stream_numpy_writes_as_nanogpt_does_reads_back) {
  if (auto e = dtactor::testing::run_fixture("python3-numpy (scripts/install-deps.sh installs it)", "/usr/bin/python3.11 -c 'import numpy'"); !e.empty())
    SKIP_OR_FAIL_IN_CI(e);
  dtactor::testing::temp_dir d;
  // nanoGPT's prepare.py: np.array(ids, dtype=np.uint16).tofile('train.bin')
  const std::string cmd = "/usr/bin/python3.11 -c \"import numpy as np; np.array([7, 40000, 65535, 0], dtype=np.uint16).tofile('" + d.path() +
                          "/train.bin')\"";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  auto t = token_file::open(d.path() + "/train.bin", 65536);
  ASSERT_TRUE(t) << t.message();
  ASSERT_EQ(t->size(), 4u);
  EXPECT_EQ(t->at(1), 40000);
  EXPECT_EQ(t->at(2), 65535);
}
