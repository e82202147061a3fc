#include "model/data_order.hpp"

#include <algorithm>
#include <stdexcept>

#include "base/hash.hpp"

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

data_order::data_order(uint64_t seed, shard_layout layout, int64_t global_batch)
    : seed_(seed), n_(0), b_(global_batch), shards_(std::move(layout.samples)), block_(layout.block_shards) {
  if (shards_.empty()) throw std::invalid_argument("data_order: no shards");
  if (block_ < 1) throw std::invalid_argument("data_order: block_shards must be at least 1");
  if (b_ <= 0) throw std::invalid_argument("data_order: global batch must be positive");
  first_.reserve(shards_.size() + 1);
  first_.push_back(0);
  for (int64_t s : shards_) {
    if (s < 1) throw std::invalid_argument("data_order: a shard without samples");
    first_.push_back(first_.back() + s);
  }
  n_ = first_.back();
}

const data_order::epoch_plan& data_order::plan_of(int64_t epoch) const {
  if (cached_.epoch == epoch) return cached_;
  const int64_t S = static_cast<int64_t>(shards_.size());
  const uint64_t key = mix(seed_, static_cast<uint64_t>(epoch), 0x7368617264ULL);  // "shard"
  cached_.epoch = epoch;
  cached_.perm.resize(static_cast<size_t>(S));
  cached_.prefix.assign(1, 0);
  cached_.prefix.reserve(static_cast<size_t>(S) + 1);
  for (int64_t k = 0; k < S; ++k) {
    cached_.perm[static_cast<size_t>(k)] = permute(k, S, key);
    cached_.prefix.push_back(cached_.prefix.back() + shards_[static_cast<size_t>(cached_.perm[static_cast<size_t>(k)])]);
  }
  return cached_;
}

int64_t data_order::sample_at(int64_t position) const {
  const int64_t epoch = position / n_;
  const int64_t i = position % n_;
  if (shards_.empty()) return permute(i, n_, mix(seed_, static_cast<uint64_t>(epoch), 0x6461746100ULL));
  std::lock_guard<std::mutex> lock(mu_);
  const auto& p = plan_of(epoch);
  const int64_t S = static_cast<int64_t>(shards_.size());
  // The permuted position k holding i, then its block [k0, k1).
  const int64_t k = std::upper_bound(p.prefix.begin(), p.prefix.end(), i) - p.prefix.begin() - 1;
  const int64_t blk = k / block_;
  const int64_t k0 = blk * block_, k1 = std::min(S, k0 + block_);
  const int64_t base = p.prefix[static_cast<size_t>(k0)];
  const int64_t within = permute(i - base, p.prefix[static_cast<size_t>(k1)] - base,
                                 mix(seed_, static_cast<uint64_t>(epoch), 0x626c6f636bULL ^ (static_cast<uint64_t>(blk) << 40)));
  const int64_t at = base + within;
  const int64_t kk = std::upper_bound(p.prefix.begin() + k0, p.prefix.begin() + k1 + 1, at) - p.prefix.begin() - 1;
  const int64_t shard = p.perm[static_cast<size_t>(kk)];
  return first_[static_cast<size_t>(shard)] + (at - p.prefix[static_cast<size_t>(kk)]);
}

std::vector<int64_t> data_order::shards_from(int64_t position, int64_t count) const {
  std::vector<int64_t> out;
  if (shards_.empty() || count <= 0) return out;
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t S = static_cast<int64_t>(shards_.size());
  int64_t epoch = position / n_;
  const int64_t i = position % n_;
  int64_t blk;
  {
    const auto& p = plan_of(epoch);
    const int64_t k = std::upper_bound(p.prefix.begin(), p.prefix.end(), i) - p.prefix.begin() - 1;
    blk = k / block_;
  }
  const int64_t blocks = (S + block_ - 1) / block_;
  for (int64_t walked = 0; walked < 2 * blocks && static_cast<int64_t>(out.size()) < count; ++walked) {
    const auto& p = plan_of(epoch);
    const int64_t k0 = blk * block_, k1 = std::min(S, k0 + block_);
    for (int64_t k = k0; k < k1 && static_cast<int64_t>(out.size()) < count; ++k) out.push_back(p.perm[static_cast<size_t>(k)]);
    if (++blk == blocks) {
      blk = 0;
      ++epoch;
    }
  }
  return out;
}

int64_t data_order::shard_of(int64_t index) const {
  if (shards_.empty()) return 0;
  return std::upper_bound(first_.begin(), first_.end(), index) - first_.begin() - 1;
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
