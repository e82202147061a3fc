#include "model/fashion_mnist.hpp"

#include "model/idx.hpp"

#include <libdeflate.h>
#include <zlib.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <vector>

namespace dtactor {

namespace {

bool exists(const std::string& path) {
  std::error_code ec;
  return std::filesystem::exists(path, ec);
}

error not_found(const std::string& path) {
  return make_error("data file '" + path + "' not found: install Debian package dataset-fashion-mnist or set data.fashion_mnist_dir");
}

result<std::vector<uint8_t>> read_whole(const std::string& path) {
  if (!exists(path)) return not_found(path);
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return make_error("cannot open '" + path + "': " + std::strerror(errno));
  // Sized once from the file's length, read in one call; a file that grows
  // meanwhile is read to its end.
  std::error_code ec;
  std::vector<uint8_t> in(static_cast<size_t>(std::filesystem::file_size(path, ec)));
  size_t got = ec ? 0 : std::fread(in.data(), 1, in.size(), f);
  in.resize(got);
  uint8_t buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) in.insert(in.end(), buf, buf + n);
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) return make_error("cannot read '" + path + "'");
  return in;
}

// The size a gzip member's trailer states (ISIZE, the length modulo 2^32),
// or 0 when it cannot be right: deflate never expands more than 1032:1, so a
// larger claim is a corrupt trailer, refused before anything is allocated.
size_t trailer_size(const std::vector<uint8_t>& in) {
  if (in.size() < 18) return 0;
  const size_t n = in.size();
  const uint64_t isize = uint64_t{in[n - 4]} | uint64_t{in[n - 3]} << 8 | uint64_t{in[n - 2]} << 16 | uint64_t{in[n - 1]} << 24;
  return isize <= 1032 * static_cast<uint64_t>(n) ? static_cast<size_t>(isize) : 0;
}

// zlib's streaming read: any gzip file, several members included.
result<std::vector<uint8_t>> inflate_zlib(const std::string& path) {
  if (!exists(path)) return not_found(path);
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) return make_error("cannot open '" + path + "': " + std::strerror(errno));
  std::vector<uint8_t> out;
  uint8_t buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof buf)) > 0) out.insert(out.end(), buf, buf + n);
  int errnum = 0;
  const char* msg = gzerror(f, &errnum);
  std::string err = (n < 0 || (errnum != Z_OK && errnum != Z_STREAM_END)) ? std::string(msg ? msg : "read error") : "";
  gzclose(f);
  if (!err.empty()) return make_error("'" + path + "' is not a valid gzip file: " + err);
  return out;
}

}  // namespace

result<std::vector<uint8_t>> inflate_gz_file(const std::string& path, gz_inflater how) {
  if (how == gz_inflater::zlib) return inflate_zlib(path);
  auto in = read_whole(path);
  if (!in) return in.err();
  std::vector<uint8_t> out(trailer_size(in.value()));
  libdeflate_decompressor* d = libdeflate_alloc_decompressor();
  if (!d) return make_error("out of memory inflating '" + path + "'");
  size_t in_used = 0, out_size = 0;
  const libdeflate_result r = libdeflate_gzip_decompress_ex(d, in->data(), in->size(), out.data(), out.size(), &in_used, &out_size);
  libdeflate_free_decompressor(d);
  // Several members, or a length past 4 GiB (the trailer holds it modulo
  // 2^32): zlib's streaming read takes any gzip file.
  if (r == LIBDEFLATE_INSUFFICIENT_SPACE || (r == LIBDEFLATE_SUCCESS && in_used != in->size())) return inflate_zlib(path);
  if (r != LIBDEFLATE_SUCCESS || out_size != out.size()) return make_error("'" + path + "' is not a valid gzip file: bad deflate data, length or CRC32");
  return out;
}

result<image_set> read_idx_pair(const std::string& images_path, const std::string& labels_path) {
  auto img = inflate_gz_file(images_path);
  if (!img) return img.err();
  auto lab = inflate_gz_file(labels_path);
  if (!lab) return lab.err();
  const auto& ib = img.value();
  const auto& lb = lab.value();
  auto shape = check_idx_pair(ib, images_path, lb, labels_path);
  if (!shape) return shape.err();
  const int64_t n = shape->images, rows = shape->rows, cols = shape->cols;
  image_set s;
  s.images = torch::from_blob(const_cast<uint8_t*>(ib.data()) + 16, {n, rows, cols}, torch::kUInt8).clone();
  s.labels = torch::from_blob(const_cast<uint8_t*>(lb.data()) + 8, {n}, torch::kUInt8).to(torch::kInt64);
  if (s.labels.numel() > 0 && s.labels.max().item<int64_t>() > 9) return make_error("'" + labels_path + "' has labels outside 0..9");
  return s;
}

result<image_set> load_fashion_mnist(const std::string& dir, const std::string& split) {
  const std::string prefix = split == "test" ? "t10k" : "train";
  return read_idx_pair(dir + "/" + prefix + "-images-idx3-ubyte.gz", dir + "/" + prefix + "-labels-idx1-ubyte.gz");
}

}  // namespace dtactor
