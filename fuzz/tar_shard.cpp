// Tar shards (data/webdataset.hpp) and their images (data/image_decode.hpp):
// shards come from a shared drive or a bucket that others write. Properties:
// reading the archive whole and streaming it in pieces agree on the sample
// count; every member lies inside the archive; errors are one line; images
// decode to exactly height x width x channels pixels or are refused.
#include <string>

#include "fuzz/fuzz_util.hpp"
#include "data/image_decode.hpp"
#include "data/webdataset.hpp"

using namespace dtactor;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto whole = read_tar_samples(data, size, "shard a.tar");
  auto counter = record_counter::for_name("a.tar", "shard a.tar");
  status streamed;
  const size_t piece = size ? 1 + data[0] % 997 : 1;
  for (size_t at = 0; at < size && streamed; at += piece) streamed = counter->update(data + at, std::min(piece, size - at));
  auto count = streamed ? counter->finish(size) : result<int64_t>(streamed.err());
  if (!whole) {
    if (whole.message().find('\n') != std::string::npos) fuzz::fail("an error of more than one line");
    // Both see the same headers, and both refuse a file cut short.
    if (count) fuzz::fail("whole read refused what the streaming count accepted");
    return 0;
  }
  if (!count || count.value() != static_cast<int64_t>(whole->size())) fuzz::fail("the streaming count differs from the whole read");
  for (const auto& s : whole.value())
    for (const auto& [ext, e] : s.members) {
      if (e.offset > size || e.size > size - e.offset) fuzz::fail("a member outside the archive");
      if (ext == "png" || ext == "jpg") {
        auto img = decode_image(data + e.offset, e.size, ext, "shard a.tar: member");
        if (!img) {
          if (img.message().find('\n') != std::string::npos) fuzz::fail("an image error of more than one line");
        } else if (img->pixels.size() != static_cast<size_t>(img->height * img->width * img->channels) || (img->channels != 1 && img->channels != 3)) {
          fuzz::fail("an image whose pixels do not match its shape");
        }
      }
    }
  return 0;
}
