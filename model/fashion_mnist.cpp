#include "model/fashion_mnist.hpp"

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

uint32_t be32(const std::vector<uint8_t>& b, size_t off) {
  return (uint32_t{b[off]} << 24) | (uint32_t{b[off + 1]} << 16) | (uint32_t{b[off + 2]} << 8) | uint32_t{b[off + 3]};
}

}  // namespace

result<image_set> read_idx_pair(const std::string& images_path, const std::string& labels_path) {
  auto img = read_gz(images_path);
  if (!img) return img.err();
  auto lab = read_gz(labels_path);
  if (!lab) return lab.err();
  const auto& ib = img.value();
  const auto& lb = lab.value();
  if (ib.size() < 16 || be32(ib, 0) != 0x00000803) return make_error("'" + images_path + "' is not an IDX image file (bad magic number)");
  if (lb.size() < 8 || be32(lb, 0) != 0x00000801) return make_error("'" + labels_path + "' is not an IDX label file (bad magic number)");
  const int64_t n = be32(ib, 4), rows = be32(ib, 8), cols = be32(ib, 12), nl = be32(lb, 4);
  if (static_cast<int64_t>(ib.size()) != 16 + n * rows * cols)
    return make_error("'" + images_path + "' is truncated: header says " + std::to_string(n) + " images of " + std::to_string(rows) + "x" +
                      std::to_string(cols) + " but the file holds " + std::to_string(ib.size() - 16) + " pixel bytes");
  if (static_cast<int64_t>(lb.size()) != 8 + nl) return make_error("'" + labels_path + "' is truncated");
  if (nl != n) return make_error("'" + images_path + "' has " + std::to_string(n) + " images but '" + labels_path + "' has " + std::to_string(nl) + " labels");
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
