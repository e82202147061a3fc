#pragma once
// A generation's one agreement round, as pure functions over the words the
// ranks allreduce (MAX) together. Every piece of a generation's start adds
// its words to one round (agreement_round) before the collective and reads
// its own back after it:
//   - the state: the highest step (DiLoCo: anchor) any member holds, the
//     lowest rank holding it (the root everyone takes the state from when
//     they differ) and the lowest step held (whether anyone must take it);
//   - the optimizer shards' source: whether the agreed state is the plan's
//     checkpoint that global rank 0 read (then every rank reads its own
//     shards from it);
//   - the sync strategy's words (DiLoCo: the furthest step a worker holding
//     the agreed anchor reached, and the newest generation a worker trained
//     in);
//   - a checkpoint still owed from the generation before (the step it fell
//     due at, deferred while a writer was busy; -1: none).
// No LibTorch here; rank/state_source runs the collective.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

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

// The optimizer source's word: the step a rank holds when it read it from
// the plan's checkpoint itself, else -1. The agreed state is that
// checkpoint when the MAX of these words is the agreed step.
int64_t disk_word(bool read_from_checkpoint, int64_t held_step);
bool agreed_from_disk(int64_t max_disk_word, const agreement& a);

// DiLoCo's window: a rank's anchor and how far past it its inner steps went,
// as one word (anchor << 20 | step - anchor) whose MAX over the ranks is the
// furthest step reached by a rank holding the highest anchor; a rank behind
// that anchor starts its window over from it, so its steps do not count.
// Nothing when the window is 2^20 inner steps or longer (or steps go back).
inline constexpr int64_t window_offset_bits = 20;
std::optional<int64_t> window_word(int64_t anchor, int64_t step);
int64_t furthest_of_window_word(int64_t max_word);

// The words of one round. Each piece adds its own (its slot) before the
// collective; the collective reduces `words()` in place; each piece reads
// its slot back.
class agreement_round {
 public:
  struct slot {
    size_t at = 0, size = 0;
  };
  slot add(const std::vector<int64_t>& mine);
  std::vector<int64_t>& words() { return words_; }
  std::vector<int64_t> read(slot s) const;

 private:
  std::vector<int64_t> words_;
};

}  // namespace dtactor
