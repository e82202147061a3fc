// train.zero = 3 (rank/zero3): parameters sharded as the moments are, a
// unit (a block) gathered right before it runs and released after. Against
// train.zero = 2 over the same group: the same parameters bit for bit, the
// same evaluation, and between steps the pages of what a rank does not hold
// are not resident. Ranks are threads over Gloo.
#include "rank/zero3.hpp"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <torch/torch.h>

#include <algorithm>
#include <future>

#include "comm/grad_sync.hpp"
#include "comm/shm_group.hpp"
#include "model/flat_adamw.hpp"
#include "model/layers.hpp"
#include "model/shard_plan.hpp"
#include "model/trainer.hpp"
#include "rank/zero.hpp"
#include "rank/zero_sync.hpp"
#include "rank/state_io.hpp"
#include "app/train_command.hpp"
#include "storage/checkpoint_store.hpp"
#include "interrupted_sync.hpp"
#include "rank_threads.hpp"
#include "test_util.hpp"
#include "torchscript_fixtures.hpp"

namespace dtactor {
namespace {

using testing::interrupted_sync;
using testing::make_states;
using testing::temp_dir;
using testing::run_ranks;
using testing::tiny_vit_config;

std::vector<std::string> nodes_of(int world) {
  std::vector<std::string> n;
  for (int r = 0; r < world; ++r) n.push_back(std::string(1, static_cast<char>('a' + r)));
  return n;
}

using testing::interior_pages;

struct level_run {
  std::vector<std::unique_ptr<training_state>> states;
  shard_plan plan;
  std::vector<std::string> digests;             // each rank's whole parameters after the steps
  std::vector<double> val_loss;                 // each rank's evaluation after the steps
  std::vector<size_t> released_resident;        // level 3: the most pages of the released spans resident between steps
  std::vector<size_t> released_pages;           // level 3: pages of the released spans
  std::vector<int64_t> resident_bytes;          // level 3: what the gate counts as resident
  std::vector<int> units;
  std::vector<size_t> pool_cap, pooled;  // level 3: each rank's page pool, and what it held after the steps
};

// Where the ranks are and how level 3's units travel.
struct gather_how {
  // > 0: the units gathered through shared-memory segments of that many
  // floats a slot (rounds of half of it) instead of the group.
  int64_t segment_floats = 0;
  // Each rank's host (empty: one host): with a segment, one per host,
  // as the rank worker joins them (join_gather_segments), and the shard
  // plan's node of each rank is its host.
  std::vector<std::string> hosts;
  // Level 3: every rank's blocks built without their values
  // (defer_block_values, as the rank worker builds them), each rank making
  // its own shards' initial values (make_initial_units).
  bool deferred = false;
  // Set: each rank's parameter sync is what this makes of the real one.
  std::function<std::unique_ptr<param_sync>(int rank, std::unique_ptr<param_sync>)> wrap_sync;
};

std::vector<std::string> train_run(level_run& run, int level, int steps, const gather_how& how);

// `steps` steps at train.zero = `level` (2 or 3) over Gloo, a node per
// rank (or per host), `replicas` holders a shard, the gradients
// reduce-scattered.
level_run run_level(int level, const std::vector<std::string>& extra, int world, int replicas, int steps, const gather_how& how = {}) {
  std::vector<std::string> o = extra;
  o.push_back("train.zero=" + std::to_string(level));
  level_run run;
  {
    defer_block_values defer(how.deferred);
    run.states = make_states(tiny_vit_config(o), world);
  }
  run.plan = make_shard_plan(run.states[0]->optimizer().total_elements(), how.hosts.empty() ? nodes_of(world) : how.hosts, replicas);
  for (int r = 0; r < world; ++r) {
    auto& s = *run.states[static_cast<size_t>(r)];
    EXPECT_EQ(s.units_deferred(), how.deferred);
    s.shard_optimizer(run.plan.ranges_of(r));
    if (how.deferred) {
      EXPECT_TRUE(make_initial_units(s.optimizer(), s.the_task().param_units(), run.plan.ranges_of(r)).ok());
    }
  }
  const auto errors = train_run(run, level, steps, how);
  for (int r = 0; r < world; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "level " << level << " rank " << r;
  return run;
}

// `steps` steps of run.states (one a rank) under run.plan at `level`;
// every rank's error ("" for none), the digests and evaluations in `run`.
std::vector<std::string> train_run(level_run& run, int level, int steps, const gather_how& how) {
  const int world = static_cast<int>(run.states.size());
  run.digests.resize(static_cast<size_t>(world));
  run.val_loss.resize(static_cast<size_t>(world));
  run.released_resident.assign(static_cast<size_t>(world), 0);
  run.released_pages.assign(static_cast<size_t>(world), 0);
  run.resident_bytes.assign(static_cast<size_t>(world), 0);
  run.units.assign(static_cast<size_t>(world), 0);
  run.pool_cap.assign(static_cast<size_t>(world), 0);
  run.pooled.assign(static_cast<size_t>(world), 0);
  auto body = [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg, gather_route route) -> std::string {
    auto& s = *run.states[static_cast<size_t>(rank)];
    flat_adamw& opt = s.optimizer();
    grad_sync_options go;
    go.bucket_bytes = 16 * 1024;
    go.zero2 = zero2_of(opt, run.plan);
    grad_sync sync(s.the_task().module()->parameters(), pg, go);
    zero_sync_settings zs;
    zs.pg = pg;
    zs.sharded_norm = true;
    zs.timeout = std::chrono::milliseconds(20000);
    std::unique_ptr<param_sync> ps = zero_sync_over_group(opt, run.plan, zs);
    std::shared_ptr<unit_gatherer> gate;
    auto units = s.the_task().param_units();
    // As the rank worker's gate_units: level 3's units, or bf16's copies
    // gathered whole after each update at level 2.
    const unit_policy policy = level >= 3 ? unit_policy::each_pass : unit_policy::copies_resident;
    if (masters_sharded(s.settings().train)) {
      auto layout = unit_layout_of(opt, units);
      if (!layout) return layout.message();
      const bool segment = how.segment_floats > 0;
      gate = std::make_shared<unit_gatherer>(pg, opt, run.plan, layout_for(std::move(layout.value()), policy), zs.timeout, std::function<bool()>{},
                                             route, std::chrono::microseconds(50), policy);
      if (segment != gate->through_shared_memory()) return "shared memory " + std::string(segment ? "not used" : "used");
      ps = zero3_sync(std::move(ps), gate, "gloo");
      if (policy == unit_policy::each_pass)
        for (size_t i = 0; i < units.size(); ++i) *units[i].slot = gate_slot{gate, static_cast<int>(i)};
      gate->reshard();
      if (policy == unit_policy::copies_resident || gate->root_sharded())
        if (auto st = gate->after_update(); !st) return st.message();
      run.units[static_cast<size_t>(rank)] = gate->units();
    }
    if (how.wrap_sync) ps = how.wrap_sync(rank, std::move(ps));
    sync.set_parameter_sync(std::move(ps));
    auto released = [&] {
      std::pair<size_t, size_t> n{0, 0};
      const auto held = run.plan.ranges_of(rank);
      auto count = [&n](const std::vector<torch::Tensor>& views) {
        for (const auto& v : views) {
          const auto p = interior_pages(v.data_ptr(), v.numel() * static_cast<int64_t>(v.element_size()));
          n.first += p.first;
          n.second += p.second;
        }
      };
      for (const auto& spans : gate->layout().units) {
        for (const auto& [a, b] : spans_outside(spans, held)) {
          count(opt.param_views(a, b));  // the masters
          if (policy == unit_policy::each_pass) count(opt.compute_views(a, b));  // and level 3's bf16 copies
        }
        if (policy == unit_policy::each_pass)  // level 3 in bf16: no copy of its own shards either
          for (const auto& [a, b] : spans_outside(spans, spans_outside(spans, held))) count(opt.compute_views(a, b));
      }
      if (gate->root_sharded())  // level 3 in bf16: nor the masters of no unit outside its shards
        for (const auto& [a, b] : spans_outside(gate->layout().root, held)) count(opt.param_views(a, b));
      return n;
    };
    std::string err;
    for (int i = 0; i < steps && err.empty(); ++i) {
      auto r = s.train_step(step_context::every_step(rank, world, sync));
      if (!r) err = r.message();
      if (gate) {
        const auto n = released();
        run.released_resident[static_cast<size_t>(rank)] = std::max(run.released_resident[static_cast<size_t>(rank)], n.first);
        run.released_pages[static_cast<size_t>(rank)] = n.second;
      }
    }
    if (gate && gate->pool()) {
      run.pool_cap[static_cast<size_t>(rank)] = gate->pool()->cap();
      run.pooled[static_cast<size_t>(rank)] = gate->pool()->pooled_bytes();
    }
    if (err.empty()) {
      run.val_loss[static_cast<size_t>(rank)] = s.evaluate().metrics.at("val_loss");
      if (gate) run.resident_bytes[static_cast<size_t>(rank)] = gate->resident_bytes();
      // Level 3: each unit gathered as the digest reaches it.
      run.digests[static_cast<size_t>(rank)] =
          gate ? s.params_digest([&](const torch::Tensor& t) { gate->before_reading(t); }) : s.params_digest();
      if (gate)
        if (auto st = gate->done_reading(); !st) err = st.message();
      if (gate) {
        const auto n = released();
        EXPECT_EQ(n.first, 0u) << "rank " << rank << ": the digest's gathers left pages resident";
      }
    }
    for (auto& u : units) *u.slot = gate_slot{};
    return err;
  };
  std::vector<std::string> errors;
  if (!how.hosts.empty()) {
    errors = testing::run_on_hosts(
        how.hosts, run.plan.total + 64,
        [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg, const exchange_plan& xp) -> std::string {
          if (!xp.hierarchical) return "not hierarchical";
          if (how.segment_floats > 0 && (!xp.host_gathers || !hosts_cover_every_shard(run.plan, xp.host_groups)))
            return "no gather segment on every host, or a host lacks a shard";
          return body(rank, pg, how.segment_floats > 0 ? gather_route::through(xp.gather, xp.host_members, true) : gather_route::over_group());
        },
        how.segment_floats);
  } else if (how.segment_floats > 0) {
    errors = testing::run_ranks_shm(world, how.segment_floats, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg, std::shared_ptr<shm_group> shm) {
      std::vector<int> all(static_cast<size_t>(world));
      for (int r = 0; r < world; ++r) all[static_cast<size_t>(r)] = r;
      return body(rank, pg, gather_route::through(shm, all, false));
    });
  } else {
    errors = run_ranks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) { return body(rank, pg, gather_route::over_group()); });
  }
  return errors;
}

const std::vector<std::string> three_blocks = {"model.dim=64", "model.layers=3", "model.heads=4"};

// Clipping on (the default 1.0 and a tight 0.01): every rank's whole
// parameters after the steps are zero=2's, bit for bit, and so is every
// rank's evaluation, run through the same gathers; between steps the pages
// of the spans a rank does not hold are given back.
TEST(Zero3, UnitsGatheredAsTheyRunTrainAsZeroTwoBitForBitAndReleaseWhatARankDoesNotHold) {
  for (int world : {2, 3})
    for (const char* clip : {"train.grad_clip=1.0", "train.grad_clip=0.01"}) {
      SCOPED_TRACE("world " + std::to_string(world) + " " + clip);
      std::vector<std::string> o = three_blocks;
      o.push_back(clip);
      // One holder a shard at world 2: each rank lacks half of every span.
      const int replicas = world == 2 ? 1 : 2;
      auto two = run_level(2, o, world, replicas, 4);
      auto three = run_level(3, o, world, replicas, 4);
      for (int r = 0; r < world; ++r) {
        const auto i = static_cast<size_t>(r);
        EXPECT_EQ(three.units[i], 3);
        EXPECT_EQ(three.digests[i], two.digests[0]) << "rank " << r;
        EXPECT_EQ(three.val_loss[i], two.val_loss[0]) << "rank " << r;
        EXPECT_GT(three.released_pages[i], 10u) << "rank " << r << ": the test must see released pages";
        EXPECT_EQ(three.released_resident[i], 0u) << "rank " << r;
        EXPECT_LT(three.resident_bytes[i], 4 * three.plan.total) << "rank " << r;
      }
    }
}

// Every rank of a level-3 run against level 2's: the same parameters and
// evaluation bit for bit, and between steps no page of what it does not
// hold resident (`lacking`: the ranks that must see released pages).
void expect_as_level_two(const level_run& three, const level_run& two, const std::vector<int>& lacking) {
  for (size_t i = 0; i < three.digests.size(); ++i) {
    EXPECT_EQ(three.digests[i], two.digests[0]) << "rank " << i;
    EXPECT_EQ(three.val_loss[i], two.val_loss[0]) << "rank " << i;
    EXPECT_EQ(three.released_resident[i], 0u) << "rank " << i;
  }
  for (int r : lacking) EXPECT_GT(three.released_pages[static_cast<size_t>(r)], 10u) << "rank " << r << ": the test must see released pages";
}
std::vector<int> every_rank(int world) {
  std::vector<int> all(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) all[static_cast<size_t>(r)] = r;
  return all;
}

// Through a shared-memory segment whose slots hold 4,096 floats (a unit
// takes many rounds, when it is needed), and 2^20 (each rank's pieces of
// the next unit published ahead): the same bits, the same release.
TEST(Zero3, UnitsGatheredThroughSharedMemoryTrainAsZeroTwoBitForBit) {
  for (int world : {2, 3}) {
    const int replicas = world == 2 ? 1 : 2;
    auto two = run_level(2, three_blocks, world, replicas, 4);
    for (int64_t floats : {int64_t{4096}, int64_t{1} << 20}) {
      SCOPED_TRACE("world " + std::to_string(world) + ", slots of " + std::to_string(floats) + " floats");
      gather_how how;
      how.segment_floats = floats;
      expect_as_level_two(run_level(3, three_blocks, world, replicas, 4, how), two, every_rank(world));
    }
  }
}

// Through shared memory a rank publishes its pieces of the next unit as
// the current one starts: rank 1 stops right after gathering unit 0, and
// rank 0 still gathers unit 1 (its values the whole model's) without
// waiting for it. Gathered when needed, rank 0 would wait for rank 1 to
// reach unit 1, past the gate's timeout. Then both run the rest alike.
TEST(Zero3, ThroughSharedMemoryTheNextUnitIsPublishedAheadSoARankBehindHoldsNobodyUp) {
  std::vector<std::string> o = three_blocks;
  o.push_back("train.zero=3");
  auto states = make_states(tiny_vit_config(o), 2);
  const auto plan = make_shard_plan(states[0]->optimizer().total_elements(), nodes_of(2), 1);
  std::promise<void> one_at_unit_0, zero_done;
  auto one_waits = zero_done.get_future().share();
  const auto errors = testing::run_ranks_shm(2, int64_t{1} << 20, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg, std::shared_ptr<shm_group> shm) -> std::string {
    auto& s = *states[static_cast<size_t>(rank)];
    flat_adamw& opt = s.optimizer();
    auto layout = unit_layout_of(opt, s.the_task().param_units());
    if (!layout || layout.value().units.size() < 3) return "no three units";
    std::vector<torch::Tensor> unit1;  // its values before any rank lets go of them
    for (const auto& [a, b] : layout.value().units[1])
      for (const auto& v : opt.param_views(a, b)) unit1.push_back(v.clone());
    s.shard_optimizer(plan.ranges_of(rank));
    unit_gatherer gate(pg, opt, plan, layout.value(), std::chrono::milliseconds(4000), {}, gather_route::through(shm, {0, 1}, false),
                       std::chrono::microseconds(50));
    gate.reshard();
    torch::NoGradGuard no_grad;  // a forward without backward: every unit released after it
    gate.before_forward(0);
    if (rank == 1) {
      one_at_unit_0.set_value();
      one_waits.wait();
    } else {
      gate.after_forward(0);
      gate.before_forward(1);
      zero_done.set_value();
      if (auto st = gate.failure(); !st) return "unit 1 with rank 1 held back: " + st.message();
      size_t i = 0;
      for (const auto& [a, b] : gate.layout().units[1])
        for (const auto& v : opt.param_views(a, b))
          if (!torch::equal(v, unit1[i++])) return "unit 1's values are not the model's";
      gate.after_forward(1);
    }
    if (rank == 1) {
      gate.after_forward(0);
      gate.before_forward(1);
      gate.after_forward(1);
    }
    for (int u = 2; u < gate.units(); ++u) {
      gate.before_forward(u);
      gate.after_forward(u);
    }
    if (auto st = gate.after_update(); !st) return st.message();
    return "";
  });
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// A scripted module that is no Sequential but declares its units
// (dtactor_units: a LayerNorm, two entries of a ModuleList, the head; with
// residuals around them; blocks inside a container after two inputs
// summed, trained through a loss method; blocks returning two tensors): each is gathered around its
// calls, over Gloo and through shared memory, and built deferred (loaded
// without its values), and every rank ends where zero=2 ends, bit for bit.
TEST(Zero3, AScriptedModulesDeclaredUnitsAreGatheredAsTheyRunAndTrainAsZeroTwoBitForBit) {
  const auto& fixtures = testing::torchscript_fixtures(DTACTOR_SOURCE_DIR);
  if (!fixtures.error.empty()) SKIP_OR_FAIL_IN_CI(fixtures.error);
  const std::string& d = fixtures.dir;
  for (const auto& [module, world] : std::vector<std::pair<std::string, int>>{
           {"declared.pt", 2}, {"declared.pt", 3}, {"declared_residual.pt", 2}, {"declared_deep.pt", 3}, {"declared_tuple.pt", 2}}) {
    SCOPED_TRACE(module + ", world " + std::to_string(world));
    const std::vector<std::string> o = {"model.name=torchscript", "model.file=" + d + "/" + module, "data.train_inputs=" + d + "/x_train.npy",
                                        "data.train_targets=" + d + "/y_train.npy", "data.eval_inputs=" + d + "/x_eval.npy",
                                        "data.eval_targets=" + d + "/y_eval.npy"};
    const int replicas = world == 2 ? 1 : 2;
    auto two = run_level(2, o, world, replicas, 4);
    const std::vector<int> lacking = world == 2 ? every_rank(world) : std::vector<int>{};
    auto three = run_level(3, o, world, replicas, 4);
    for (int u : three.units) EXPECT_EQ(u, module == "declared_tuple.pt" ? 3 : 4);
    expect_as_level_two(three, two, lacking);
    gather_how how;
    how.segment_floats = 4096;
    expect_as_level_two(run_level(3, o, world, replicas, 4, how), two, lacking);
    // Built deferred, as a rank worker builds it: the module loaded without
    // its values, each rank reading its own shards' from the file.
    gather_how deferred;
    deferred.deferred = true;
    expect_as_level_two(run_level(3, o, world, replicas, 4, deferred), two, lacking);
  }
}

// Blocks built without their values (as a rank worker builds them at
// train.zero = 3: no rank holds the whole model while it starts), each rank
// making only its own shards' initial values: zero=2's bits from a normal
// build, and no page of what a rank does not hold made resident.
TEST(Zero3, UnitsBuiltDeferredMakeEachRanksShardsAndTrainAsZeroTwo) {
  for (int world : {2, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    const int replicas = world == 2 ? 1 : 2;
    auto two = run_level(2, three_blocks, world, replicas, 4);
    gather_how how;
    how.deferred = true;
    expect_as_level_two(run_level(3, three_blocks, world, replicas, 4, how), two, every_rank(world));
  }
}

// Parameters in buffers of their own mappings (a model of tens of MB built
// deferred, as a rank worker builds it): a released unit's pages go to the
// gate's pool (base/page_pool, whole 2 MiB spans) and the next gathers write into them, so a
// gather does not fault its pages in again; the pool keeps the two largest
// units' worth, and what a rank does not hold still reads as no resident
// page between steps. The same bits as level 2, over Gloo and through
// shared memory, in fp32 and in bf16 (where the pooled pages are the
// copies'), with fewer micro-batches on one rank.
TEST(Zero3, ReleasedPagesArePooledForTheNextGathersAndTrainAsZeroTwo) {
  for (const char* precision : {"train.precision=fp32", "train.precision=bf16"})
    for (int64_t segment : {int64_t{0}, int64_t{1} << 16}) {
      SCOPED_TRACE(std::string(precision) + (segment ? " through shared memory" : " over Gloo"));
      // Buffers of a MB or more are mappings of their own (model/flat_adamw),
      // and the pool moves whole page-table spans (2 MiB): half a unit must
      // hold one. In bf16 the copies, 2 bytes a parameter, need the larger model.
      const bool bf16 = std::string(precision) == "train.precision=bf16";
      const std::vector<std::string> o = {bf16 ? "model.dim=768" : "model.dim=512", "model.layers=2", "model.heads=4", precision};
      auto two = run_level(2, o, 2, 1, 3);
      gather_how how;
      how.deferred = true;
      how.segment_floats = segment;
      auto three = run_level(3, o, 2, 1, 3, how);
      expect_as_level_two(three, two, every_rank(2));
      for (int r = 0; r < 2; ++r) {
        const auto i = static_cast<size_t>(r);
        EXPECT_GT(three.pool_cap[i], 0u) << "rank " << r << ": no pool";
        EXPECT_GT(three.pooled[i], 0u) << "rank " << r << ": nothing pooled after the steps";
        EXPECT_LE(three.pooled[i], three.pool_cap[i]) << "rank " << r;
      }
    }
}

// train.precision = bf16: the units are gathered as bf16 copies of their
// holders' masters, so every rank ends bit for bit where level 2 in bf16
// ends (masters, evaluation), over Gloo, and built deferred through shared
// memory; what a rank does not hold, masters and copies, and the copies of
// its own shards are given back between steps, and so are the masters of
// no unit (the root) outside its shards: every rank keeps only the root's
// bf16 copies, gathered from the primaries after each update.
TEST(Zero3, Bf16UnitsTrainAsZeroTwoInBf16BitForBit) {
  std::vector<std::string> bf16 = three_blocks;
  bf16.push_back("train.precision=bf16");
  for (int world : {2, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    const int replicas = world == 2 ? 1 : 2;
    auto two = run_level(2, bf16, world, replicas, 4);
    ASSERT_EQ(two.states[0]->the_task().module()->parameters()[0].scalar_type(), torch::kBFloat16);
    expect_as_level_two(run_level(3, bf16, world, replicas, 4), two, every_rank(world));
    gather_how how;
    how.deferred = true;
    how.segment_floats = 4096;
    expect_as_level_two(run_level(3, bf16, world, replicas, 4, how), two, every_rank(world));
  }
}

// In bf16 what a unit's forward gathers is the bf16 copies from their
// primaries, 2 bytes a parameter: the masters a rank does not hold are
// never written (built deferred: still zeros), and the copies it gathered
// are the primaries' masters rounded to bf16.
TEST(Zero3, Bf16UnitsGatherTheBf16CopiesNotTheMasters) {
  std::vector<std::string> o = three_blocks;
  o.insert(o.end(), {"train.precision=bf16", "train.zero=3"});
  std::vector<std::unique_ptr<training_state>> states;
  {
    defer_block_values defer(true);
    states = make_states(tiny_vit_config(o), 2);
  }
  const shard_plan plan = make_shard_plan(states[0]->optimizer().total_elements(), nodes_of(2), 1);
  for (int r = 0; r < 2; ++r) {
    auto& s = *states[static_cast<size_t>(r)];
    s.shard_optimizer(plan.ranges_of(r));
    ASSERT_TRUE(make_initial_units(s.optimizer(), s.the_task().param_units(), plan.ranges_of(r)).ok());
    s.optimizer().refresh_compute();  // as a forward starts: its own shards' copies
  }
  std::vector<index_spans> lacking(2);
  auto errors = run_ranks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
    auto& s = *states[static_cast<size_t>(rank)];
    flat_adamw& opt = s.optimizer();
    auto layout = unit_layout_of(opt, s.the_task().param_units());
    if (!layout) return layout.message();
    lacking[static_cast<size_t>(rank)] = spans_outside(layout->units[0], plan.ranges_of(rank));
    unit_gatherer gate(pg, opt, plan, std::move(layout.value()), std::chrono::milliseconds(20000), {});
    gate.before_forward(0);
    gate.after_forward(0);
    gate.before_forward(0);  // gathered again: still the copies
    return gate.failure().ok() ? "" : gate.failure().message();
  });
  for (int r = 0; r < 2; ++r) ASSERT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
  for (int r = 0; r < 2; ++r) {
    const auto& mine = states[static_cast<size_t>(r)]->optimizer();
    const auto& theirs = states[static_cast<size_t>(1 - r)]->optimizer();
    int64_t checked = 0;
    for (const auto& [a, b] : lacking[static_cast<size_t>(r)]) {
      const auto masters = mine.param_views(a, b), copies = mine.compute_views(a, b), source = theirs.param_views(a, b);
      for (size_t i = 0; i < masters.size(); ++i) {
        EXPECT_TRUE(masters[i].eq(0).all().item<bool>()) << "rank " << r << " wrote masters it does not hold";
        EXPECT_TRUE(torch::equal(copies[i], source[i].to(torch::kBFloat16))) << "rank " << r;
        checked += masters[i].numel();
      }
    }
    EXPECT_GT(checked, 100) << "rank " << r << " lacks part of unit 0";
  }
}

// Two hosts of two ranks, each host holding every shard (two holders a
// shard, on different hosts): each host's ranks gather the units through a
// segment of their own, so no parameter byte crosses hosts. The same bits
// as zero=2 over the same plan, and the same release; a host of one rank
// (three ranks: the lone one holds every shard) gathers nothing.
TEST(Zero3, UnitsGatheredWithinEachHostWhenEveryHostHoldsEveryShard) {
  for (const std::vector<std::string>& hosts : {std::vector<std::string>{"a", "a", "b", "b"}, std::vector<std::string>{"a", "a", "b"}}) {
    const int world = static_cast<int>(hosts.size());
    SCOPED_TRACE("world " + std::to_string(world));
    gather_how over_hosts;
    over_hosts.hosts = hosts;
    auto two = run_level(2, three_blocks, world, 2, 4, over_hosts);
    for (int64_t floats : {int64_t{4096}, int64_t{1} << 20}) {  // in rounds when needed; published ahead
      SCOPED_TRACE("slots of " + std::to_string(floats) + " floats");
      gather_how within = over_hosts;
      within.segment_floats = floats;
      auto three = run_level(3, three_blocks, world, 2, 4, within);
      // Ranks 0 and 1 (host a) each lack what the other holds; host b's
      // lone rank at world 3 holds every shard.
      expect_as_level_two(three, two, {0, 1});
      if (world == 3) {
        EXPECT_EQ(three.released_pages[2], 0u);
      }
    }
  }
}

// Activation checkpointing and bf16 autocast: a block's backward recomputes
// its forward with the parameters the output's gate gathered again, and
// autocast's bf16 copies are made while a unit is gathered. Bit for bit.
TEST(Zero3, CheckpointedAndAutocastBlocksTrainAsZeroTwoBitForBit) {
  for (const char* extra : {"train.activation_checkpointing=true", "train.bf16=true"}) {
    SCOPED_TRACE(extra);
    std::vector<std::string> o = three_blocks;
    o.push_back(extra);
    auto two = run_level(2, o, 2, 1, 3);
    auto three = run_level(3, o, 2, 1, 3);
    for (int r = 0; r < 2; ++r) EXPECT_EQ(three.digests[static_cast<size_t>(r)], two.digests[0]) << "rank " << r;
  }
}

// Slices of 8, 8, 7 and 7 samples in micro-batches of 7: two passes on
// ranks 0 and 1, one on ranks 2 and 3, whose gathers make up the second
// (the broadcasts must match, or the step would hang or mix units up).
TEST(Zero3, RanksWithFewerMicroBatchesMakeUpTheGathersAndStillMatchZeroTwo) {
  std::vector<std::string> o = three_blocks;
  o.push_back("train.global_batch_size=30");
  o.push_back("train.micro_batch_size=7");
  auto two = run_level(2, o, 4, 2, 3);
  auto three = run_level(3, o, 4, 2, 3);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(three.digests[static_cast<size_t>(r)], two.digests[0]) << "rank " << r;
}

TEST(Zero3, UnitLayoutPutsEveryParameterInOneUnitOrTheRoot) {
  auto states = make_states(tiny_vit_config(three_blocks), 1);
  auto& s = *states[0];
  auto units = s.the_task().param_units();
  ASSERT_EQ(units.size(), 3u);
  auto layout = unit_layout_of(s.optimizer(), units);
  ASSERT_TRUE(layout) << layout.message();
  int64_t in_units = 0, root = 0;
  for (const auto& spans : layout->units)
    for (const auto& [a, b] : spans) in_units += b - a;
  for (const auto& [a, b] : layout->root) root += b - a;
  int64_t block_params = 0;
  for (const auto& u : units)
    for (const auto& p : u.params) block_params += p.numel();
  EXPECT_EQ(in_units, block_params);
  EXPECT_EQ(in_units + root, s.optimizer().total_elements());
  EXPECT_GT(root, 0) << "the patch embedding, class token, positions, final norm and head";
  // A parameter in two units is refused.
  units[1].params.push_back(units[0].params.front());
  EXPECT_FALSE(unit_layout_of(s.optimizer(), units));
}

// A resume at train.zero = 3: the replicated part that global rank 0 reads
// (and sends to all) holds no parameter, and each rank then reads only its
// own shards' parameters, so no rank makes the whole model resident. The
// values read are the checkpoint's, as a whole load gives them.
TEST(Zero3, AResumeReadsNoParameterWithTheReplicatedPartAndEachRankItsOwnShards) {
  temp_dir d;
  std::vector<std::string> o = three_blocks;
  o.insert(o.end(), {"train.max_steps=6", "checkpoint.every_steps=6"});
  train_options t;
  t.run_dir = d.path();
  t.interactive = false;
  auto trained = run_training(tiny_vit_config(o), t);
  ASSERT_TRUE(trained) << trained.message();
  auto ckpt = open_checkpoint_target(d.path(), {});
  ASSERT_TRUE(ckpt) << ckpt.message();
  ASSERT_EQ(ckpt->meta.step(), 6);
  auto whole = make_states(tiny_vit_config(three_blocks), 1);
  ASSERT_TRUE(load_checkpoint(*whole[0], *ckpt->store, ckpt->meta).ok());
  o = three_blocks;
  o.push_back("train.zero=3");
  std::vector<std::unique_ptr<training_state>> states;
  {
    defer_block_values defer(true);
    states = make_states(tiny_vit_config(o), 1);
  }
  auto& s = *states[0];
  flat_adamw& opt = s.optimizer();
  const int64_t total = opt.total_elements(), half = total / 2;
  // Its parameters as built (the blocks' deferred: zeros), against which
  // a range is "not read"; they differ from the checkpoint's everywhere.
  auto flat = [](const std::vector<torch::Tensor>& views) {
    std::vector<torch::Tensor> v;
    for (const auto& t : views) v.push_back(t.detach().reshape({-1}).clone());
    return torch::cat(v);
  };
  const torch::Tensor built = flat(opt.param_views(0, total)), saved = flat(whole[0]->optimizer().param_views(0, total));
  ASSERT_FALSE(torch::equal(built.slice(0, half), saved.slice(0, half)));
  // As a fresh rank holds it: all of it, sharded.
  s.shard_optimizer({{0, total}});
  ASSERT_TRUE(load_checkpoint(s, *ckpt->store, ckpt->meta, load_which::replicated).ok());
  EXPECT_EQ(s.step(), 6);
  EXPECT_TRUE(torch::equal(flat(opt.param_views(0, total)), built)) << "the replicated part wrote parameters";
  // This rank's shards: the first half.
  s.shard_optimizer({{0, half}});
  uint64_t read = 0;
  ASSERT_TRUE(load_checkpoint(s, *ckpt->store, ckpt->meta, load_which::shards, &read).ok());
  EXPECT_GT(read, 0u);
  EXPECT_TRUE(torch::equal(flat(opt.param_views(0, half)), saved.slice(0, 0, half))) << "this rank's shards are not the checkpoint's";
  EXPECT_TRUE(torch::equal(flat(opt.param_views(half, total)), built.slice(0, half))) << "another rank's shards were read";
}

// Ranks 0 and 1 of `run` as the next generation's group under `plan`
// (rank 2 is gone): with `finish`, finish_interrupted_step first (else a
// rank drops what it kept), then the reshard, the parameters of no unit
// broadcast from their holders as the rank worker does at zero = 3.
// Returns whether each finished a step; `missing`: the reshard's verdict.
std::vector<int> next_generation(level_run& run, const shard_plan& plan, bool finish, std::vector<std::string>* missing) {
  run.states.resize(2);
  run.plan = plan;
  std::vector<int> finished(2, 0);
  missing->assign(2, "");
  const auto errors = run_ranks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
    auto& s = *run.states[static_cast<size_t>(rank)];
    if (auto e = testing::finish_or_drop(*pg, s, finish, &finished[static_cast<size_t>(rank)]); !e.empty()) return e;
    auto layout = unit_layout_of(s.optimizer(), s.the_task().param_units());
    if (!layout) return layout.message();
    const bool current = s.step() == std::max(run.states[0]->step(), run.states[1]->step());
    auto r = reshard_optimizer(*pg, s.optimizer(), plan, current, s.params_mixed(), std::chrono::milliseconds(20000), {}, &layout->root);
    if (!r) return r.message();
    (*missing)[static_cast<size_t>(rank)] = r->complete ? "" : r->missing;
    if (r->complete) s.clear_params_mixed();
    return "";
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
  return finished;
}

// The interrupted-step rule of zero = 2 at zero = 3, where the parameters
// live only with their shards' holders: a rank whose norm allreduce failed
// while the others completed it and stepped keeps its gradient shards; with
// the one other holder of a shard lost, dropping the step would lose that
// shard (parameters and moments). The lagging rank finishes the step, the
// survivors reshard completely, and they train on to the uninterrupted
// run's parameters and evaluation, bit for bit, every unit gathered.
TEST(Zero3, AStepInterruptedOnOneRankIsFinishedThereAndNoShardIsLost) {
  const int steps = 2;
  auto make = [] {
    level_run run;
    std::vector<std::string> o = three_blocks;
    o.push_back("train.zero=3");
    run.states = make_states(tiny_vit_config(o), 3);
    run.plan = make_shard_plan(run.states[0]->optimizer().total_elements(), nodes_of(3), 2);
    for (int r = 0; r < 3; ++r) run.states[static_cast<size_t>(r)]->shard_optimizer(run.plan.ranges_of(r));
    return run;
  };
  auto expect_no_errors = [](const std::vector<std::string>& errors) {
    for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  };
  level_run ref = make(), cut = make(), dropped = make();
  const shard_plan plan3 = ref.plan;
  const shard_plan plan2 = make_shard_plan(plan3.total, nodes_of(2), 2);
  // Shard 1 is held by ranks 1 and 2: with rank 2 lost, rank 1 is its only holder.
  ASSERT_EQ(plan3.shards[1].holders, (std::vector<int>{1, 2}));
  expect_no_errors(train_run(ref, 3, steps + 1, {}));
  gather_how interrupt;
  interrupt.wrap_sync = [](int rank, std::unique_ptr<param_sync> real) -> std::unique_ptr<param_sync> {
    return std::make_unique<interrupted_sync>(std::move(real), rank == 1);
  };
  for (level_run* v : {&cut, &dropped}) {
    expect_no_errors(train_run(*v, 3, steps, {}));
    const auto errors = train_run(*v, 3, 1, interrupt);
    for (int r = 0; r < 3; ++r) EXPECT_FALSE(errors[static_cast<size_t>(r)].empty()) << "rank " << r;
    EXPECT_EQ(v->states[0]->step(), steps + 1);
    EXPECT_EQ(v->states[1]->step(), steps);
    EXPECT_EQ(v->states[2]->step(), steps + 1);
    EXPECT_TRUE(v->states[1]->has_interrupted_step());
  }
  std::vector<std::string> missing;
  next_generation(dropped, plan2, false, &missing);
  EXPECT_NE(missing[0].find("[" + std::to_string(plan3.shards[1].begin) + ", "), std::string::npos) << missing[0];
  EXPECT_EQ(next_generation(cut, plan2, true, &missing), (std::vector<int>{0, 1}));
  EXPECT_EQ(missing, (std::vector<std::string>{"", ""}));
  EXPECT_EQ(cut.states[1]->step(), steps + 1);
  EXPECT_FALSE(cut.states[1]->has_interrupted_step());
  next_generation(ref, plan2, true, &missing);
  EXPECT_EQ(missing, (std::vector<std::string>{"", ""}));
  expect_no_errors(train_run(ref, 3, 2, {}));
  expect_no_errors(train_run(cut, 3, 2, {}));
  for (int r = 0; r < 2; ++r) {
    const auto i = static_cast<size_t>(r);
    EXPECT_EQ(cut.units[i], 3);
    EXPECT_EQ(cut.digests[i], ref.digests[0]) << "rank " << r;
    EXPECT_EQ(cut.val_loss[i], ref.val_loss[0]) << "rank " << r;
  }
  // The sharded state too (moments, the parameters' windows): each
  // survivor's equals the reference's.
  for (int r = 0; r < 2; ++r) {
    auto a = ref.states[static_cast<size_t>(r)]->state_tensors(), b = cut.states[static_cast<size_t>(r)]->state_tensors();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      if (a[i].sharded) {
        EXPECT_TRUE(torch::equal(a[i].t, b[i].t)) << a[i].name << " rank " << r;
      }
    }
  }
}

TEST(Zero3, SpansOutsideTheHeldOnes) {
  EXPECT_EQ(spans_outside({{0, 10}, {20, 30}}, {{5, 25}}), (index_spans{{0, 5}, {25, 30}}));
  EXPECT_EQ(spans_outside({{0, 10}}, {}), (index_spans{{0, 10}}));
  EXPECT_EQ(spans_outside({{0, 10}}, {{0, 10}}), index_spans{});
  EXPECT_EQ(spans_outside({{0, 10}}, {{2, 3}, {5, 6}}), (index_spans{{0, 2}, {3, 5}, {6, 10}}));
}

}  // namespace
}  // namespace dtactor
