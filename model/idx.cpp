#include "model/idx.hpp"

namespace dtactor {

namespace {

uint32_t be32(const std::vector<uint8_t>& b, size_t off) {
  return (uint32_t{b[off]} << 24) | (uint32_t{b[off + 1]} << 16) | (uint32_t{b[off + 2]} << 8) | uint32_t{b[off + 3]};
}

}  // namespace

result<idx_shape> check_idx_pair(const std::vector<uint8_t>& ib, const std::string& images_path, const std::vector<uint8_t>& lb,
                                 const std::string& labels_path) {
  if (ib.size() < 16 || be32(ib, 0) != 0x00000803) return make_error("'" + images_path + "' is not an IDX image file (bad magic number)");
  if (lb.size() < 8 || be32(lb, 0) != 0x00000801) return make_error("'" + labels_path + "' is not an IDX label file (bad magic number)");
  const int64_t n = be32(ib, 4), rows = be32(ib, 8), cols = be32(ib, 12), nl = be32(lb, 4);
  // Each size is below 2^32, their product may not be below 2^64: checked,
  // never wrapped (2^22 x 2^21 x 2^21 wrapped to 0 and matched an empty file).
  uint64_t pixels = 0;
  const bool too_many = __builtin_mul_overflow(static_cast<uint64_t>(n) * static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), &pixels);
  if (too_many || ib.size() - 16 != pixels)
    return make_error("'" + images_path + "' is truncated: header says " + std::to_string(n) + " images of " + std::to_string(rows) + "x" +
                      std::to_string(cols) + " but the file holds " + std::to_string(ib.size() - 16) + " pixel bytes");
  if (static_cast<int64_t>(lb.size()) != 8 + nl) return make_error("'" + labels_path + "' is truncated");
  if (nl != n) return make_error("'" + images_path + "' has " + std::to_string(n) + " images but '" + labels_path + "' has " + std::to_string(nl) + " labels");
  return idx_shape{n, rows, cols};
}

}  // namespace dtactor
