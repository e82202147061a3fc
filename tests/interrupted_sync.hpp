#pragma once
// A sharded parameter sync (comm/param_sync.hpp) failing as a step does
// when a peer dies inside it: its gradient-norm allreduce completes on
// every rank but fails on this one when `fail_norm` (Gloo's ring lets the
// ranks that already have every piece finish), and its gather after the
// update fails everywhere (the peer is gone). For the interrupted-step
// tests of zero = 2 and 3.
#include <memory>
#include <string>

#include "comm/param_sync.hpp"
#include "model/trainer.hpp"
#include "rank/zero.hpp"

namespace dtactor::testing {

class interrupted_sync final : public param_sync {
 public:
  interrupted_sync(std::unique_ptr<param_sync> real, bool fail_norm) : real_(std::move(real)), fail_norm_(fail_norm) {}
  bool sharded_norm() const override { return true; }
  result<double> global_norm() override {
    auto n = real_->global_norm();
    if (fail_norm_) return make_error("allreduce of the gradient norm failed on this rank: a peer died inside it");
    return n;
  }
  status gather() override { return make_error("parameter gather: a peer is gone"); }
  std::string describe() const override { return "interrupted"; }

 private:
  std::unique_ptr<param_sync> real_;
  bool fail_norm_;
};

// A survivor's first move in the next generation: with `finish`,
// finish_interrupted_step (its `*finished` says whether this rank finished
// a step), else it drops what it kept. "" or the error.
inline std::string finish_or_drop(c10d::ProcessGroup& pg, training_state& s, bool finish, int* finished) {
  *finished = 0;
  if (!finish) {
    s.drop_interrupted_step();
    return "";
  }
  auto f = finish_interrupted_step(pg, s, std::chrono::milliseconds(20000), {});
  if (!f) return f.message();
  *finished = *f ? 1 : 0;
  return "";
}

}  // namespace dtactor::testing
