#pragma once
// State agreement at the start of a generation, as a pure function over the
// words the ranks allreduce (MAX) together: every rank learns the highest
// step any member holds, the lowest rank holding it (the root everyone takes
// the state from when they differ) and the lowest step held (whether anyone
// must take it at all). No LibTorch here; the rank worker does the
// collective.
#include <cstdint>
#include <utility>

namespace dtactor {

// Up to 2^20 ranks; steps up to 2^43.
inline constexpr int64_t agreement_rank_bits = 20;

// This rank's two words: (step << 20 | (2^20 - 1 - rank), -step).
std::pair<int64_t, int64_t> agreement_words(int64_t step, int rank);

struct agreement {
  int64_t max_step = 0;
  int root = 0;  // lowest rank holding max_step
  int64_t min_step = 0;
  bool everyone_holds_it() const { return min_step == max_step; }
};

// Reads the element-wise MAX of every rank's agreement_words.
agreement read_agreement(int64_t max_word0, int64_t max_word1);

}  // namespace dtactor
