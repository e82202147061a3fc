#pragma once
// The plan of the rank's generation lifecycle (issue 48), which
// rank/rank_worker.cpp is being split into, step by step. Today's state: the
// loop and most strategies still live in rank_worker.cpp; DiLoCo's replay
// arithmetic is in rank/sync_diloco (the first piece moved out). This header
// holds the plan only; each class gets its own header when it is extracted.
//
// One small loop (rank_worker::run_generation):
//   join the group (build_group) -> agree on the state (ONE MAX allreduce
//   of an agreement vector) -> take it from its source -> run steps until
//   the generation ends -> report.
//
// What differs between modes sits behind two interfaces:
//
//   sync_strategy (rank/sync_strategy.hpp), one per train.sync mode, found
//   in a registry by the typed sync mode, one registration line each:
//     - sync_every_step (rank/sync_every_step.cpp): the reducer every step;
//       ZeRO's interrupted step (finish_interrupted_step) is its field.
//     - sync_diloco (rank/sync_diloco.cpp), streaming as its option: the
//       window (anchor, slices, catch-up), the replay of a lost worker's
//       slices (replay_owed_slices), the outer exchanges, the worker
//       sections of a checkpoint, the report's window fields.
//     - sync_host_workers (rank/sync_host_workers.cpp): DiLoCo with a
//       host's ranks as one worker; the leaders' word in the agreement.
//   Each contributes int64 words to one agreement vector (its
//   `agreement_fields`: how many words, what this rank puts there, how it
//   reads the element-wise MAX), so that the four allreduces of today's
//   agree_state (state, interrupted ZeRO-2 step, shard holders, DiLoCo
//   window) become one. Its replay, its checkpoint sections and its report
//   fields are methods of the same class.
//
//   state_source (rank/state_source.hpp), decided once from that one
//   agreement round: peer (broadcast_state from the root), replica (ZeRO
//   shards from their surviving holders), checkpoint (load_from_checkpoint
//   through the load planner, storage/checkpoint_plan). The plan's
//   checkpoint_step stays the one authority on which checkpoint a
//   generation uses; no rank picks one itself.
//
// A new sync mode or recovery source: a new class and one registration line.
