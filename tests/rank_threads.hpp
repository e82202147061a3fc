#pragma once
// Ranks as threads of one test process, over one in-memory store, and the
// training states they start from.
#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <vector>

#include "model/trainer.hpp"
#include "comm/communicator.hpp"
#include "comm/grad_sync.hpp"
#include "comm/exchange.hpp"
#include "comm/shm_group.hpp"

namespace dtactor::testing {

// Runs fn(rank, group) for `world` ranks as threads; returns each rank's
// failure text (empty when it passed its own checks).
inline std::vector<std::string> run_ranks(int world, const std::function<std::string(int, c10::intrusive_ptr<c10d::ProcessGroup>)>& fn,
                                          std::chrono::milliseconds collective_timeout = std::chrono::milliseconds(10000),
                                          c10::intrusive_ptr<c10d::Store> store = {}) {
  if (!store) store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      communicator_options o;
      o.timeout = collective_timeout;
      auto pg = make_process_group(store, r, world, o);
      if (!pg) {
        errors[r] = pg.message();
        return;
      }
      try {
        errors[r] = fn(r, pg.value());
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

// As run_ranks, and each rank also joins a shared-memory group (slots of
// `floats` floats) through the same store; a rank that gets none fails.
inline std::vector<std::string> run_ranks_shm(int world, int64_t floats,
                                       const std::function<std::string(int, c10::intrusive_ptr<c10d::ProcessGroup>, std::shared_ptr<shm_group>)>& fn,
                                       std::chrono::milliseconds collective_timeout = std::chrono::milliseconds(10000)) {
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::HashStore>();
  return run_ranks(
      world,
      [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
        auto prefixed = c10::make_intrusive<c10d::PrefixStore>("shm", store);
        std::string why;
        auto g = shm_group::join(*prefixed, rank, world, floats, &why);
        if (!g) return g.message();
        if (!g.value()) return "no shared memory: " + why;
        return fn(rank, pg, g.value());
      },
      collective_timeout, store);
}

// Ranks as threads on "hosts" named by keys[rank]: each sets up the
// exchange through the store as a rank process does (setup_exchange), then
// runs fn with its world group and the plan.
inline std::vector<std::string> run_on_hosts(const std::vector<std::string>& keys, int64_t floats,
                                      const std::function<std::string(int, c10::intrusive_ptr<c10d::ProcessGroup>, const exchange_plan&)>& fn,
                                      int64_t gather_floats = 0) {
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::HashStore>();
  const int world = static_cast<int>(keys.size());
  return run_ranks(
      world,
      [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
        communicator_options co;
        co.timeout = std::chrono::milliseconds(10000);
        auto plan = setup_exchange(c10::make_intrusive<c10d::PrefixStore>("x", store), rank, world, floats, co, keys[static_cast<size_t>(rank)]);
        if (!plan) return plan.message();
        // train.zero = 3's gather segments, as the rank worker joins them.
        if (gather_floats > 0)
          if (auto st = join_gather_segments(store, rank, world, gather_floats, 0, plan.value()); !st) return st.message();
        return fn(rank, pg, plan.value());
      },
      std::chrono::milliseconds(10000), store);
}

// training_state::create seeds the global generator: build states one after
// another, before any rank thread starts, so that every rank starts equal.
inline std::vector<std::unique_ptr<training_state>> make_states(const config& cfg, int n) {
  configure_threads(train_settings_of(cfg).value().threads);
  std::vector<std::unique_ptr<training_state>> out;
  for (int i = 0; i < n; ++i) {
    auto s = training_state::create(cfg);
    if (!s) throw std::runtime_error(s.message());
    out.push_back(std::move(s.value()));
  }
  return out;
}

// One step of a world-1 job as rank/step_loop takes it: the job's step
// (training_state::train_step) through a reducer without a group, then
// DiLoCo's outer step where one is due. Returns the mean loss.
inline double train_alone(training_state& s) {
  grad_sync local(s.the_task().module()->parameters(), c10::intrusive_ptr<c10d::ProcessGroup>());
  auto r = s.train_step(step_context::of_job(s.diloco(), 0, 1, local));
  if (!r) throw std::runtime_error(r.message());
  if (s.diloco()) {
    auto st = s.outer().after_inner_step(
        s.step(), s.outer().options().max_steps, [&local](size_t) -> grad_sync& { return local; }, std::nullopt,
        [](const outer_step_result&) {});
    if (!st) throw std::runtime_error(st.message());
  }
  return r->loss_sum / static_cast<double>(r->samples);
}

}  // namespace dtactor::testing
