// SigV4 against AWS's published example (GET Object, "Signature
// Calculations for the Authorization Header"), and the s3:// URL parser.
#include <gtest/gtest.h>

#include "runtime/s3_store.hpp"

namespace dtactor {
namespace {

TEST(s3_sigv4, matches_the_aws_get_object_example) {
  const std::string canonical =
      "GET\n/test.txt\n\nhost:examplebucket.s3.amazonaws.com\nrange:bytes=0-9\n"
      "x-amz-content-sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855\n"
      "x-amz-date:20130524T000000Z\n\nhost;range;x-amz-content-sha256;x-amz-date\n"
      "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
  EXPECT_EQ(sha256_hex("", 0), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  const std::string hashed = sha256_hex(canonical.data(), canonical.size());
  EXPECT_EQ(hashed, "7344ae5b7ee6c3e7e6b0fe0640412a37625d1fbfff95c48bbb2dc43964946972");
  const std::string to_sign = "AWS4-HMAC-SHA256\n20130524T000000Z\n20130524/us-east-1/s3/aws4_request\n" + hashed;
  EXPECT_EQ(sigv4_signature("wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "20130524", "us-east-1", "s3", to_sign),
            "f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41");
}

TEST(s3_sigv4, uri_encoding_keeps_unreserved_and_slashes_in_paths) {
  EXPECT_EQ(uri_encode("run 1/ckpt-000000001.manifest", true), "run%201/ckpt-000000001.manifest");
  EXPECT_EQ(uri_encode("a/b", false), "a%2Fb");
  EXPECT_EQ(uri_encode("A-z_0.9~", false), "A-z_0.9~");
  EXPECT_EQ(uri_encode("=&+", false), "%3D%26%2B");
}

TEST(s3_url, bucket_and_prefix_or_one_clear_line) {
  auto a = parse_s3_url("s3://my-bucket/runs/vit/");
  ASSERT_TRUE(a) << a.message();
  EXPECT_EQ(a->first, "my-bucket");
  EXPECT_EQ(a->second, "runs/vit");
  auto b = parse_s3_url("s3://bucket");
  ASSERT_TRUE(b);
  EXPECT_EQ(b->second, "");
  EXPECT_EQ(parse_s3_url("s3://B_ad/x").message(), "'s3://B_ad/x': a bucket name has lower-case letters, digits, '-' and '.' only");
  EXPECT_EQ(parse_s3_url("s3://ab").message(), "'s3://ab': a bucket name has 3 to 63 characters");
  EXPECT_EQ(parse_s3_url("/tmp/x").message(), "'/tmp/x' is not an s3:// URL");
}

}  // namespace
}  // namespace dtactor
