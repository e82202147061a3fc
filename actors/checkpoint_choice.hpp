#pragma once
// Which committed checkpoint a plan without a surviving state holder names,
// as plain data and pure functions beside the membership actor (no CAF, no
// store, no clock): the newest committed checkpoint that no rank of this job
// has refused. A rank refuses a checkpoint whose bytes do not check out
// (a checksum, a missing or short part, a manifest that does not decode) or
// that does not fit the job; it is then marked bad and never planned again,
// and the next plan falls back to the previous one. With none left the job
// cannot go on: it fails with one line rather than re-planning forever.
//
// The marks live as long as the coordinator. A restarted coordinator does
// not read them back: its start-up check reads every candidate checkpoint
// whole, checksums included (checkpoint_store::newest_valid), which finds
// damage in the store itself, and a mark kept on disk would outlive a
// repair (a part restored from a copy) or a new commit of that step.
#include <cstdint>
#include <set>
#include <string>
#include <vector>

namespace dtactor {

struct checkpoint_ledger {
  // Steps with a committed manifest in the store, as the coordinator last
  // heard (its start-up listing, then each commit's kept set after rotation).
  std::set<int64_t> committed;
  // Refused by a rank of this job: never planned again, until a new commit
  // of that step replaces its manifest.
  std::set<int64_t> bad;
};

// The ledger at start: the committed checkpoints at or below the one
// resumed from (`resume_step`, -1: none, the job starts over and plans
// none of them).
checkpoint_ledger ledger_at_start(const std::vector<int64_t>& in_store, int64_t resume_step);

// The step a plan without a state holder loads: the newest committed
// checkpoint not marked bad; -1 when there is none.
int64_t plan_checkpoint(const checkpoint_ledger& l);

// A checkpoint was committed at `step`; `kept` are the committed steps left
// in the store after its rotation (empty: not known, the others stay). A
// new commit of a step marked bad clears the mark: it is another checkpoint.
void checkpoint_committed(checkpoint_ledger& l, int64_t step, const std::vector<int64_t>& kept);

// What a rank's refusal of the checkpoint at `step` changes.
struct refusal {
  bool newly_bad = false;  // false: it was marked already (another rank's report of the same one)
  int64_t fallback = -1;   // what the next plan without a holder loads (-1: none)
  bool exhausted = false;  // no committed checkpoint is left that no rank refused: the job fails
  std::string line;        // one line for the log (and, exhausted, the job's failure)
};

// Marks `step` bad; `why` is the rank's reason, `who` names the rank
// ("rank 0 on node 'a'").
refusal refuse_checkpoint(checkpoint_ledger& l, int64_t step, const std::string& who, const std::string& why);

}  // namespace dtactor
