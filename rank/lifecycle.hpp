#pragma once
// The rank's generation lifecycle, and where each part lives.
//
// One small loop (rank_worker::run_generation, rank/rank_worker.cpp):
//   join the group (build_group, rank/group_builder) -> agree on the state
//   and take it from its source (starting_state, rank/state_source) -> run
//   steps until the generation ends (step_loop, rank/step_loop) -> report.
//
// What the pieces share (rank/generation.hpp): rank_state, what the
// training thread keeps across generations (the config and modes, the
// training state, parked groups, the shard plan, the sample log, the
// checkpoint saver, DiLoCo's window); generation_run, one generation's
// group and where its state came from, which also reports the failure that
// ends it (generation_run::failed, checkpoint_unusable). Each piece returns
// a generation_end (rank/outcome.hpp): nothing to go on, or the outcome.
//
//   rank/group_builder    the c10d group and the shared-memory exchange
//                         plan, built on a helper thread that a newer plan
//                         abandons.
//   rank/state_source     the start in order: the plan's checkpoint read
//                         by rank 0, ZeRO-2's interrupted step, the one
//                         agreement round, then the sources it chose, each
//                         a class behind one of two interfaces: the state
//                         (own_state, peer_state: the root's broadcast)
//                         and the ZeRO shards (replica_shards: from their
//                         surviving holders; checkpoint_source). The plan's
//                         checkpoint steps stay the one authority on which
//                         checkpoint a generation uses; no rank picks one
//                         itself.
//   rank/checkpoint_source every checkpoint load of a generation's start
//                         through the load planner: rank 0's replicated
//                         part, a DiLoCo worker's section, a rank's shards,
//                         the fallback when both holders of a shard are
//                         lost.
//   rank/agreement        the one agreement round (agreement_round): one
//                         MAX allreduce to which each piece adds its
//                         words: the state's (highest step and its root),
//                         the optimizer shards' source (the plan's
//                         checkpoint or the holders), and the sync
//                         strategy's (sync_strategy::agreement_words;
//                         DiLoCo: its window).
//   rank/diloco_window    train.sync = diloco: the window kept across
//                         generations (slices, catch-up, owed replays), its
//                         agreement and the replay of a lost worker's
//                         slices; the arithmetic is rank/sync_diloco's.
//   rank/exchange_choice  the generation's reducers (one, or one a
//                         streaming fragment, and a host's reducer with
//                         hosts as workers) and the READY line about them.
//   rank/step_loop        the steps: control word, the step, boundaries
//                         (buffers, digests, evaluation, checkpoint, stop,
//                         switch), reports, fault injection.
//   rank/sync_strategy    what differs between the train.sync modes: the
//                         step held for the agreement, what a rank keeps
//                         through the state transfer, the agreement after
//                         it, the step and its exchanges, when a boundary
//                         is, what falls due there, the READY fields. One
//                         class a mode (sync_every_step in sync_strategy.cpp;
//                         sync_diloco, streaming as its option, in
//                         diloco_window.cpp), found by the typed sync mode
//                         in a registry of one line each.
//   rank/checkpoint_saver this rank's part of a checkpoint (save planner
//                         ranges, checkpoint.direct, the part writer).
//
// Besides the one agreement round, a generation's start runs collectives
// that move data rather than agree: ZeRO-2's interrupted step takes the
// gradient norm its peers computed (an all-gather, before the round, since
// finishing the step changes the step a rank holds), and DiLoCo's replay
// finds a lost worker's slices from what each survivor holds (two MAX
// allreduces, three with hosts as workers, after the round). The sync
// strategy also makes the generation's reducers (add_reducers: DiLoCo's
// fragments and, with train.diloco_worker = host, the host's per-step
// reducer, an option of sync_diloco as streaming is) and owns its
// checkpoint sections (writes_worker_sections, take_own_section).
