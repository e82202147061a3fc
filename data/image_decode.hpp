#pragma once
// Images of tar shards (docs/data.md "Tar shards"): PNG through libpng's
// simplified API, JPEG through libjpeg-turbo, both Debian packages. Decoded
// to 8-bit pixels, height x width x channels, with 1 channel for a gray
// image and 3 for a colour one (an alpha channel is dropped, as PIL's
// convert("RGB") does).
// Outside bytes: a corrupt or truncated image is one line, never a crash or
// a partly gray picture. No LibTorch here.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "dtactor/result.hpp"

namespace dtactor {

struct decoded_image {
  int64_t height = 0, width = 0, channels = 0;
  std::vector<uint8_t> pixels;  // height * width * channels, row by row
};

// The most pixels an image may have (width x height): a header that claims
// more is refused before any memory is taken.
inline constexpr uint64_t max_image_pixels = uint64_t{1} << 26;

// `ext` is the member's extension: "png", "jpg" or "jpeg". Errors name `where`.
result<decoded_image> decode_image(const uint8_t* data, size_t size, const std::string& ext, const std::string& where);

}  // namespace dtactor
