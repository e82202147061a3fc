// The checkpoint source of a generation's starting state (rank/state_source.hpp).
#include <cstdio>

#include "checkpoint.pb.h"
#include "comm/communicator.hpp"
#include "job/job_config.hpp"
#include "model/trainer.hpp"
#include "rank/generation.hpp"
#include "rank/group_builder.hpp"
#include "rank/state_io.hpp"
#include "rank/state_source.hpp"
#include "rank/sync_strategy.hpp"
#include "storage/checkpoint_store.hpp"

namespace dtactor {

// What a load reads of a checkpoint, and what it found.
struct checkpoint_source::load_request {
  int64_t step = -1;  // the plan's choice
  load_which which = load_which::all;
  bool own_section = false;  // DiLoCo: this rank's own section instead of `which`
  pb::checkpoint_meta meta;  // its manifest, once read
  uint64_t bytes_read = 0;   // of parts
  bool loaded = false;       // own_section: the checkpoint has one for this rank
};

// Open the plan's store, read the manifest of the step the plan names,
// check that it fits this job, then read what the load planner names for
// this rank (rank/state_io's load_checkpoint and load_worker_section,
// storage/checkpoint_plan). A checkpoint that fails is reported unusable.
generation_end checkpoint_source::load(start_context& c, load_request& l) {
  generation_run& g = c.g;
  const std::string name = manifest_name(l.step);
  const std::string where = g.plan.checkpoint_store() + "/" + name;
  auto store = checkpoint_store::open_readonly(g.plan.checkpoint_store(), c.rs.settings.checkpoint.s3_endpoint);
  if (!store) return g.failed("checkpoint store: " + store.message(), c.state.step());
  auto meta = store->read_manifest(name);
  if (!meta) return g.checkpoint_unusable(l.step, "checkpoint " + where + ": " + meta.message(), meta.code() == errc::corrupt_checkpoint, c.state.step());
  if (auto st = check_checkpoint_compatible(meta.value(), c.rs.settings.model, c.rs.settings.train, c.rs.cfg->digest({"model."}), where); !st)
    return g.checkpoint_unusable(l.step, st.message(), true, c.state.step());
  status st;
  if (l.own_section) {
    auto section = load_worker_section(c.state, store.value(), meta.value(), g.rank);
    if (!section) st = section.err();
    l.loaded = section && *section;
  } else {
    st = load_checkpoint(c.state, store.value(), meta.value(), l.which, &l.bytes_read);
    l.loaded = st.ok();
  }
  if (!st) return g.checkpoint_unusable(l.step, "checkpoint " + where + ": " + st.message(), st.code() == errc::corrupt_checkpoint, c.state.step());
  l.meta = std::move(meta.value());
  return std::nullopt;
}

namespace {

// The checkpoint the generation's state is: the plan's, or, where the plan
// names none (a live rank holds the state), the one that rank's state was
// read from in a generation a newer plan cut short (rank_state::disk_step).
int64_t state_checkpoint_step(const start_context& c) {
  return c.g.plan.checkpoint_step() >= 0 ? c.g.plan.checkpoint_step() : c.state.step();
}

}  // namespace

// Sharded (train.zero >= 1): the replicated part only; every rank reads its
// own shards after the agreement (take).
generation_end checkpoint_source::replicated_part(start_context& c) {
  load_request l;
  l.step = c.g.plan.checkpoint_step();
  l.which = c.rs.settings.train.zero >= 1 ? load_which::replicated : load_which::all;
  if (auto ended = load(c, l)) return ended;
  c.g.source = ev::state_source::disk;
  c.rs.disk_step = c.state.step();
  c.rs.window.clear_catch_up();
  if (c.state.diloco()) c.rs.window.from_checkpoint(oldest_fragment_anchor(c.state.outer()), c.state.step(), 0, l.meta.world_size());
  return std::nullopt;
}

// Global rank 0 read the checkpoint and sent it to all: a rank other than 0
// takes its own inner state (parameters, buffers, inner moments) from its
// section when there is one, so that a resume at the same world size is
// exact; without one (a checkpoint of fewer workers, or diloco_workers =
// first) it goes on with rank 0's.
generation_end checkpoint_source::worker_section(start_context& c) {
  load_request l;
  l.step = state_checkpoint_step(c);
  l.own_section = true;
  if (auto ended = load(c, l)) return ended;
  if (l.loaded) c.state.state_loaded(l.meta.step());
  // Its own section: its own slices of the checkpoint's window; else rank 0's.
  c.rs.window.from_checkpoint(oldest_fragment_anchor(c.state.outer()), c.state.step(), l.loaded ? c.g.rank : 0, l.meta.world_size());
  return std::nullopt;
}

generation_end checkpoint_source::take(start_context& c, const shard_plan& plan) { return shards_at(c, plan, state_checkpoint_step(c)); }

// Every rank of a generation whose state came from the checkpoint at `step`
// (global rank 0 loaded it and sent it to all): its own shards' moments,
// read from the parts that hold them (each part whole, its checksum
// checked), not the whole checkpoint.
generation_end checkpoint_source::shards_at(start_context& c, const shard_plan& plan, int64_t step) {
  generation_run& g = c.g;
  if (step != c.state.step())
    return g.failed("the agreed state is at step " + std::to_string(c.state.step()) + ", the plan's checkpoint at step " + std::to_string(step),
                    c.state.step());
  c.state.shard_optimizer(plan.ranges_of(g.rank));
  load_request l;
  l.step = step;
  l.which = load_which::shards;
  if (auto ended = load(c, l)) return ended;
  std::fprintf(stderr, "rank %d: generation %llu: optimizer shards read from the checkpoint at step %lld: %llu of its %llu bytes\n", g.rank,
               static_cast<unsigned long long>(g.gen), static_cast<long long>(c.state.step()), static_cast<unsigned long long>(l.bytes_read),
               static_cast<unsigned long long>(l.meta.state_bytes()));
  c.state.clear_params_mixed();
  c.rs.shards = plan;
  g.optimizer = ev::optimizer_source::checkpoint;
  g.reshard_bytes = l.bytes_read;
  return std::nullopt;
}

// Back to the checkpoint the plan names for that (the coordinator's choice,
// never this rank's): global rank 0 reads its replicated part and sends it
// to all; then every rank reads its own shards. With none committed, the
// job starts over from step 0 (every step is lost, and the journal's
// recovery says so): failing instead would fail the same way in every
// generation after.
generation_end checkpoint_source::fallback(start_context& c, const shard_plan& plan, const std::string& missing) {
  generation_run& g = c.g;
  std::fprintf(stderr, "rank %d: generation %llu: optimizer state of %s was held only by lost ranks; resuming from the plan's checkpoint\n", g.rank,
               static_cast<unsigned long long>(g.gen), missing.c_str());
  const int64_t step = g.plan.has_fallback_checkpoint_step() ? g.plan.fallback_checkpoint_step() : -1;
  bool have_checkpoint = step >= 0;
  if (g.rank == 0 && have_checkpoint) {
    load_request l;
    l.step = step;
    l.which = load_which::replicated;
    if (auto ended = load(c, l)) return ended;
  } else if (g.rank == 0) {
    std::fprintf(stderr,
                 "rank 0: generation %llu: the plan names no checkpoint to go back to (none is committed in %s that no rank refused): "
                 "the job starts over from step 0\n",
                 static_cast<unsigned long long>(g.gen), g.plan.checkpoint_store().c_str());
    if (auto st = c.state.reset_state(); !st) return g.failed("starting over: " + st.message(), c.state.step());
  } else {
    (void)c.state.reset_state();
  }
  g.source = ev::state_source::disk;
  if (g.pg) {
    int64_t from_disk = have_checkpoint ? 1 : 0;
    auto pg = transfer_group(g, c.rs);
    if (!pg) return g.failed("state transfer: " + pg.message(), c.state.step());
    auto sent = broadcast_state(*pg.value(), 0, c.state, g.timeout, g.abandon_now, from_disk, state_transfer_streams, 64ull << 20, transfer_shm(g));
    if (!sent) return g.failed(sent.message(), c.state.step());
    g.root = 0;
    have_checkpoint = from_disk != 0;
  }
  c.rs.disk_step = have_checkpoint ? c.state.step() : -1;
  if (have_checkpoint) return shards_at(c, plan, step);
  // reset_state() zeroed every rank's moments: a fresh optimizer.
  c.state.shard_optimizer(plan.ranges_of(g.rank));
  c.state.clear_params_mixed();
  c.rs.shards = plan;
  g.source = ev::state_source::fresh;
  g.optimizer = ev::optimizer_source::restart;
  return std::nullopt;
}

}  // namespace dtactor
