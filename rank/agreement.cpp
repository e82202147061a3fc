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

int64_t disk_word(bool read_from_checkpoint, int64_t held_step) { return read_from_checkpoint ? held_step : -1; }

bool agreed_from_disk(int64_t max_disk_word, const agreement& a) { return max_disk_word >= 0 && max_disk_word == a.max_step; }

std::optional<int64_t> window_word(int64_t anchor, int64_t step) {
  constexpr int64_t span = int64_t{1} << window_offset_bits;
  if (anchor < 0 || step < anchor || step - anchor >= span) return std::nullopt;
  return anchor * span + (step - anchor);
}

int64_t furthest_of_window_word(int64_t max_word) {
  constexpr int64_t span = int64_t{1} << window_offset_bits;
  return max_word / span + max_word % span;
}

agreement_round::slot agreement_round::add(const std::vector<int64_t>& mine) {
  slot s{words_.size(), mine.size()};
  words_.insert(words_.end(), mine.begin(), mine.end());
  return s;
}

std::vector<int64_t> agreement_round::read(slot s) const {
  return {words_.begin() + static_cast<std::ptrdiff_t>(s.at), words_.begin() + static_cast<std::ptrdiff_t>(s.at + s.size)};
}

}  // namespace dtactor
