#include "rank/checkpoint_saver.hpp"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "model/trainer.hpp"
#include "rank/generation.hpp"
#include "rank/state_io.hpp"
#include "rank/sync_strategy.hpp"

namespace dtactor {

namespace {
// The stream a checkpoint of this generation holds: the state's layout and,
// where the sync strategy writes them (DiLoCo with
// checkpoint.diloco_workers = all), every other worker's own inner state
// after it as a section of its own.
state_layout checkpoint_layout(training_state& state, const checkpoint_saver_options& o, int rank, int world) {
  const bool sections = o.sync && o.sync->writes_worker_sections(o.modes, world);
  return sections ? with_worker_sections(layout_of(state), rank, world) : layout_of(state);
}

// This rank's byte ranges of it, as the save planner decides them
// (storage/checkpoint_plan through state_io's save_ranges): sharded, its
// share of the replicated bytes and the windows of the shards it is the
// primary of; DiLoCo, worker 0 the stream proper (global rank 0's whole
// state, not a mix) and each other worker its section (none: an empty part);
// else its balanced share.
std::vector<byte_range> checkpoint_ranges(training_state& state, const std::optional<shard_plan>& shards, const state_layout& layout, int rank,
                                          int world) {
  rank_share share;
  share.rank = rank;
  share.world = world;
  share.per_worker = state.diloco();
  if (shards && layout.sharded()) {
    const auto& mine = shards->shards[static_cast<size_t>(rank)];
    share.primary = {{mine.begin, mine.end}};
    share.held = shards->ranges_of(rank);
  }
  return save_ranges(layout, share, state.optimizer().group_bases(), shards && layout.sharded() ? sharded_params(state) : std::map<std::string, int64_t>{});
}

uint64_t bytes_of(const std::vector<byte_range>& ranges) {
  uint64_t bytes = 0;
  for (const auto& [a, b] : ranges) bytes += b - a;
  return bytes;
}
}  // namespace

checkpoint_saver::checkpoint_saver(checkpoint_saver_options o) : o_(std::move(o)) {}

checkpoint_saver::~checkpoint_saver() = default;

void checkpoint_saver::ensure_writer() {
  if (!writer_) writer_ = std::make_unique<part_writer>(o_.on_written, o_.keep_buffer);
}

void checkpoint_saver::prepare(training_state& state, const std::optional<shard_plan>& shards, const generation_run& g) {
  if (g.plan.checkpoint_store().empty()) return;
  ensure_writer();
  const state_layout layout = checkpoint_layout(state, o_, g.rank, g.world);
  const uint64_t bytes = bytes_of(checkpoint_ranges(state, shards, layout, g.rank, g.world));
  // auto: once the first step showed its peak (after_first_step).
  if (o_.keep_buffer && o_.modes.direct == direct_checkpoint::off) writer_->prepare(bytes);
  prepare_after_step_ = o_.keep_buffer && o_.modes.direct == direct_checkpoint::automatic;
  // A checkpoint due right after the first step would make the buffer in
  // its stall: until after_first_step, this rank counts as writing.
  buffer_owed_ = prepare_after_step_ && writer_->buffer_bytes() < bytes;
}

void checkpoint_saver::after_first_step(training_state& state, const std::optional<shard_plan>& shards, const generation_run& g) {
  buffer_owed_ = false;
  if (!std::exchange(prepare_after_step_, false) || !writer_) return;
  const uint64_t bytes = bytes_of(checkpoint_ranges(state, shards, checkpoint_layout(state, o_, g.rank, g.world), g.rank, g.world));
  if (writer_->buffer_bytes() < bytes && part_buffer_fits(bytes, host_ranks(g), read_memory_room())) writer_->prepare(bytes);
}

// The ranks of this host, each with its own writer.
int checkpoint_saver::host_ranks(const generation_run& g) const {
  return std::max<int>({1, static_cast<int>(g.exchange.host_members.size()), o_.local_world});
}

// checkpoint.direct: true, false, or (auto) straight from the state when
// this host has no room for a part buffer per rank (part_buffer_fits); a
// buffer this rank already holds is used.
bool checkpoint_saver::direct(const generation_run& g, uint64_t bytes, int64_t step) {
  if (o_.modes.direct != direct_checkpoint::automatic) return o_.modes.direct == direct_checkpoint::on;
  if (writer_->buffer_bytes() >= bytes) return false;
  const int ranks = host_ranks(g);
  const memory_room room = read_memory_room();
  const bool direct = !part_buffer_fits(bytes, ranks, room);
  if (wrote_direct_ != direct) {
    auto gb = [](double b) { return b / 1e9; };
    if (direct)
      std::fprintf(
          stderr,
          "rank %d: checkpoint at step %lld written straight from the state during the next step (checkpoint.direct = auto; what is not "
          "written by the update is copied aside where it fits): no room for %d part buffers of %.2f GB beside the steps (%.2f GB available on "
          "this host, this rank's step takes %.2f GB more than it holds)\n",
          g.rank, static_cast<long long>(step), ranks, gb(static_cast<double>(bytes)), gb(static_cast<double>(room.available)),
          gb(static_cast<double>(room.step_headroom)));
    else if (wrote_direct_)
      std::fprintf(stderr, "rank %d: checkpoint at step %lld copied into a %.2f GB buffer again (checkpoint.direct = auto: there is room now)\n",
                   g.rank, static_cast<long long>(step), gb(static_cast<double>(bytes)));
  }
  return direct;
}

void checkpoint_saver::write(training_state& state, const std::optional<shard_plan>& shards, const generation_run& g,
                             const std::map<std::string, double>& eval_at_step, int64_t due_step) {
  if (g.plan.checkpoint_store().empty()) return;  // the plan names no store: checkpoints are off
  ensure_writer();
  const state_layout layout = checkpoint_layout(state, o_, g.rank, g.world);
  part_writer::job j;
  j.step = state.step();
  j.generation = g.gen;
  j.rank = g.rank;
  j.world = g.world;
  j.node_id = o_.node_id;
  j.store = g.plan.checkpoint_store();
  j.s3_endpoint = o_.s3_endpoint;
  j.ranges = checkpoint_ranges(state, shards, layout, g.rank, g.world);
  j.due_step = due_step;
  if (g.rank == 0) {
    auto meta = state.checkpoint_meta(eval_at_step, g.gen);
    describe_layout(layout, meta);
    meta.set_world_size(g.world);
    j.meta = meta.SerializeAsString();
  }
  const uint64_t bytes = bytes_of(j.ranges);
  const bool direct = this->direct(g, bytes, j.step);
  wrote_direct_ = direct;
  // Direct: the write reads the parameters and moments while the next step
  // computes its gradients; its update (or whatever else changes them
  // first) waits until what is not written yet fits in the memory the host
  // can still give each of its ranks, copies that aside and goes on.
  if (direct) {
    writer_->set_aside_bytes(room_for_buffer(bytes, host_ranks(g), read_memory_room()));
    state.set_before_update([w = writer_.get()] { w->fence(); });
  }
  writer_->submit(layout, std::move(j), direct);
}

void checkpoint_saver::finish() {
  if (writer_) writer_->wait_idle();
}

void checkpoint_saver::release_state() {
  if (writer_) writer_->wait_state_unread();
}

bool checkpoint_saver::writing() { return buffer_owed_ || (writer_ && writer_->writing()); }

std::optional<uint64_t> checkpoint_saver::buffer_bytes() {
  if (!writer_) return std::nullopt;
  return writer_->buffer_bytes();
}

}  // namespace dtactor
