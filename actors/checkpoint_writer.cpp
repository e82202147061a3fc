#include "actors/checkpoint_writer.hpp"

#include <algorithm>
#include <vector>

#include "base/printable.hpp"
#include "caf/stateful_actor.hpp"

namespace dtactor {

namespace {

using writer_self = checkpoint_writer_handle::stateful_pointer<checkpoint_writer_state>;

}  // namespace

namespace {

// Commits `step` once every rank's parts are in (commit_checkpoint), or
// says why not.
void try_commit(writer_self self, int64_t step) {
  auto& st = self->state;
  auto it = st.pending.find(step);
  if (it == st.pending.end()) return;
  const auto& p = it->second;
  if (p.failed || !p.have_meta || static_cast<int32_t>(p.parts.size()) < p.world) return;
  if (!st.opts.commit) {  // no store: nothing to commit to
    st.pending.erase(it);
    return;
  }
  auto done = commit_checkpoint(step, p, st.opts.commit);
  st.pending.erase(it);
  if (!done) {
    ++st.failed;
    log_line(st.opts.log, "checkpoint at step " + std::to_string(step) + " not saved: " + done.message());
    ev::checkpoint_failed failed;
    failed.step = step;
    failed.reason = done.message();
    emit(st.opts.events, failed);
    return;
  }
  ++st.saved;
  emit(st.opts.events, done->saved);
  st.newest_step = std::max(st.newest_step, step);
  // Older ones too: a step a rank refused may be committed again.
  if (st.opts.members) self->send(st.opts.members, ckpt_atom::value, step, std::move(done->kept));
}

}  // namespace

checkpoint_writer_handle::behavior_type checkpoint_writer(writer_self self, checkpoint_writer_options opts) {
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
        if (w.due_step() > 0) p.due_step = p.due_step > 0 ? std::min(p.due_step, w.due_step()) : w.due_step();
        if (w.global_rank() < 0 || w.global_rank() >= w.world_size()) return;
        ++p.reports;
        if (w.direct()) ++p.direct;
        if (!w.error().empty() || w.parts().empty()) {
          if (!p.failed) {
            p.failed = true;
            ++st.failed;
            const std::string why = "rank " + std::to_string(w.global_rank()) + " (" + printable(in.from.node_name()) + ") could not store its part: " +
                                    (w.error().empty() ? "it reported no parts" : printable(w.error(), printable_max_detail_chars));
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
      [=](members_atom, membership_handle members) { self->state.opts.members = std::move(members); },
  };
}

}  // namespace dtactor
