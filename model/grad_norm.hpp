#pragma once
// The gradient norm for clipping, the same bits at every ZeRO level and
// world size. The index space (all parameter groups back to back, as in
// model/shard_plan) is cut into fixed ranges: chunks of norm_chunk(total)
// elements, cut again at group boundaries. Each range's sum of squares is
// taken in double by one serial loop (not LibTorch's reduction, whose order
// depends on the thread count), and the ranges' values are added in index
// order. A rank holding the whole gradient computes every range; a rank
// holding shards computes its shards' ranges, and the ranks exchange the
// values themselves (not a pre-summed total), so the final sum is the same
// additions in the same order. Shard boundaries are chunk boundaries
// (make_shard_plan aligns them so), so no range is split between ranks.
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace dtactor {

using index_ranges = std::vector<std::pair<int64_t, int64_t>>;

// Elements a chunk: the smallest multiple of 64 that cuts `total` into at
// most max_norm_chunks chunks. A function of the model's size only.
constexpr int64_t max_norm_chunks = 512;
int64_t norm_chunk(int64_t total);
// The ranges over [0, total), ascending: chunk boundaries and group bases.
index_ranges norm_ranges(int64_t total, const std::vector<int64_t>& group_bases);
// Indices [first, last) of the ranges lying in [begin, end) (a shard: its
// boundaries are range boundaries).
std::pair<std::size_t, std::size_t> ranges_within(const index_ranges& ranges, int64_t begin, int64_t end);
// Sum of x[i]^2 in double, in a fixed order that depends on n only.
double sum_squares(const float* x, int64_t n);
double sum_squares(const double* x, int64_t n);
// bf16 values given by their bits (the upper half of a float32): each is
// exactly a float32, so this is the float32 version's sum of those floats.
double sum_squares_bf16(const uint16_t* bits, int64_t n);
// sqrt of the values added in order.
double norm_of_parts(const std::vector<double>& parts);

}  // namespace dtactor
