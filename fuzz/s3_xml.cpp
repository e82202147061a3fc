// S3's XML responses (storage/s3_store.hpp): ListObjectsV2 pages, error
// bodies, InitiateMultipartUpload and ListMultipartUploads, as the
// checkpoint store reads them from whatever answers at the endpoint (AWS,
// radosgw, MinIO, a proxy, a stranger on the path without TLS). The first
// byte picks the response and the store's prefix. Properties: no parser
// crashes; listed objects are names directly under the prefix; the uploads
// the store's sweep would abort all lie under its prefix.
#include "fuzz/fuzz_util.hpp"
#include "storage/s3_store.hpp"

using namespace dtactor;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string xml(reinterpret_cast<const char*>(data + 1), size - 1);
  const std::string prefix = data[0] & 0x10 ? "ckpt/run-1/" : "";
  switch (data[0] % 4) {
    case 0: {
      const auto page = parse_list_objects(xml, prefix);
      for (const auto& o : page.objects)
        if (o.name.empty() || o.name.find('/') != std::string::npos) fuzz::fail("a listed name that is not an object directly under the prefix");
      break;
    }
    case 1:
      (void)parse_s3_error(xml);
      break;
    case 2:
      (void)parse_upload_id(xml);
      break;
    default:
      for (const auto& u : parse_multipart_uploads(xml, prefix))
        if (u.key.compare(0, prefix.size(), prefix) != 0 || u.key != prefix + u.name)
          fuzz::fail("the sweep would abort an upload outside the store's prefix");
      break;
  }
  return 0;
}
