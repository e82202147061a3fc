#include "rank/agreement.hpp"

namespace dtactor {

std::pair<int64_t, int64_t> agreement_words(int64_t step, int rank) {
  constexpr int64_t shift = int64_t{1} << agreement_rank_bits;
  return {step * shift + (shift - 1 - rank), -step};
}

agreement read_agreement(int64_t max_word0, int64_t max_word1) {
  constexpr int64_t shift = int64_t{1} << agreement_rank_bits;
  agreement a;
  a.max_step = max_word0 / shift;
  a.root = static_cast<int>(shift - 1 - max_word0 % shift);
  a.min_step = -max_word1;
  return a;
}

}  // namespace dtactor
