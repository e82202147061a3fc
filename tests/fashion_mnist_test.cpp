#include "model/fashion_mnist.hpp"

#include <gtest/gtest.h>
#include <zlib.h>

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

}  // namespace
}  // namespace dtactor
