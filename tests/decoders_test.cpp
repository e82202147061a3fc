// Decoders of bytes from outside the process: the inputs fuzzing found
// (fuzz/, docs/fuzzing.md), each a regression test that fails without its
// fix. Torch-free and quick to build.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "examples/custom_task/csv_rows.hpp"
#include "runtime/checkpoint_store.hpp"
#include "runtime/s3_store.hpp"
#include "tests/test_util.hpp"

namespace dtactor {
namespace {

// fuzz_checkpoint_manifest: a manifest whose store says it is 2^40 bytes (a
// sparse file planted in a shared checkpoint directory; an S3 server's
// Content-Length) made object_store::get allocate all of it: the coordinator
// died of std::bad_alloc at start instead of skipping the manifest.
TEST(Decoders, AManifestThatClaims2To40BytesIsRefusedWithoutAllocatingThem) {
  testing::temp_dir dir;
  const std::string path = dir.path() + "/" + manifest_name(7);
  {
    std::ofstream f(path, std::ios::binary);
    f << "DTACMAN2";
  }
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(1) << 40), 0) << "a sparse file of 2^40 bytes";
  auto objects = open_directory_store_readonly(dir.path());
  ASSERT_TRUE(objects) << objects.message();
  auto store = checkpoint_store::over(std::shared_ptr<object_store>(std::move(objects.value())), checkpoint_policy{});
  auto meta = store.read_manifest(manifest_name(7));
  ASSERT_FALSE(meta);
  EXPECT_NE(meta.message().find("1099511627776 bytes"), std::string::npos) << meta.message();
  std::vector<std::string> skipped;
  auto newest = store.newest_valid([&](const std::string& p, const std::string&) { skipped.push_back(p); }, true);
  ASSERT_TRUE(newest) << newest.message();
  EXPECT_FALSE(newest.value());
  EXPECT_EQ(skipped.size(), 1u);
}

// fuzz_s3_xml: ListMultipartUploads keys outside the store's prefix (a key
// shorter than the prefix threw std::out_of_range; others were taken as the
// store's), and keys of deeper "folders": a coordinator on s3://bucket
// aborted the uploads in flight of every other job in the bucket.
TEST(Decoders, S3UploadsOutsideThePrefixAreNotTheStores) {
  const std::string xml =
      "<ListMultipartUploadsResult><Upload><Key>ab</Key><UploadId>1</UploadId></Upload>"
      "<Upload><Key>other/ckpt-000000001.g1.r0-of-1.part</Key><UploadId>2</UploadId></Upload>"
      "<Upload><Key>run/ckpt-000000002.g1.r0-of-1.part</Key><UploadId>3</UploadId></Upload>"
      "<Upload><Key>run/sub/x</Key><UploadId>4</UploadId></Upload></ListMultipartUploadsResult>";
  auto ups = parse_multipart_uploads(xml, "run/");
  ASSERT_EQ(ups.size(), 1u);
  EXPECT_EQ(ups[0].name, "ckpt-000000002.g1.r0-of-1.part");
  EXPECT_EQ(ups[0].key, "run/ckpt-000000002.g1.r0-of-1.part");
  EXPECT_EQ(ups[0].upload_id, "3");
  // The bucket's root: another job's prefix is not ours either.
  auto root = parse_multipart_uploads(xml, "");
  ASSERT_EQ(root.size(), 1u);
  EXPECT_EQ(root[0].key, "ab");
}

// fuzz_custom_task_csv: a label of 7.8e89 (or inf, nan) was converted to
// int64_t before its range was checked: undefined behaviour, caught here by
// UBSan (this target is built with -fsanitize=undefined).
TEST(Decoders, ACsvLabelOutsideInt64IsRefusedBeforeItIsConverted) {
  for (const std::string label : {"777777777777777777777777777777777777777777777777777777777777777777777777777777777777777609", "inf", "-inf", "nan", "1e19",
                                  "-1e19", "2.5", "3"}) {
    std::istringstream in("x,y,label\n0.5,0.25," + label + "\n");
    auto rows = tabular::parse_csv(in, "t.csv", 3);
    ASSERT_FALSE(rows) << label;
    EXPECT_NE(rows.message().find("is not a class id below model.classes (3)"), std::string::npos) << rows.message();
  }
  std::istringstream in("0.5,0.25,2\n1,2,0\n");
  auto rows = tabular::parse_csv(in, "t.csv", 3);
  ASSERT_TRUE(rows) << rows.message();
  EXPECT_EQ(rows->labels, (std::vector<int64_t>{2, 0}));
}

}  // namespace
}  // namespace dtactor
