#include "model/grad_norm.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace dtactor {

int64_t norm_chunk(int64_t total) {
  const int64_t per = (std::max<int64_t>(total, 1) + max_norm_chunks - 1) / max_norm_chunks;
  return (per + 63) / 64 * 64;
}

index_ranges norm_ranges(int64_t total, const std::vector<int64_t>& group_bases) {
  std::vector<int64_t> cuts;
  const int64_t chunk = norm_chunk(total);
  for (int64_t at = 0; at < total; at += chunk) cuts.push_back(at);
  for (int64_t b : group_bases)
    if (b > 0 && b < total) cuts.push_back(b);
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  index_ranges out;
  for (size_t i = 0; i < cuts.size(); ++i) out.emplace_back(cuts[i], i + 1 < cuts.size() ? cuts[i + 1] : total);
  return out;
}

std::pair<size_t, size_t> ranges_within(const index_ranges& ranges, int64_t begin, int64_t end) {
  auto first = std::lower_bound(ranges.begin(), ranges.end(), begin, [](const auto& r, int64_t v) { return r.first < v; });
  auto last = std::lower_bound(first, ranges.end(), end, [](const auto& r, int64_t v) { return r.first < v; });
  return {static_cast<size_t>(first - ranges.begin()), static_cast<size_t>(last - ranges.begin())};
}

namespace {
// Eight running sums (the loop vectorises without reordering any one of
// them), combined pairwise at the end.
template <typename T>
double squares_of(const T* x, int64_t n) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) {
      const double v = static_cast<double>(x[i + k]);
      acc[k] += v * v;
    }
  for (int k = 0; i < n; ++i, ++k) {
    const double v = static_cast<double>(x[i]);
    acc[k] += v * v;
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// A bf16 value read as the float32 it widens to (no rounding).
struct bf16_bits {
  uint16_t v;
  explicit operator double() const {
    const uint32_t u = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
};
static_assert(sizeof(bf16_bits) == sizeof(uint16_t));
}  // namespace

double sum_squares(const float* x, int64_t n) { return squares_of(x, n); }
double sum_squares(const double* x, int64_t n) { return squares_of(x, n); }
double sum_squares_bf16(const uint16_t* bits, int64_t n) { return squares_of(reinterpret_cast<const bf16_bits*>(bits), n); }

double norm_of_parts(const std::vector<double>& parts) {
  double sum = 0;
  for (double v : parts) sum += v;
  return std::sqrt(sum);
}

}  // namespace dtactor
