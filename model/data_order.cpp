#include "model/data_order.hpp"

#include <stdexcept>

#include "runtime/hash.hpp"

namespace dtactor {

namespace {

uint64_t mix(uint64_t a, uint64_t b, uint64_t c) {
  const uint64_t words[3] = {a, b, c};
  return hash64(words, sizeof words, 0x9e3779b97f4a7c15ULL);
}

// A keyed bijection on [0, n): a balanced Feistel network over the smallest
// even-bit power of two >= n, with cycle walking back into range. O(1) memory,
// so epoch permutations of any size cost nothing to keep.
int64_t permute(int64_t x, int64_t n, uint64_t key) {
  int bits = 2;
  while ((int64_t{1} << bits) < n) bits += 2;
  const int half = bits / 2;
  const uint64_t mask = (uint64_t{1} << half) - 1;
  uint64_t v = static_cast<uint64_t>(x);
  do {
    uint64_t l = v >> half, r = v & mask;
    for (uint64_t round = 0; round < 4; ++round) {
      uint64_t nl = r;
      uint64_t nr = l ^ (mix(key, round, r) & mask);
      l = nl;
      r = nr;
    }
    v = (l << half) | r;
  } while (v >= static_cast<uint64_t>(n));
  return static_cast<int64_t>(v);
}

}  // namespace

data_order::data_order(uint64_t seed, int64_t dataset_size, int64_t global_batch) : seed_(seed), n_(dataset_size), b_(global_batch) {
  if (n_ <= 0) throw std::invalid_argument("data_order: empty dataset");
  if (b_ <= 0) throw std::invalid_argument("data_order: global batch must be positive");
}

int64_t data_order::sample_at(int64_t position) const {
  const int64_t epoch = position / n_;
  const int64_t i = position % n_;
  return permute(i, n_, mix(seed_, static_cast<uint64_t>(epoch), 0x6461746100ULL));
}

std::vector<int64_t> data_order::global_batch(int64_t step) const { return rank_slice(step, 0, 1); }

std::vector<int64_t> data_order::rank_slice(int64_t step, int rank, int world) const {
  auto [begin, end] = split_range(b_, rank, world);
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(end - begin));
  for (int64_t j = begin; j < end; ++j) out.push_back(sample_at(step * b_ + j));
  return out;
}

std::pair<int64_t, int64_t> split_range(int64_t total, int rank, int world) {
  const int64_t base = total / world, extra = total % world;
  const int64_t begin = rank * base + std::min<int64_t>(rank, extra);
  const int64_t size = base + (rank < extra ? 1 : 0);
  return {begin, begin + size};
}

}  // namespace dtactor
