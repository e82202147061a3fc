#pragma once
// The coordinator's checkpoint writer (committer) actor.
//
// It reads no clock and reports only through the injected event sink and
// log; the commit itself (manifest, checks, rotation) is injected too, so
// tests run it with CAF's test coordinator and an in-memory commit.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "job/checkpoint_commit.hpp"
#include "job/events.hpp"
#include "actors/membership_handle.hpp"
#include "actors/messages.hpp"
#include "caf/actor.hpp"
#include "caf/behavior.hpp"
#include "caf/replies_to.hpp"
#include "caf/stateful_actor.hpp"
#include "caf/typed_actor.hpp"
#include "caf/typed_event_based_actor.hpp"
#include "dtactor/result.hpp"

namespace dtactor {

// What the checkpoint writer takes (its behaviour below): a rank's
// checkpoint_written report (inbound, fenced by the job actor), a flush that
// answers once every report sent before it was handled, and the membership
// actor that hears of every committed checkpoint.
using checkpoint_writer_handle =
    caf::typed_actor<caf::reacts_to<inbound>, caf::replies_to<flush_atom>::with<bool>, caf::reacts_to<members_atom, membership_handle>>;

// The checkpoint committer: collects the ranks' checkpoint_written reports
// and commits a checkpoint (writes its manifest through opts.commit, which
// may block: the committer runs detached) once every rank of the generation
// that wrote it has stored its parts (commit_checkpoint, as `dtactor train`).
struct checkpoint_writer_options {
  // meta: the manifest (rank 0's meta with every part, generation set).
  // Empty: no store, nothing committed.
  commit_fn commit;
  log_fn log;
  event_sink events;
  membership_handle members;  // gets (ckpt_atom, step, kept); also set by (members_atom, membership)
};

struct checkpoint_writer_state {
  // What the ranks reported so far (written_parts), and how the gathering stands.
  struct part_set : written_parts {
    bool have_meta = false;
    bool failed = false;  // a rank could not store its parts: never committed
    int32_t reports = 0;  // one per rank's report, however many parts it carries
  };
  checkpoint_writer_options opts;
  std::map<int64_t, part_set> pending;  // by step
  int64_t newest_step = -1;
  uint64_t saved = 0;
  uint64_t failed = 0;
  static inline const char* name = "dtactor.checkpoints";
};

// inbound checkpoint_written (fenced by the job actor). Parts of one step
// from one generation are gathered (a newer generation's replace an older
// one's); when every rank's are in, the checkpoint is committed through
// opts.commit with all ranks' parts in offset order: `checkpoint_saved`
// (with the stall and write rate) or `checkpoint_failed` (also when any rank
// could not store its parts, or the parts do not cover the stream exactly).
// Every committed checkpoint goes to the membership actor as (ckpt_atom,
// step, kept). (flush_atom) -> true once every report received before it
// was handled.
checkpoint_writer_handle::behavior_type checkpoint_writer(checkpoint_writer_handle::stateful_pointer<checkpoint_writer_state> self,
                                                          checkpoint_writer_options opts);

}  // namespace dtactor
