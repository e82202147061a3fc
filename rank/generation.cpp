#include "rank/generation.hpp"

#include "comm/communicator.hpp"
#include "data/sample_log.hpp"
#include "model/trainer.hpp"
#include "rank/checkpoint_saver.hpp"
#include "rank/sync_strategy.hpp"

namespace dtactor {

using clock_type = std::chrono::steady_clock;

clock_type::time_point deadline_in(std::chrono::milliseconds d) { return clock_type::now() + d; }

double now_s() { return std::chrono::duration<double>(clock_type::now().time_since_epoch()).count(); }

namespace {
status words_allreduce(c10d::ProcessGroup& pg, std::vector<int64_t>& words, c10d::ReduceOp op, clock_type::time_point deadline,
                       const abandon_fn& abandon, const char* what) {
  std::vector<torch::Tensor> t{torch::tensor(words, torch::kInt64)};
  c10d::AllreduceOptions o;
  o.reduceOp = op;
  if (auto st = wait_work(pg.allreduce(t, o), deadline, abandon, what); !st) return st;
  const auto a = t[0].accessor<int64_t, 1>();
  for (size_t i = 0; i < words.size(); ++i) words[i] = a[static_cast<int64_t>(i)];
  return {};
}
}  // namespace

status max_allreduce(c10d::ProcessGroup& pg, std::vector<int64_t>& words, clock_type::time_point deadline, const abandon_fn& abandon,
                     const char* what) {
  return words_allreduce(pg, words, c10d::ReduceOp::MAX, deadline, abandon, what);
}

status sum_allreduce(c10d::ProcessGroup& pg, std::vector<int64_t>& words, clock_type::time_point deadline, const abandon_fn& abandon,
                     const char* what) {
  return words_allreduce(pg, words, c10d::ReduceOp::SUM, deadline, abandon, what);
}

pb::rank_status status_of(pb::rank_status::state s, int rank, int local_rank, int64_t step, const std::string& detail) {
  pb::rank_status st;
  st.set_status(s);
  st.set_global_rank(rank);
  st.set_local_rank(local_rank);
  st.set_step(step);
  st.set_detail(detail);
  return st;
}

rank_state::rank_state() = default;
rank_state::~rank_state() = default;

status rank_state::log_samples(int64_t step, uint64_t gen, int rank, int world, const std::vector<bool>& fragments,
                               const std::vector<int64_t>* samples) {
  if (!samples_log) return {};
  std::vector<int> to;
  for (size_t f = 0; f < fragments.size(); ++f)
    if (fragments[f]) to.push_back(static_cast<int>(f));
  return samples_log->append(step, gen, rank, world, samples ? *samples : state->recorded_samples(), fragments.empty() ? nullptr : &to);
}

void generation_run::report_status(pb::rank_status::state s, int64_t step, const std::string& detail) const {
  if (cb.on_status) cb.on_status(gen, status_of(s, rank, local, step, detail));
}

generation_outcome generation_run::failed(const std::string& why, int64_t step, pb::rank_status::failure_kind kind) const {
  if (quitting()) return generation_outcome::quit;
  // Abandoned for a newer plan: not a failure of this generation.
  if (abandon_now()) return generation_outcome::next_plan;
  auto s = status_of(pb::rank_status::STATE_FAILED, rank, local, step, why);
  s.set_failure(kind);
  if (cb.on_status) cb.on_status(gen, std::move(s));
  return generation_outcome::failed;
}

generation_outcome generation_run::checkpoint_unusable(int64_t checkpoint_step, const std::string& why, bool refused, int64_t step) const {
  if (!refused) return failed(why, step);
  if (quitting()) return generation_outcome::quit;
  if (abandon_now()) return generation_outcome::next_plan;
  auto s = status_of(pb::rank_status::STATE_FAILED, rank, local, step, why);
  s.set_failure(pb::rank_status::FAILURE_CHECKPOINT);
  s.set_refused_checkpoint_step(checkpoint_step);
  if (cb.on_status) cb.on_status(gen, std::move(s));
  return generation_outcome::failed;
}

bool host_worker(const generation_run& g, const rank_state& rs) {
  return rs.state->diloco() && rs.settings.modes.diloco_worker == diloco_worker_kind::host && g.world > 1 && g.exchange.shm && g.exchange.host_ranks > 1 &&
         (g.exchange.hierarchical || g.exchange.host_count == 1);
}

}  // namespace dtactor
