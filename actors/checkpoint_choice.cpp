#include "actors/checkpoint_choice.hpp"

namespace dtactor {

checkpoint_ledger ledger_at_start(const std::vector<int64_t>& in_store, int64_t resume_step) {
  checkpoint_ledger l;
  if (resume_step < 0) return l;
  for (int64_t s : in_store)
    if (s <= resume_step) l.committed.insert(s);
  l.committed.insert(resume_step);
  return l;
}

int64_t plan_checkpoint(const checkpoint_ledger& l) {
  for (auto it = l.committed.rbegin(); it != l.committed.rend(); ++it)
    if (!l.bad.count(*it)) return *it;
  return -1;
}

void checkpoint_committed(checkpoint_ledger& l, int64_t step, const std::vector<int64_t>& kept) {
  if (!kept.empty()) l.committed = std::set<int64_t>(kept.begin(), kept.end());
  l.committed.insert(step);
  l.bad.erase(step);
}

refusal refuse_checkpoint(checkpoint_ledger& l, int64_t step, const std::string& who, const std::string& why) {
  refusal r;
  r.newly_bad = l.bad.insert(step).second;
  r.fallback = plan_checkpoint(l);
  r.exhausted = r.fallback < 0;
  const std::string head = who + " refused the checkpoint at step " + std::to_string(step) + " (" + why + ")";
  if (r.exhausted)
    r.line = head + ": no other committed checkpoint is left that no rank refused; the job cannot resume (restore the checkpoint store, or "
                    "start over with --no-resume)";
  else
    r.line = head + ": marked bad for this job; the next generation resumes from the checkpoint at step " + std::to_string(r.fallback);
  return r;
}

}  // namespace dtactor
