// SigV4 against AWS's published example (GET Object, "Signature
// Calculations for the Authorization Header"), and the s3:// URL parser.
#include <gtest/gtest.h>

#include "storage/s3_store.hpp"

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

// Retries, against a tiny HTTP server on loopback that answers the first
// `fail_first` requests with `fail_status` (S3's SlowDown body) and then an
// empty ListObjectsV2 result.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <thread>

namespace dtactor {
namespace {

class flaky_server {
 public:
  flaky_server(int fail_first, int fail_status) : fail_first_(fail_first), status_(fail_status) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a);
    socklen_t len = sizeof a;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    ::listen(fd_, 16);
    thread_ = std::thread([this] { serve(); });
  }
  ~flaky_server() {
    stop_ = true;
    ::shutdown(fd_, SHUT_RDWR);
    ::close(fd_);
    thread_.join();
  }
  int port() const { return port_; }
  int requests() const { return requests_.load(); }

 private:
  void serve() {
    while (!stop_) {
      const int c = ::accept(fd_, nullptr, nullptr);
      if (c < 0) return;
      for (;;) {  // keep-alive: one request after another on this connection
        std::string req;
        char buf[4096];
        while (req.find("\r\n\r\n") == std::string::npos) {
          const ssize_t n = ::read(c, buf, sizeof buf);
          if (n <= 0) break;
          req.append(buf, static_cast<size_t>(n));
        }
        if (req.find("\r\n\r\n") == std::string::npos) break;
        const int i = requests_.fetch_add(1);
        std::string body, head;
        if (i < fail_first_) {
          body = "<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>";
          head = "HTTP/1.1 " + std::to_string(status_) + " Slow Down\r\n";
        } else {
          body = "<ListBucketResult><IsTruncated>false</IsTruncated></ListBucketResult>";
          head = "HTTP/1.1 200 OK\r\n";
        }
        const std::string resp = head + "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
        if (::write(c, resp.data(), resp.size()) < 0) break;
      }
      ::close(c);
    }
  }
  int fd_ = -1, port_ = 0, fail_first_, status_;
  std::atomic<int> requests_{0};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

s3_options flaky_opts(int port, int attempts) {
  s3_options o;
  o.bucket = "bucket";
  o.prefix = "p";
  o.endpoint = "http://127.0.0.1:" + std::to_string(port);
  o.credentials = {"AKID", "SECRET", ""};
  o.attempts = attempts;
  return o;
}

TEST(s3_retries, throttling_and_server_errors_are_retried_with_backoff) {
  flaky_server server(2, 503);
  const auto t0 = std::chrono::steady_clock::now();
  auto store = open_s3_store(flaky_opts(server.port(), 4));  // its probe is a list
  ASSERT_TRUE(store) << store.message();
  EXPECT_EQ(server.requests(), 3);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(300)) << "backoff: 100 ms, then 200 ms";
}

TEST(s3_retries, a_server_that_keeps_failing_is_given_up_on_in_one_line) {
  flaky_server server(1000, 500);
  auto store = open_s3_store(flaky_opts(server.port(), 3));
  ASSERT_FALSE(store);
  EXPECT_EQ(server.requests(), 3);
  EXPECT_NE(store.message().find("gave up after 3 attempts"), std::string::npos) << store.message();
  EXPECT_NE(store.message().find("HTTP 500 SlowDown (Please reduce your request rate.)"), std::string::npos) << store.message();
  EXPECT_EQ(store.message().find('\n'), std::string::npos);
}

TEST(s3_retries, nothing_listening_is_a_clear_line) {
  auto port = 1;  // nothing listens on port 1
  auto store = open_s3_store(flaky_opts(port, 2));
  ASSERT_FALSE(store);
  EXPECT_NE(store.message().find("cannot reach http://127.0.0.1:1"), std::string::npos) << store.message();
}

}  // namespace
}  // namespace dtactor
