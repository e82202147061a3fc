#pragma once
// S3-compatible object storage as an object_store (storage/object_store.hpp):
// Signature Version 4 (OpenSSL's SHA-256 and HMAC), HTTP through libcurl.
// Objects are written as multipart uploads streamed in parts of
// `part_bytes` (one PUT when smaller), read with ranged GETs, listed with
// ListObjectsV2, removed with DELETE; a writer dropped without commit()
// aborts its upload. Transient failures (connection errors, HTTP 5xx, 429,
// SlowDown) are retried with exponential backoff; anything else is one line
// naming the request, the object and S3's error code and message.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "storage/object_store.hpp"
#include "dtactor/result.hpp"

namespace dtactor {

struct s3_credentials {
  std::string access_key, secret_key, session_token;
};

struct s3_options {
  std::string bucket;
  std::string prefix;    // no leading or trailing '/'; may be empty
  std::string endpoint;  // "http://127.0.0.1:7480" (path-style); empty: https://BUCKET.s3.REGION.amazonaws.com
  std::string region = "us-east-1";
  s3_credentials credentials;
  uint64_t part_bytes = 8ull << 20;  // >= 5 MiB (S3's minimum part)
  int attempts = 6;                  // per request, with backoff from 100 ms
};

// "s3://bucket/some/prefix" -> bucket and prefix; errors name the URL.
result<std::pair<std::string, std::string>> parse_s3_url(const std::string& url);

// Credentials as the AWS tools find them: AWS_ACCESS_KEY_ID /
// AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, else the profile
// (AWS_PROFILE, default "default") of AWS_SHARED_CREDENTIALS_FILE or
// ~/.aws/credentials. Error: one line saying where it looked.
result<s3_credentials> s3_credentials_from_environment();

// Options for `url` from the environment: credentials as above, region from
// AWS_REGION or AWS_DEFAULT_REGION (default us-east-1), endpoint from
// `endpoint` if not empty, else AWS_ENDPOINT_URL.
result<s3_options> s3_options_for(const std::string& url, const std::string& endpoint);

// Checks the bucket answers (one list) with these credentials.
result<std::unique_ptr<object_store>> open_s3_store(s3_options options);

// Creates options.bucket (tests, scripts; dtactor itself never creates buckets).
status s3_create_bucket(const s3_options& options);

// S3's XML responses as the store reads them (pure: tests and the fuzz
// target fuzz/s3_xml.cpp drive them without a server). S3's responses are
// flat enough for a tag scanner; the five XML entities are decoded.
struct s3_list_page {
  std::vector<object_info> objects;  // directly under `prefix`, in the response's order
  bool truncated = false;            // IsTruncated
  std::string next_token;            // NextContinuationToken
};
// ListObjectsV2 (GET ?list-type=2&prefix=P). `prefix`: "" or "some/prefix/".
s3_list_page parse_list_objects(const std::string& xml, const std::string& prefix);
// An error response's Code and Message (empty when absent).
struct s3_error_body {
  std::string code, message;
};
s3_error_body parse_s3_error(const std::string& xml);
// InitiateMultipartUpload: the UploadId (empty when absent).
std::string parse_upload_id(const std::string& xml);
// ListMultipartUploads (GET ?uploads&prefix=P): each upload in flight, as
// (object name under `prefix`, key, upload id).
struct s3_upload {
  std::string name, key, upload_id;
};
std::vector<s3_upload> parse_multipart_uploads(const std::string& xml, const std::string& prefix);

// SigV4 pieces, exposed for tests against AWS's published examples.
std::string sha256_hex(const void* data, size_t size);
std::string sigv4_signature(const std::string& secret, const std::string& date, const std::string& region, const std::string& service,
                            const std::string& string_to_sign);
// RFC 3986 percent-encoding as SigV4 wants it ('/' kept when `path`).
std::string uri_encode(const std::string& s, bool path);

}  // namespace dtactor
