#include "rank/sync_diloco.hpp"

#include <algorithm>

namespace dtactor {

std::vector<window_slice> held_slices(const std::vector<window_slice>& own, const std::vector<catch_up_segment>& catch_up, int64_t step,
                                      window_span w) {
  std::vector<window_slice> held;
  for (const auto& x : own)
    if (x.step >= w.start) held.push_back(x);
  int64_t from = step;
  for (const auto& c : catch_up) {
    for (int64_t s = from; s < c.until && s < w.end; ++s) held.push_back({s, c.rank, c.world, {}});
    from = std::max(from, c.until);
  }
  return held;
}

std::vector<int64_t> slice_world_words(const std::vector<window_slice>& held, window_span w) {
  const int64_t len = w.len();
  std::vector<int64_t> words(static_cast<size_t>(len + 1), 0);
  for (const auto& x : held)
    if (w.holds(x)) {
      auto& at = words[static_cast<size_t>(x.step - w.start)];
      at = std::max<int64_t>(at, x.world);
      words.back() = std::max<int64_t>(words.back(), x.world);
    }
  return words;
}

int64_t widest_world(const std::vector<int64_t>& worlds) { return std::max<int64_t>(1, worlds.empty() ? 0 : worlds.back()); }

std::vector<int64_t> slice_fragment_words(const std::vector<window_slice>& held, window_span w, const std::vector<int64_t>& worlds,
                                          int64_t frags) {
  const int64_t widest = widest_world(worlds);
  std::vector<int64_t> bits(static_cast<size_t>(w.len() * widest * frags), 0);
  for (const auto& x : held) {
    if (!w.holds(x) || x.world != worlds[static_cast<size_t>(x.step - w.start)]) continue;
    for (int64_t f = 0; f < frags; ++f)
      if (x.fragments.empty() || (static_cast<size_t>(f) < x.fragments.size() && x.fragments[static_cast<size_t>(f)]))
        bits[static_cast<size_t>(((x.step - w.start) * widest + x.rank) * frags + f)] = 1;
  }
  return bits;
}

void count_units(const std::vector<int64_t>& leaders, int leader, replay_unit& u) {
  u.units = 0;
  for (size_t r = 0; r < leaders.size(); ++r) {
    if (static_cast<int>(r) == leader) u.unit = u.units;
    u.units += leaders[r] != 0 ? 1 : 0;
  }
}

owed_slices deal_owed_slices(window_span w, const std::vector<int64_t>& worlds, const std::vector<int64_t>& fragment_bits,
                             const std::vector<int64_t>& fragment_anchors, const replay_unit& u) {
  owed_slices out;
  const int64_t widest = widest_world(worlds);
  const int64_t frags = static_cast<int64_t>(fragment_anchors.size());
  for (int64_t i = 0; i < w.len(); ++i) {
    const int64_t step = w.start + i, wi = worlds[static_cast<size_t>(i)];
    const int world = wi > 0 ? static_cast<int>(wi) : 1;
    for (int r = 0; r < world; ++r) {
      std::vector<bool> to(static_cast<size_t>(frags), false);
      bool any = false, all = true;
      for (int64_t f = 0; f < frags; ++f) {
        const bool held = wi != 0 && fragment_bits[static_cast<size_t>((i * widest + r) * frags + f)] != 0;
        const bool need = fragment_anchors[static_cast<size_t>(f)] <= step && !held;
        to[static_cast<size_t>(f)] = need;
        any = any || need;
        all = all && need;
      }
      if (!any) continue;
      if (out.owed % u.units == u.unit) out.mine.push_back({step, r, world, all ? std::vector<bool>{} : to, u.part, u.parts});
      ++out.owed;
    }
  }
  return out;
}

}  // namespace dtactor
