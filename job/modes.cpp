#include "job/modes.hpp"

namespace dtactor {

result<job_modes> job_modes_of(const config& cfg) {
  job_modes m;
  auto sync = mode_of<sync_mode>(cfg);
  if (!sync) return sync.err();
  m.sync = sync.value();
  auto worker = mode_of<diloco_worker_kind>(cfg);
  if (!worker) return worker.err();
  m.diloco_worker = worker.value();
  auto workers = mode_of<diloco_checkpoint_workers>(cfg);
  if (!workers) return workers.err();
  m.checkpoint_workers = workers.value();
  auto direct = mode_of<direct_checkpoint>(cfg);
  if (!direct) return direct.err();
  m.direct = direct.value();
  auto loss = mode_of<loss_kind>(cfg);
  if (!loss) return loss.err();
  m.loss = loss.value();
  auto backend = mode_of<comm_backend>(cfg);
  if (!backend) return backend.err();
  m.backend = backend.value();
  return m;
}

}  // namespace dtactor
