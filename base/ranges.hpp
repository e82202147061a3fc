#pragma once
// Half-open ranges [first, second) of anything ordered (byte offsets,
// index-space elements).
#include <algorithm>
#include <utility>
#include <vector>

namespace dtactor {

// Sorted, overlapping and adjacent ranges merged, empty ones dropped.
template <typename T>
std::vector<std::pair<T, T>> normalized(std::vector<std::pair<T, T>> v) {
  std::sort(v.begin(), v.end());
  std::vector<std::pair<T, T>> out;
  for (const auto& [a, b] : v) {
    if (a >= b) continue;
    if (!out.empty() && out.back().second >= a)
      out.back().second = std::max(out.back().second, b);
    else
      out.emplace_back(a, b);
  }
  return out;
}

}  // namespace dtactor
