#include "model/fashion_mnist.hpp"

#include <gtest/gtest.h>
#include <zlib.h>

#include <fstream>
#include <iterator>

#include "test_util.hpp"

namespace dtactor {
namespace {

const std::string kDir = "/usr/share/datasets/fashion-mnist";

TEST(FashionMnist, ReadsTheDebianFiles) {
  auto train = load_fashion_mnist(kDir, "train");
  ASSERT_TRUE(train) << train.message();
  EXPECT_EQ(train->images.sizes(), (std::vector<int64_t>{60000, 28, 28}));
  EXPECT_EQ(train->labels.size(0), 60000);
  // Fashion-MNIST is balanced: 6,000 images per class.
  auto counts = torch::bincount(train->labels);
  for (int c = 0; c < 10; ++c) EXPECT_EQ(counts[c].item<int64_t>(), 6000);
  auto test = load_fashion_mnist(kDir, "test");
  ASSERT_TRUE(test) << test.message();
  EXPECT_EQ(test->images.size(0), 10000);
  const double mean = train->images.to(torch::kFloat).mean().item<double>() / 255.0;
  EXPECT_NEAR(mean, 0.286, 0.002);
}

TEST(FashionMnist, MissingDirectorySaysWhatToInstall) {
  auto r = load_fashion_mnist("/nonexistent", "train");
  ASSERT_FALSE(r);
  EXPECT_NE(r.message().find("dataset-fashion-mnist"), std::string::npos) << r.message();
}

void write_gz(const std::string& path, const std::vector<uint8_t>& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
  gzclose(f);
}

TEST(FashionMnist, CorruptFilesAreErrors) {
  testing::temp_dir d;
  const std::string img = d.path() + "/i.gz", lab = d.path() + "/l.gz";
  // Bad magic.
  write_gz(img, {0, 0, 9, 9, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 7});
  write_gz(lab, {0, 0, 8, 1, 0, 0, 0, 1, 3});
  auto r = read_idx_pair(img, lab);
  ASSERT_FALSE(r);
  EXPECT_NE(r.message().find("bad magic"), std::string::npos) << r.message();
  // Header promises 2 images, file holds 1.
  write_gz(img, {0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 1, 7});
  r = read_idx_pair(img, lab);
  ASSERT_FALSE(r);
  EXPECT_NE(r.message().find("truncated"), std::string::npos) << r.message();
  // Not gzip at all.
  { std::ofstream(img) << "this is not gzip data, just text"; }
  r = read_idx_pair(img, lab);
  ASSERT_FALSE(r);
  // A good pair reads.
  write_gz(img, {0, 0, 8, 3, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 7});
  r = read_idx_pair(img, lab);
  ASSERT_TRUE(r) << r.message();
  EXPECT_EQ(r->labels[0].item<int64_t>(), 3);
}

std::vector<uint8_t> file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

void put_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

TEST(FashionMnist, BothInflatersGiveTheSameBytes) {
  for (const char* name : {"train-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"}) {
    auto fast = inflate_gz_file(kDir + "/" + name, gz_inflater::libdeflate);
    auto streamed = inflate_gz_file(kDir + "/" + name, gz_inflater::zlib);
    ASSERT_TRUE(fast) << fast.message();
    ASSERT_TRUE(streamed) << streamed.message();
    EXPECT_GT(fast->size(), 16u);
    EXPECT_TRUE(fast.value() == streamed.value()) << name;
  }
}

// Two gzip members one after the other (what `cat a.gz b.gz` makes) are one
// stream to gzip; libdeflate inflates one member a call, so the read falls
// back to zlib and still returns both.
TEST(FashionMnist, SeveralMembersReadWhole) {
  testing::temp_dir d;
  write_gz(d.path() + "/a.gz", {1, 2, 3});
  write_gz(d.path() + "/b.gz", {4, 5});
  auto both = file_bytes(d.path() + "/a.gz");
  const auto b = file_bytes(d.path() + "/b.gz");
  both.insert(both.end(), b.begin(), b.end());
  put_bytes(d.path() + "/ab.gz", both);
  auto r = inflate_gz_file(d.path() + "/ab.gz");
  ASSERT_TRUE(r) << r.message();
  EXPECT_EQ(r.value(), (std::vector<uint8_t>{1, 2, 3, 4, 5}));
}

// A flipped byte, a cut file, and a trailer claiming 4 GiB for a few bytes
// of input are each one error, never bytes handed on or a huge allocation.
TEST(FashionMnist, DamagedGzipIsAnError) {
  testing::temp_dir d;
  std::vector<uint8_t> data(100000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>((i * 7919) % 251);
  write_gz(d.path() + "/good.gz", data);
  const auto good = file_bytes(d.path() + "/good.gz");
  auto ok = inflate_gz_file(d.path() + "/good.gz");
  ASSERT_TRUE(ok) << ok.message();
  EXPECT_EQ(ok.value(), data);

  auto flipped = good;
  flipped[flipped.size() / 2] ^= 0x40;
  put_bytes(d.path() + "/flipped.gz", flipped);
  auto cut = good;
  cut.resize(good.size() / 2);
  put_bytes(d.path() + "/cut.gz", cut);
  auto huge = good;
  for (size_t i = huge.size() - 4; i < huge.size(); ++i) huge[i] = 0xff;
  put_bytes(d.path() + "/huge.gz", huge);
  for (const char* name : {"flipped.gz", "cut.gz", "huge.gz"}) {
    auto r = inflate_gz_file(d.path() + "/" + name);
    ASSERT_FALSE(r) << name;
    EXPECT_NE(r.message().find(name), std::string::npos) << r.message();
  }
}

}  // namespace
}  // namespace dtactor
