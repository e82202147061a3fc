#include "job/checkpoint_commit.hpp"

#include <chrono>
#include <utility>

#include "storage/manifest_plan.hpp"

namespace dtactor {

commit_fn commit_to(checkpoint_store& store) {
  return [&store](pb::checkpoint_meta meta) -> result<saved_checkpoint> {
    const auto t0 = std::chrono::steady_clock::now();
    auto done = store.commit(std::move(meta));
    if (!done) return done.err();
    saved_checkpoint saved;
    saved.path = done->location;
    saved.bytes = static_cast<int64_t>(done->bytes);
    saved.duration_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    saved.kept = std::move(done->kept);
    return saved;
  };
}

result<committed_step> commit_checkpoint(int64_t step, const written_parts& parts, const commit_fn& commit) {
  auto planned = plan_manifest(parts.meta, parts.generation, parts.world, parts.parts);
  if (!planned) return planned.err();
  const uint64_t bytes = planned->state_bytes();
  const int32_t nparts = planned->parts_size();
  auto written = commit(std::move(planned.value()));
  if (!written) return written.err();
  committed_step done;
  ev::checkpoint_saved& e = done.saved;
  e.step = step;
  e.path = written->path;
  e.bytes = written->bytes;
  e.generation = parts.generation;
  e.duration_s = written->duration_s;
  e.parts = nparts;
  e.stall_s = parts.stall_s;
  e.write_s = parts.write_s;
  e.bytes_per_s = parts.write_s > 0 ? static_cast<double>(bytes) / parts.write_s : 0;
  e.direct_ranks = parts.direct;
  if (parts.due_step > 0 && parts.due_step < step) e.due_step = parts.due_step;
  done.kept = std::move(written->kept);
  return done;
}

}  // namespace dtactor
