#pragma once
// The per-step control every rank adds to its step: a few floats that ride
// at the end of the step's last gradient bucket and are SUM-reduced with
// it, so agreeing on them costs no collective of its own. After the step
// every rank reads the same sums and takes the same decision at the same
// step boundary.
//
// The layout is this struct's, defined here only: grad_sync copies it in
// and out as `words` floats in declaration order (checked by static_assert
// and by GradSync.StepControlLayoutIsItsFieldsInOrder). A new field is one
// more float; every exchange sums control words exactly (fp32, also over a
// bf16 wire).
#include <cstdint>
#include <type_traits>

namespace dtactor {

struct step_control {
  // 1 from each rank that holds a plan newer than this generation.
  float newer_plan = 0;
  // 1 from each rank asked to stop at this step boundary (SIGTERM, leave).
  float stop = 0;
  // 1 from each rank whose stop asks for a final checkpoint.
  float final_checkpoint = 0;
  // 1 from each rank whose checkpoint writer was still storing a part when
  // its backward of the step ended (checkpoint.defer_while_writing).
  float writer_busy = 0;

  static constexpr int64_t words = 4;

  // Decisions on the world's sums.
  // Every rank holds the newer plan: all switch to it after this step.
  bool all_hold_newer_plan(int world) const { return newer_plan > static_cast<float>(world) - 0.5f; }
  // Some rank was asked to stop: all stop after this step.
  bool stop_agreed() const { return stop > 0.5f; }
  // Some rank's stop asked for a final checkpoint (rank 0 writes it; its
  // own request may arrive a moment after a peer's).
  bool final_checkpoint_wanted() const { return final_checkpoint > 0.5f; }
  // Some rank still stored a checkpoint part: a checkpoint due now waits
  // for a boundary where none does (checkpoint.defer_while_writing).
  bool some_writer_busy() const { return writer_busy > 0.5f; }
};

static_assert(std::is_standard_layout_v<step_control> && std::is_trivially_copyable_v<step_control>,
              "step_control is copied as raw floats");
static_assert(sizeof(step_control) == step_control::words * sizeof(float), "step_control: one float per word, no padding");

}  // namespace dtactor
