#include "model/fashion_mnist.hpp"

#include "model/idx.hpp"

#include <zlib.h>

#include <cstring>
#include <filesystem>
#include <vector>

namespace dtactor {

namespace {

result<std::vector<uint8_t>> read_gz(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec))
    return make_error("data file '" + path + "' not found: install Debian package dataset-fashion-mnist or set data.fashion_mnist_dir");
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

result<image_set> read_idx_pair(const std::string& images_path, const std::string& labels_path) {
  auto img = read_gz(images_path);
  if (!img) return img.err();
  auto lab = read_gz(labels_path);
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
