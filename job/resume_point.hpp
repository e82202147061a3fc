#pragma once
// Where a run starts: the checkpoint it resumes from and the number of its
// first generation. One code path for the coordinator (app/coordinator) and
// `dtactor train` (app/train_command). Torch-free; reads the store (and the
// sample log's directory) and blocks on them.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "checkpoint.pb.h"
#include "dtactor/result.hpp"
#include "job/journal_events.hpp"
#include "storage/checkpoint_store.hpp"

namespace dtactor {

// How a run asks to resume.
struct resume_request {
  bool resume = true;       // the newest valid checkpoint of the run's store (false: --no-resume, start over)
  std::string resume_from;  // a checkpoint named (`train --resume-from`): a run directory, store or manifest; wins over `resume`
};

// The checkpoint a run resumes from.
struct resume_point {
  pb::checkpoint_meta meta;
  std::string path;                         // its manifest, for messages
  std::shared_ptr<checkpoint_store> from;  // the store that holds it
};

// Where the lookup reports: one line per checkpoint passed over
// ("skipping checkpoint PATH: WHY"; the caller adds its prefix), and the
// journal (checkpoint_skipped for each).
struct resume_reports {
  std::function<void(const std::string& line)> log;
  std::function<void(const ev::journal_event&)> journal;
};

// The checkpoint named, or the newest committed one of `store` whose parts
// check out (read whole: no model bytes held), each newer bad one skipped
// and reported; none when there is none or the request says start over.
// Whether the job may load it is the caller's check
// (check_checkpoint_compatible).
result<std::optional<resume_point>> find_resume_point(const resume_request& request, checkpoint_store& store, const resume_reports& reports);

// The newest generation earlier runs reached: in the commits of `store`
// (they fence older generations out) and in the records of the sample log's
// directory `sample_log_dir` (empty: none). A run numbers its generations
// above it, so that its checkpoints and its records of the steps it redoes
// supersede the earlier runs'. 0 when there were none.
result<uint64_t> generations_before(checkpoint_store& store, const std::string& sample_log_dir);

}  // namespace dtactor
