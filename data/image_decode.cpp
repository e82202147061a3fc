#include "data/image_decode.hpp"

#include <csetjmp>
#include <cstdio>
#include <cstring>

// jpeglib.h needs FILE and size_t declared first.
#include <jpeglib.h>
#include <png.h>

namespace dtactor {

namespace {

result<decoded_image> decode_png(const uint8_t* data, size_t size, const std::string& where) {
  png_image img;
  std::memset(&img, 0, sizeof img);
  img.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&img, data, size)) {
    const std::string why = img.message;
    png_image_free(&img);
    return make_error(where + ": not a PNG libpng can read: " + why);
  }
  if (static_cast<uint64_t>(img.width) * img.height > max_image_pixels) {
    png_image_free(&img);
    return make_error(where + ": a PNG of " + std::to_string(img.width) + "x" + std::to_string(img.height) + " pixels, more than the " +
                      std::to_string(max_image_pixels) + " allowed");
  }
  // Read with the alpha channel, then drop it: what PIL's convert("RGB")
  // (and "L") does, so pixels match what PyTorch users' loaders give.
  const bool color = (img.format & PNG_FORMAT_FLAG_COLOR) != 0;
  const bool alpha = (img.format & PNG_FORMAT_FLAG_ALPHA) != 0;
  img.format = color ? (alpha ? PNG_FORMAT_RGBA : PNG_FORMAT_RGB) : (alpha ? PNG_FORMAT_GA : PNG_FORMAT_GRAY);
  std::vector<uint8_t> read(PNG_IMAGE_SIZE(img));
  if (!png_image_finish_read(&img, nullptr, read.data(), 0, nullptr)) {
    const std::string why = img.message;
    png_image_free(&img);
    return make_error(where + ": a damaged PNG: " + why);
  }
  png_image_free(&img);
  decoded_image out;
  out.height = img.height;
  out.width = img.width;
  out.channels = color ? 3 : 1;
  if (!alpha) {
    out.pixels = std::move(read);
    return out;
  }
  const size_t n = static_cast<size_t>(out.height * out.width), in_c = static_cast<size_t>(out.channels) + 1;
  out.pixels.resize(n * static_cast<size_t>(out.channels));
  for (size_t i = 0; i < n; ++i)
    for (size_t c = 0; c < static_cast<size_t>(out.channels); ++c) out.pixels[i * static_cast<size_t>(out.channels) + c] = read[i * in_c + c];
  return out;
}

struct jpeg_failure {
  jpeg_error_mgr mgr;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
  bool warned;
};

[[noreturn]] void jpeg_fail(j_common_ptr c) {
  auto* f = reinterpret_cast<jpeg_failure*>(c->err);
  (*c->err->format_message)(c, f->message);
  std::longjmp(f->jump, 1);
}

// Warnings (corrupt data libjpeg would paper over with gray): remembered,
// never printed; the image is then refused.
void jpeg_note(j_common_ptr c, int level) {
  auto* f = reinterpret_cast<jpeg_failure*>(c->err);
  if (level < 0 && !f->warned) {
    f->warned = true;
    (*c->err->format_message)(c, f->message);
  }
}

// libjpeg's longjmp leaves this frame only: its locals are C structs whose
// addresses libjpeg holds; the C++ object it fills is the caller's.
// Returns false with fail.message set when libjpeg gave up.
bool jpeg_into(const uint8_t* data, size_t size, decoded_image& out, jpeg_failure& fail, uint64_t& width, uint64_t& height) {
  jpeg_decompress_struct cinfo;
  std::memset(&cinfo, 0, sizeof cinfo);
  cinfo.err = jpeg_std_error(&fail.mgr);
  fail.mgr.error_exit = jpeg_fail;
  fail.mgr.emit_message = jpeg_note;
  if (setjmp(fail.jump)) {
    jpeg_destroy_decompress(&cinfo);
    return false;
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, data, static_cast<unsigned long>(size));
  jpeg_read_header(&cinfo, TRUE);
  width = cinfo.image_width;
  height = cinfo.image_height;
  if (width * height <= max_image_pixels) {
    cinfo.out_color_space = cinfo.num_components == 1 ? JCS_GRAYSCALE : JCS_RGB;
    jpeg_start_decompress(&cinfo);
    out.height = cinfo.output_height;
    out.width = cinfo.output_width;
    out.channels = cinfo.output_components;
    out.pixels.resize(static_cast<size_t>(out.height * out.width * out.channels));
    while (cinfo.output_scanline < cinfo.output_height) {
      JSAMPROW row = out.pixels.data() + static_cast<size_t>(cinfo.output_scanline) * static_cast<size_t>(out.width * out.channels);
      jpeg_read_scanlines(&cinfo, &row, 1);
    }
    jpeg_finish_decompress(&cinfo);
  }
  jpeg_destroy_decompress(&cinfo);
  return true;
}

result<decoded_image> decode_jpeg(const uint8_t* data, size_t size, const std::string& where) {
  decoded_image out;
  jpeg_failure fail;
  std::memset(&fail, 0, sizeof fail);
  uint64_t w = 0, h = 0;
  if (!jpeg_into(data, size, out, fail, w, h)) return make_error(where + ": not a JPEG libjpeg can read: " + std::string(fail.message));
  if (w * h > max_image_pixels)
    return make_error(where + ": a JPEG of " + std::to_string(w) + "x" + std::to_string(h) + " pixels, more than the " +
                      std::to_string(max_image_pixels) + " allowed");
  if (fail.warned) return make_error(where + ": a damaged JPEG: " + std::string(fail.message));
  return out;
}

}  // namespace

result<decoded_image> decode_image(const uint8_t* data, size_t size, const std::string& ext, const std::string& where) {
  if (ext == "png") return decode_png(data, size, where);
  if (ext == "jpg" || ext == "jpeg") return decode_jpeg(data, size, where);
  return make_error(where + ": '." + ext + "' is not an image kind dtactor decodes (png, jpg, jpeg)");
}

}  // namespace dtactor
