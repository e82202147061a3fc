#pragma once
// What the reducer's tests (grad_sync_test.cpp, grad_sync_shm_test.cpp)
// share: options, step controls, and gradients compared with one
// process's.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "comm/grad_sync.hpp"
#include "model/trainer.hpp"
#include "rank_threads.hpp"
#include "test_util.hpp"

namespace dtactor {
namespace grad_sync_testing {

inline grad_sync_options bucket_of(int64_t bytes) {
  grad_sync_options o;
  o.bucket_bytes = bytes;
  return o;
}

using testing::tiny_vit_config;

inline step_control ctl(float newer_plan, float stop, float final_checkpoint = 0.f) {
  step_control c;
  c.newer_plan = newer_plan;
  c.stop = stop;
  c.final_checkpoint = final_checkpoint;
  return c;
}
inline std::vector<float> words(const step_control& c) { return {c.newer_plan, c.stop, c.final_checkpoint}; }

using testing::make_states;
using testing::run_ranks;
using testing::run_ranks_shm;
using testing::run_on_hosts;

inline void expect_no_errors(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_TRUE(errors[r].empty()) << "rank " << r << ": " << errors[r];
}

inline std::vector<torch::Tensor> params_of(training_state& s) { return s.the_task().module()->parameters(); }

inline int64_t gradient_floats(training_state& s) {
  int64_t n = 0;
  for (auto& p : params_of(s)) n += p.numel();
  return n;
}

inline std::vector<torch::Tensor> single_process_gradients(training_state& s) {
  s.forward_backward(s.order().global_batch(s.step()), s.step());
  std::vector<torch::Tensor> g;
  for (auto& t : s.gradients()) g.push_back(t.clone());
  return g;
}

// "" when every gradient of `s` matches `want`.
inline std::string compare_gradients(training_state& s, const std::vector<torch::Tensor>& want) {
  auto got = s.gradients();
  if (got.size() != want.size()) return "parameter count differs";
  for (size_t i = 0; i < got.size(); ++i) {
    if (!got[i].defined()) return "gradient " + std::to_string(i) + " undefined";
    if (!torch::allclose(got[i], want[i], 1e-4, 1e-6))
      return "gradient " + std::to_string(i) + " differs by " + std::to_string((got[i] - want[i]).abs().max().item<double>());
  }
  return "";
}

}  // namespace grad_sync_testing
}  // namespace dtactor
