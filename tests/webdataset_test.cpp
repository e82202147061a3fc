// Tar shards and their images (data/webdataset.hpp, data/image_decode.hpp,
// docs/data.md "Tar shards"): archives as Python's tarfile writes them
// (ustar, ustar with a prefix, GNU long names, pax) and images as PIL
// writes them, from tests/data/make_tar_fixtures.py; damaged ones made
// here. Torch-free.
#include "data/webdataset.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "data/data_shards.hpp"
#include "data/image_decode.hpp"
#include "test_util.hpp"

namespace dtactor {
namespace {

using testing::temp_dir;

std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

void write(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes; }

std::string b64decode(const std::string& in) {
  static const std::string chars = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  uint32_t buf = 0;
  int bits = 0;
  for (char c : in) {
    if (c == '=') break;
    buf = (buf << 6) | static_cast<uint32_t>(chars.find(c));
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((buf >> bits) & 0xff);
    }
  }
  return out;
}

// The fixtures, written once per test program (python3-pil, python3-numpy).
// Why they could not be written (empty: they were).
const std::string& fixtures_error() {
  static const std::string error =
      testing::run_fixture("tests/data/make_tar_fixtures.py (python3-pil, python3-numpy; scripts/install-deps.sh --test)",
                           "/usr/bin/python3.11 " + std::string(DTACTOR_SOURCE_DIR) + "/tests/data/make_tar_fixtures.py " +
                               (std::filesystem::temp_directory_path() / ("dtactor-tar-" + std::to_string(::getpid()))).string());
  return error;
}
const std::string& fixtures() {
  static const std::string dir = [] {
    std::string d = (std::filesystem::temp_directory_path() / ("dtactor-tar-" + std::to_string(::getpid()))).string();
    return fixtures_error().empty() ? d : std::string();
  }();
  return dir;
}

#define NEED_FIXTURES()                                                                                  \
  do {                                                                                                   \
    if (fixtures().empty()) SKIP_OR_FAIL_IN_CI(fixtures_error());                                 \
  } while (0)

nlohmann::json expected() { return nlohmann::json::parse(read_all(fixtures() + "/expected.json")); }

bool one_line(const std::string& s) { return !s.empty() && s.find('\n') == std::string::npos; }

TEST(webdataset, tar_files_python_writes_group_into_samples_by_key_in_every_header_format) {
  NEED_FIXTURES();
  const auto want = expected()["tars"];
  for (const std::string name : {"ustar.tar", "ustar_prefix.tar", "gnu.tar", "pax.tar"}) {
    const std::string bytes = read_all(fixtures() + "/" + name);
    auto got = read_tar_samples(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), name);
    ASSERT_TRUE(got) << got.message();
    const auto& w = want[name];
    ASSERT_EQ(got->size(), w.size()) << name;
    for (size_t i = 0; i < w.size(); ++i) {
      const tar_sample& s = got.value()[i];
      EXPECT_EQ(s.key, w[i]["key"].get<std::string>()) << name;
      ASSERT_EQ(s.members.size(), w[i]["members"].size()) << name << " " << s.key;
      for (const auto& [ext, payload] : w[i]["members"].items()) {
        const tar_entry* e = s.member(ext);
        ASSERT_NE(e, nullptr) << name << " " << s.key << " ." << ext;
        EXPECT_EQ(bytes.substr(e->offset, e->size), b64decode(payload.get<std::string>())) << name << " " << s.key << " ." << ext;
      }
    }
    EXPECT_EQ(got.value()[3].member("seg.png") != nullptr, true) << "an extension is everything after the first dot";
  }
}

TEST(webdataset, counting_records_while_bytes_stream_past_in_any_piece_size_agrees_with_reading_it_whole) {
  NEED_FIXTURES();
  for (const std::string name : {"ustar.tar", "gnu.tar", "pax.tar"}) {
    const std::string bytes = read_all(fixtures() + "/" + name);
    for (size_t piece : {size_t{1}, size_t{7}, size_t{511}, size_t{512}, size_t{4096}, bytes.size()}) {
      auto c = record_counter::for_name(name, name);
      ASSERT_TRUE(c);
      for (size_t at = 0; at < bytes.size(); at += piece)
        ASSERT_TRUE(c->update(reinterpret_cast<const uint8_t*>(bytes.data()) + at, std::min(piece, bytes.size() - at)));
      auto n = c->finish(bytes.size());
      ASSERT_TRUE(n) << n.message();
      EXPECT_EQ(n.value(), 4) << name << " in pieces of " << piece;
    }
  }
  // Lines (a last one without a newline counts), .npy rows, and kinds without records.
  const std::string csv = "a,b\n1,2\n3,4";
  EXPECT_EQ(count_records("x.csv", reinterpret_cast<const uint8_t*>(csv.data()), csv.size(), "x").value(), 3);
  EXPECT_EQ(count_records("x.jsonl", reinterpret_cast<const uint8_t*>("{}\n{}\n"), 6, "x").value(), 2);
  EXPECT_EQ(count_records("x.bin", reinterpret_cast<const uint8_t*>("ab"), 2, "x").value(), -1);
}

TEST(webdataset, damaged_archives_are_one_line_naming_the_shard_never_a_short_read) {
  NEED_FIXTURES();
  const std::string good = read_all(fixtures() + "/ustar.tar");
  auto parse = [](const std::string& b) { return read_tar_samples(reinterpret_cast<const uint8_t*>(b.data()), b.size(), "shard /x/a.tar"); };
  // Cut inside a file, inside a header; a flipped header byte; not a tar at all.
  const auto first = parse(good);
  ASSERT_TRUE(first);
  const tar_entry* png = first.value()[0].member("png");
  ASSERT_NE(png, nullptr);
  std::string bad_sum = good;
  bad_sum[png->offset - 512 + 3] ^= 0x20;  // the file name of the first image's header
  for (const auto& [bytes, says] : std::vector<std::pair<std::string, std::string>>{
           {good.substr(0, png->offset + 10), "truncated"},
           {good.substr(0, png->offset - 100), "ends inside a header"},
           {bad_sum, "wrong checksum"},
           {std::string(2048, 'x'), "no checksum"}}) {
    auto r = parse(bytes);
    ASSERT_FALSE(r) << says;
    EXPECT_TRUE(one_line(r.message())) << r.message();
    EXPECT_EQ(r.message().rfind("shard /x/a.tar: ", 0), 0u) << r.message();
    EXPECT_NE(r.message().find(says), std::string::npos) << r.message();
  }
  // A sample whose files are not consecutive, and one with two files of one kind.
  temp_dir d;
  const std::string script = "import io,tarfile,sys\n"
                             "def add(t,n):\n"
                             "  i=tarfile.TarInfo(n); i.size=1; t.addfile(i, io.BytesIO(b'1'))\n"
                             "with tarfile.open(sys.argv[1]+'/split.tar','w') as t:\n"
                             "  [add(t,n) for n in ['a.png','a.cls','b.png','a.json']]\n"
                             "with tarfile.open(sys.argv[1]+'/twice.tar','w') as t:\n"
                             "  [add(t,n) for n in ['a.png','a.cls','a.PNG']]\n";
  write(d.path() + "/make.py", script);
  ASSERT_EQ(std::system(("/usr/bin/python3.11 " + d.path() + "/make.py " + d.path()).c_str()), 0);
  auto split = parse(read_all(d.path() + "/split.tar"));
  ASSERT_FALSE(split);
  EXPECT_NE(split.message().find("sample 'a' comes back after other samples' files"), std::string::npos) << split.message();
  auto twice = parse(read_all(d.path() + "/twice.tar"));
  ASSERT_FALSE(twice);
  EXPECT_NE(twice.message().find("sample 'a' has two '.png' files"), std::string::npos) << twice.message();
}

TEST(webdataset, the_shard_index_records_samples_rows_and_lines_and_resolving_hands_them_on) {
  NEED_FIXTURES();
  temp_dir d;
  std::filesystem::copy_file(fixtures() + "/gnu.tar", d.path() + "/a.tar");
  std::filesystem::copy_file(fixtures() + "/ustar.tar", d.path() + "/b.tar");
  write(d.path() + "/rows.csv", "x,y\n1,2\n3,4\n");
  ASSERT_EQ(std::system(("/usr/bin/python3.11 -c \"import numpy as np; np.save('" + d.path() + "/m.npy', np.zeros((13, 2), np.float32))\"").c_str()), 0);
  write(d.path() + "/t.bin", std::string(64, '\0'));
  auto n = write_shard_index(d.path() + "/*");
  ASSERT_TRUE(n) << n.message();
  EXPECT_EQ(n.value(), 5u);
  auto shards = resolve_shards(d.path() + "/*");
  ASSERT_TRUE(shards) << shards.message();
  std::map<std::string, int64_t> records;
  for (const auto& s : shards.value()) records[std::filesystem::path(s.url).filename().string()] = s.records;
  EXPECT_EQ(records, (std::map<std::string, int64_t>{{"a.tar", 4}, {"b.tar", 4}, {"m.npy", 13}, {"rows.csv", 3}, {"t.bin", -1}}));
  // Without an index nothing is counted; a count that cannot be is refused.
  std::filesystem::remove(d.path() + "/" + shard_index_name);
  auto plain = resolve_shards(d.path() + "/a.tar,");
  ASSERT_TRUE(plain) << plain.message();
  EXPECT_EQ(plain.value()[0].records, -1);
  write(d.path() + "/b.tar", read_all(fixtures() + "/ustar.tar").substr(0, 700));
  auto refused = write_shard_index(d.path() + "/*.tar");
  ASSERT_FALSE(refused);
  EXPECT_TRUE(one_line(refused.message())) << refused.message();
  EXPECT_NE(refused.message().find("b.tar: not a valid tar archive"), std::string::npos) << refused.message();
  // An index entry whose records are not a count is malformed.
  auto bad = parse_shard_index(R"({"version":1,"shards":[{"name":"a.tar","bytes":10,"xxh3":"0123456789abcdef","records":-2}]})", "/x/i.json");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.message().find("\"records\" is not a count"), std::string::npos) << bad.message();
}

TEST(webdataset, png_and_jpeg_decode_to_the_pixels_pil_reads_and_damaged_images_are_refused) {
  NEED_FIXTURES();
  const auto want = expected()["images"];
  for (const auto& [name, w] : want.items()) {
    const std::string bytes = read_all(fixtures() + "/" + name);
    const std::string ext = name.substr(name.find('.') + 1);
    auto img = decode_image(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), ext, name);
    ASSERT_TRUE(img) << img.message();
    const auto shape = w["shape"].get<std::vector<int64_t>>();
    EXPECT_EQ((std::vector<int64_t>{img->height, img->width, img->channels}), shape) << name;
    const auto pixels = w["pixels"].get<std::vector<int>>();
    ASSERT_EQ(img->pixels.size(), pixels.size()) << name;
    int worst = 0;
    for (size_t i = 0; i < pixels.size(); ++i) worst = std::max(worst, std::abs(int(img->pixels[i]) - pixels[i]));
    // PNG is lossless; JPEG decoded by the same libjpeg-turbo as PIL's.
    EXPECT_EQ(worst, 0) << name;
  }
  const std::string png = read_all(fixtures() + "/rgb.png"), jpg = read_all(fixtures() + "/rgb.jpg");
  for (const auto& [bytes, ext] : std::vector<std::pair<std::string, std::string>>{
           {png.substr(0, png.size() / 2), "png"}, {jpg.substr(0, jpg.size() / 2), "jpg"}, {"not an image", "png"}, {"not an image", "jpg"}}) {
    auto r = decode_image(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), ext, "shard /x/a.tar: 'k." + ext + "'");
    ASSERT_FALSE(r) << ext << " " << bytes.size();
    EXPECT_TRUE(one_line(r.message())) << r.message();
    EXPECT_EQ(r.message().rfind("shard /x/a.tar: 'k." + ext + "': ", 0), 0u) << r.message();
  }
  // A PNG header that claims 2^17 x 2^17 pixels is refused before any memory is taken.
  std::string huge = png;
  huge[16] = 0, huge[17] = 2, huge[18] = 0, huge[19] = 0;  // width (IHDR, big-endian)
  huge[20] = 0, huge[21] = 2, huge[22] = 0, huge[23] = 0;  // height
  auto r = decode_image(reinterpret_cast<const uint8_t*>(huge.data()), huge.size(), "png", "big.png");
  ASSERT_FALSE(r);
  EXPECT_TRUE(one_line(r.message())) << r.message();
}

}  // namespace
}  // namespace dtactor
