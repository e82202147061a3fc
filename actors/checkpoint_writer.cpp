#include "actors/checkpoint_writer.hpp"

#include <algorithm>
#include <limits>
#include <vector>

#include "caf/event_based_actor.hpp"
#include "caf/stateful_actor.hpp"

namespace dtactor {

namespace {

using writer_self = caf::stateful_actor<checkpoint_writer_state>*;

}  // namespace

namespace {

void try_commit(writer_self self, int64_t step) {
  auto& st = self->state;
  auto it = st.pending.find(step);
  if (it == st.pending.end()) return;
  auto& p = it->second;
  if (p.failed || !p.have_meta || static_cast<int32_t>(p.parts.size()) < p.world) return;
  pb::checkpoint_meta meta;
  std::string why;
  if (!meta.ParseFromString(p.meta)) why = "rank 0's manifest does not parse";
  meta.set_generation(p.generation);
  meta.set_world_size(p.world);
  meta.clear_parts();
  // Ranks may own scattered ranges (ZeRO): the manifest lists all parts in
  // stream order, and they must tile it, or a resume would read a torn state.
  std::vector<const pb::checkpoint_part*> all;
  for (const auto& [rank, parts] : p.parts)
    for (const auto& part : parts) all.push_back(&part);
  std::stable_sort(all.begin(), all.end(), [](const pb::checkpoint_part* a, const pb::checkpoint_part* b) {
    return a->offset() != b->offset() ? a->offset() < b->offset() : a->size() < b->size();
  });
  auto gap = [](uint64_t a, uint64_t b) { return "no rank stored bytes [" + std::to_string(a) + ", " + std::to_string(b) + ") of the state"; };
  uint64_t bytes = 0;  // covered so far
  for (const auto* part : all) {
    if (!why.empty()) break;
    if (part->size() > std::numeric_limits<uint64_t>::max() - part->offset())
      why = "part '" + part->name() + "' of rank " + std::to_string(part->rank()) + " has an impossible size";
    else if (part->offset() > bytes)
      why = gap(bytes, part->offset());
    else if (part->offset() < bytes)
      why = "part '" + part->name() + "' of rank " + std::to_string(part->rank()) + " overlaps bytes [" + std::to_string(part->offset()) + ", " +
            std::to_string(std::min(bytes, part->offset() + part->size())) + ") of another part";
    *meta.add_parts() = *part;
    bytes = std::max(bytes, part->offset() + part->size());
  }
  if (why.empty() && bytes < meta.state_bytes()) why = gap(bytes, meta.state_bytes());
  if (why.empty() && bytes > meta.state_bytes())
    why = "the parts cover " + std::to_string(bytes) + " bytes of a " + std::to_string(meta.state_bytes()) + "-byte state";
  const double stall = p.stall_s, write = p.write_s;
  const int32_t nparts = meta.parts_size();
  const uint64_t gen = p.generation;
  st.pending.erase(it);
  if (why.empty() && st.opts.commit) {
    auto saved = st.opts.commit(std::move(meta));
    if (saved) {
      ++st.saved;
      ev::checkpoint_saved e{step, saved->path, saved->bytes, gen, saved->duration_s};
      e.stall_s = stall;
      e.write_s = write;
      e.bytes_per_s = write > 0 ? static_cast<double>(bytes) / write : 0;
      e.parts = nparts;
      emit(st.opts.events, e);
      if (step >= st.newest_step) {
        st.newest_step = step;
        if (st.opts.members) self->send(st.opts.members, ckpt_atom::value, step);
      }
      return;
    }
    why = saved.message();
  }
  if (why.empty()) return;  // no store: nothing to commit to
  ++st.failed;
  log_line(st.opts.log, "checkpoint at step " + std::to_string(step) + " not saved: " + why);
  emit(st.opts.events, ev::checkpoint_failed{step, why});
}

}  // namespace

caf::behavior checkpoint_writer(writer_self self, checkpoint_writer_options opts) {
  self->state.opts = std::move(opts);
  return {
      [=](inbound& in) {
        auto& st = self->state;
        if (!in.env.has_checkpoint_written()) return;
        const auto& w = in.env.checkpoint_written();
        const uint64_t gen = in.env.generation();
        // Steps of older generations that can no longer complete go.
        for (auto it = st.pending.begin(); it != st.pending.end();)
          it = it->second.generation < gen && it->first <= w.step() ? st.pending.erase(it) : std::next(it);
        auto& p = st.pending[w.step()];
        if (p.generation > gen) return;  // a newer generation already writes this step
        if (p.generation < gen) p = checkpoint_writer_state::part_set{};
        p.generation = gen;
        p.world = w.world_size();
        p.stall_s = std::max(p.stall_s, w.stall_s());
        p.write_s = std::max(p.write_s, w.write_s());
        if (w.global_rank() < 0 || w.global_rank() >= w.world_size()) return;
        ++p.reports;
        if (!w.error().empty() || w.parts().empty()) {
          if (!p.failed) {
            p.failed = true;
            ++st.failed;
            const std::string why = "rank " + std::to_string(w.global_rank()) + " (" + in.from.node_name() +
                                    ") could not store its part: " + (w.error().empty() ? "it reported no parts" : w.error());
            log_line(st.opts.log, "checkpoint at step " + std::to_string(w.step()) + " not saved: " + why);
            emit(st.opts.events, ev::checkpoint_failed{w.step(), why});
          }
        } else {
          p.parts[w.global_rank()].assign(w.parts().begin(), w.parts().end());
          if (w.global_rank() == 0) {
            p.meta = w.meta();
            p.have_meta = true;
          }
        }
        if (p.failed) {
          if (p.reports >= p.world) st.pending.erase(w.step());  // every rank reported: forgotten
          return;
        }
        try_commit(self, w.step());
      },
      [=](flush_atom) { return true; },
      [=](members_atom, caf::actor members) { self->state.opts.members = std::move(members); },
  };
}

}  // namespace dtactor
