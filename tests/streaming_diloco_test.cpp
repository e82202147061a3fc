// Streaming DiLoCo (model/diloco.hpp: train.sync_fragments,
// train.sync_overlap, train.sync_mix): how the parameters are cut into
// fragments, when each synchronises, the overlapped exchange landing tau
// inner steps later with the merge, against the formula computed here by
// hand from workers trained alone; the job ending on the global
// parameters; what a new generation does with an exchange in flight; the
// refusals. Ranks are threads over Gloo.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>

#include "model/diloco.hpp"
#include "model/trainer.hpp"
#include "rank_threads.hpp"
#include "comm/grad_sync.hpp"
#include "test_util.hpp"

namespace dtactor {
namespace {

using testing::make_states;
using testing::run_ranks;
using testing::tiny_vit_config;

config streaming_config(int every, int fragments, std::vector<std::string> extra = {}) {
  extra.insert(extra.end(), {"train.sync=diloco", "train.sync_every=" + std::to_string(every), "train.sync_fragments=" + std::to_string(fragments)});
  return tiny_vit_config(extra);
}

TEST(StreamingDiLoCo, FragmentsAreConsecutiveParametersOfAboutEqualSize) {
  using cuts = std::vector<std::pair<size_t, size_t>>;
  EXPECT_EQ(cut_fragments({10, 10, 10, 10}, 2), (cuts{{0, 2}, {2, 2}}));
  EXPECT_EQ(cut_fragments({10, 10, 10, 10}, 4), (cuts{{0, 1}, {1, 1}, {2, 1}, {3, 1}}));
  // One big parameter fills its fragment alone; every fragment gets one.
  EXPECT_EQ(cut_fragments({100, 1, 1, 1}, 3), (cuts{{0, 1}, {1, 1}, {2, 2}}));
  EXPECT_EQ(cut_fragments({1, 1, 1, 100}, 2), (cuts{{0, 3}, {3, 1}}));
  EXPECT_EQ(cut_fragments({5}, 1), (cuts{{0, 1}}));
  EXPECT_TRUE(cut_fragments({5, 5}, 3).empty());
}

// The fragments of a model cover each element of the flat buffers once,
// and the sizes are balanced within one parameter.
TEST(StreamingDiLoCo, FragmentsCoverEveryParameterElementOnce) {
  auto s = make_states(streaming_config(12, 3), 1);
  const auto& o = s[0]->outer();
  ASSERT_EQ(o.fragments().size(), 3u);
  auto flat = s[0]->optimizer().flat_params();
  std::vector<torch::Tensor> seen;
  for (auto& t : flat) seen.push_back(torch::zeros(t.numel(), torch::kInt32));
  int64_t total = 0, biggest_param = 0;
  size_t next_param = 0;
  for (const auto& fr : o.fragments()) {
    EXPECT_EQ(fr.first_param, next_param);
    next_param += fr.params;
    for (const auto& [g, off, len] : fr.ranges) seen[g].narrow(0, off, len).add_(1);
    total += fr.elements;
  }
  for (auto& p : s[0]->the_task().module()->parameters()) biggest_param = std::max(biggest_param, p.numel());
  for (auto& t : seen) EXPECT_TRUE(torch::all(t == 1).item<bool>());
  EXPECT_EQ(total, s[0]->optimizer().total_elements());
  for (const auto& fr : o.fragments()) EXPECT_LE(std::abs(fr.elements - total / 3), biggest_param) << fr.elements << " of " << total;
  // Offsets staggered over the window: 4, 8, 12.
  EXPECT_EQ(o.fragments()[0].offset, 4);
  EXPECT_EQ(o.fragments()[1].offset, 8);
  EXPECT_EQ(o.fragments()[2].offset, 12);
}

// The schedule (a world of one, no overlap): fragment f at (f+1)*H/F + k*H,
// each at its own step, and all of them at the last step.
TEST(StreamingDiLoCo, FragmentsSynchroniseAtStaggeredStepsAndAllAtTheEnd) {
  auto s = make_states(streaming_config(6, 3, {"train.max_steps=13", "train.sync_overlap=0"}), 1);
  auto& o = s[0]->outer();
  EXPECT_TRUE(o.streaming());
  std::vector<std::vector<size_t>> due_at(14);
  for (int64_t step = 0; step <= 13; ++step) due_at[static_cast<size_t>(step)] = o.due_fragments(step);
  // Before anything ran: what is due at a step is every scheduled sync up to it.
  EXPECT_TRUE(due_at[1].empty());
  EXPECT_EQ(due_at[2], (std::vector<size_t>{0}));
  EXPECT_EQ(due_at[4], (std::vector<size_t>{0, 1}));
  EXPECT_EQ(o.boundary_after(2), 4);
  EXPECT_EQ(o.boundary_after(6), 8);
  EXPECT_EQ(o.boundary_after(12), 13);
  std::vector<std::pair<int64_t, std::vector<int64_t>>> anchors;
  while (s[0]->step() < 13) {
    testing::train_alone(*s[0]);
    anchors.push_back({s[0]->step(), {o.fragment_anchor(0), o.fragment_anchor(1), o.fragment_anchor(2)}});
  }
  auto at = [&](int64_t step) { return anchors[static_cast<size_t>(step - 1)].second; };
  EXPECT_EQ(at(1), (std::vector<int64_t>{0, 0, 0}));
  EXPECT_EQ(at(2), (std::vector<int64_t>{2, 0, 0}));
  EXPECT_EQ(at(4), (std::vector<int64_t>{2, 4, 0}));
  EXPECT_EQ(at(6), (std::vector<int64_t>{2, 4, 6}));
  EXPECT_EQ(at(8), (std::vector<int64_t>{8, 4, 6}));
  EXPECT_EQ(at(12), (std::vector<int64_t>{8, 10, 12}));
  EXPECT_EQ(at(13), (std::vector<int64_t>{13, 13, 13}));
  EXPECT_EQ(o.anchor(), 13);
}

// A rank's streaming loop as the rank worker runs it: an inner step unless
// something of DiLoCo's is due, the flight landing, the due fragments
// leaving (overlapped when alone), until `until`.
using reducers = std::vector<std::unique_ptr<grad_sync>>;
// One reducer a fragment, over `pg`, as the rank worker builds them.
reducers fragment_reducers(training_state& s, c10::intrusive_ptr<c10d::ProcessGroup> pg, std::shared_ptr<shm_group> shm = nullptr) {
  grad_sync_options go;
  go.bucket_bytes = 16 * 1024;
  go.carry_control = true;
  go.exchange.transport = exchange_transport::shared_memory;
  go.shm = std::move(shm);
  std::vector<torch::Tensor> trained;
  for (auto& p : s.the_task().module()->parameters())
    if (p.requires_grad()) trained.push_back(p);
  reducers syncs;
  for (const auto& fr : s.outer().fragments())
    syncs.push_back(std::make_unique<grad_sync>(
        std::vector<torch::Tensor>(trained.begin() + static_cast<std::ptrdiff_t>(fr.first_param), trained.begin() + static_cast<std::ptrdiff_t>(fr.first_param + fr.params)),
        pg, go));
  return syncs;
}

std::string run_streaming(training_state& s, int rank, int world, reducers& syncs, int64_t until) {
  const int64_t max_steps = s.outer().options().max_steps;
  while (s.step() < until) {
    auto& o = s.outer();
    if (!o.due(s.step()) && !o.lands(s.step())) {
      auto r = s.train_step(step_context::diloco_inner(rank, world));
      if (!r) return r.message();
    }
    std::string wrong;
    auto st = o.after_inner_step(
        s.step(), max_steps, [&syncs](size_t f) -> grad_sync& { return *syncs[f]; }, std::nullopt, [&](const outer_step_result& l) {
          if (!l.landed && (o.options().overlap == 0 || s.step() >= max_steps)) wrong = "fragment " + std::to_string(l.fragment) + " stayed in flight";
        });
    if (!st) return st.message();
    if (!wrong.empty()) return wrong;
  }
  return "";
}

torch::Tensor slice_of(const std::vector<torch::Tensor>& flat, const outer_fragment& fr) {
  std::vector<torch::Tensor> parts;
  for (const auto& [g, off, len] : fr.ranges) parts.push_back(flat[g].narrow(0, off, len).clone());
  return torch::cat(parts);
}

// Two workers, two fragments, H = 8, overlap 1, mix 0.5: fragment 0's
// pseudo-gradients leave at step 4 and land at step 5, after each worker's
// fifth inner step. By hand: global_0 = start - lr * (1 + mu) * avg(start -
// local@4) (the first Nesterov step), local_0 = mix * local@5 + (1 - mix) *
// global_0; fragment 1 is each worker's own local@5. The inner step that
// ran while the exchange was in flight saw none of the pseudo-gradient.
TEST(StreamingDiLoCo, OverlappedExchangeLandsLaterAndMixesWithTheLocalParameters) {
  const int world = 2;
  const double lr = 0.7, mu = 0.9, mix = 0.5;
  const auto cfg = streaming_config(8, 2, {"train.sync_overlap=1", "train.sync_mix=0.5"});
  auto alone = make_states(cfg, world);
  auto dp = make_states(cfg, world);
  const auto& frags = dp[0]->outer().fragments();
  ASSERT_EQ(frags.size(), 2u);
  const auto start = dp[0]->optimizer().flat_params();
  std::vector<torch::Tensor> at4(world), at5_f0(world), at5_f1(world);
  for (int r = 0; r < world; ++r) {
    auto& a = *alone[static_cast<size_t>(r)];
    for (int i = 0; i < 4; ++i) ASSERT_TRUE(a.train_step(step_context::diloco_inner(r, world)).ok());
    at4[r] = slice_of(a.optimizer().flat_params(), frags[0]);
    ASSERT_TRUE(a.train_step(step_context::diloco_inner(r, world)).ok());
    at5_f0[r] = slice_of(a.optimizer().flat_params(), frags[0]);
    at5_f1[r] = slice_of(a.optimizer().flat_params(), frags[1]);
  }
  const auto s0 = slice_of(start, frags[0]);
  const auto avg = ((s0 - at4[0]) + (s0 - at4[1])) / 2.0;
  const auto global0 = s0 - lr * (1 + mu) * avg;

  auto errors = run_ranks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto& s = *dp[static_cast<size_t>(rank)];
    auto syncs = fragment_reducers(s, pg);
    if (auto e = run_streaming(s, rank, world, syncs, 4); !e.empty()) return e;
    if (!s.outer().in_flight() || *s.outer().in_flight() != 0) return std::string("fragment 0 is not in flight after step 4");
    return run_streaming(s, rank, world, syncs, 5);
  });
  for (int r = 0; r < world; ++r) ASSERT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
  for (int r = 0; r < world; ++r) {
    auto& s = *dp[static_cast<size_t>(r)];
    EXPECT_FALSE(s.outer().in_flight());
    EXPECT_EQ(s.outer().anchor(), 5);
    EXPECT_EQ(s.outer().fragment_anchor(0), 4);
    EXPECT_EQ(s.outer().fragment_anchor(1), 0);
    const auto flat = s.optimizer().flat_params();
    const auto want0 = mix * at5_f0[r] + (1 - mix) * global0;
    const auto got0 = slice_of(flat, frags[0]);
    EXPECT_TRUE(torch::allclose(got0, want0, 1e-5, 1e-6)) << "rank " << r << ": " << (got0 - want0).abs().max().item<double>();
    // Fragment 1 was not exchanged: the worker's own, exactly.
    EXPECT_TRUE(torch::equal(slice_of(flat, frags[1]), at5_f1[r])) << "rank " << r;
  }
  // The two workers' fragment 0 differs (each mixed its own local part).
  EXPECT_FALSE(torch::equal(slice_of(dp[0]->optimizer().flat_params(), frags[0]), slice_of(dp[1]->optimizer().flat_params(), frags[0])));
}

// A whole job of two workers with four fragments: every exchange lands,
// both end on the same parameters, which are the global ones; the
// evaluation and the digest see the global parameters mid-run.
TEST(StreamingDiLoCo, WorkersEndOnTheGlobalParameters) {
  const int world = 2;
  const auto cfg = streaming_config(8, 4, {"train.max_steps=30"});
  auto dp = make_states(cfg, world);
  auto errors = run_ranks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto& s = *dp[static_cast<size_t>(rank)];
    // Mid-run (after fragment 1 landed at step 5): the workers' own
    // parameters differ, the global ones (digest) do not.
    auto syncs = fragment_reducers(s, pg);
    return run_streaming(s, rank, world, syncs, 5);
  });
  for (int r = 0; r < world; ++r) ASSERT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
  EXPECT_FALSE(torch::equal(dp[0]->optimizer().flat_params()[0], dp[1]->optimizer().flat_params()[0]));
  EXPECT_EQ(dp[0]->params_digest(), dp[1]->params_digest());
  const auto local_before = dp[0]->optimizer().flat_params()[0].clone();
  EXPECT_EQ(dp[0]->evaluate().metrics.count("accuracy"), 1u);
  EXPECT_TRUE(torch::equal(dp[0]->optimizer().flat_params()[0], local_before)) << "the evaluation left the global parameters in place";
  errors = run_ranks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto& s = *dp[static_cast<size_t>(rank)];
    auto syncs = fragment_reducers(s, pg);
    return run_streaming(s, rank, world, syncs, 30);
  });
  for (int r = 0; r < world; ++r) ASSERT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
  for (int r = 0; r < world; ++r) {
    auto& s = *dp[static_cast<size_t>(r)];
    EXPECT_FALSE(s.outer().due(30));
    EXPECT_FALSE(s.outer().in_flight());
    for (size_t f = 0; f < 4; ++f) EXPECT_EQ(s.outer().fragment_anchor(f), 30);
  }
  const auto a = dp[0]->optimizer().flat_params(), b = dp[1]->optimizer().flat_params();
  for (size_t g = 0; g < a.size(); ++g) EXPECT_TRUE(torch::equal(a[g], b[g])) << "group " << g;
  // Local = global at the end: swapping them changes nothing.
  const auto before = a[0].clone();
  dp[0]->outer().swap_global();
  EXPECT_TRUE(torch::equal(dp[0]->optimizer().flat_params()[0], before));
  dp[0]->outer().swap_global();
}

// The fragments' reducers take turns on one shared-memory segment (it
// keeps the step counts of every exchange over it): a whole job of two
// workers, four fragments, overlapped, ends on the parameters of the same
// job over Gloo, bit for bit (a sum of two floats is the same in any order).
TEST(StreamingDiLoCo, FragmentsTakeTurnsOnOneSharedMemorySegment) {
  const int world = 2;
  const auto cfg = streaming_config(8, 4, {"train.max_steps=30"});
  auto gloo = make_states(cfg, world);
  auto shm = make_states(cfg, world);
  int64_t floats = step_control::words;
  for (auto& p : gloo[0]->the_task().module()->parameters()) floats += p.numel();
  auto e1 = run_ranks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    auto& s = *gloo[static_cast<size_t>(rank)];
    auto syncs = fragment_reducers(s, pg);
    return run_streaming(s, rank, world, syncs, 30);
  });
  auto e2 = testing::run_ranks_shm(world, floats, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg, std::shared_ptr<shm_group> g) {
    auto& s = *shm[static_cast<size_t>(rank)];
    auto syncs = fragment_reducers(s, pg, g);
    for (const auto& x : syncs)
      if (!x->uses_shm()) return std::string("a fragment's reducer is not on the segment");
    return run_streaming(s, rank, world, syncs, 30);
  });
  for (int r = 0; r < world; ++r) {
    ASSERT_EQ(e1[static_cast<size_t>(r)], "") << "rank " << r;
    ASSERT_EQ(e2[static_cast<size_t>(r)], "") << "rank " << r;
  }
  for (int r = 0; r < world; ++r) {
    const auto a = gloo[static_cast<size_t>(r)]->optimizer().flat_params(), b = shm[static_cast<size_t>(r)]->optimizer().flat_params();
    for (size_t g = 0; g < a.size(); ++g) EXPECT_TRUE(torch::equal(a[g], b[g])) << "rank " << r << " group " << g;
  }
}

// A new generation drops an exchange in flight: nothing of it was applied,
// and its fragment is due again at once.
TEST(StreamingDiLoCo, ADroppedFlightLeavesItsFragmentDue) {
  auto s = make_states(streaming_config(8, 2, {"train.sync_overlap=2"}), 1);
  auto& o = s[0]->outer();
  for (int i = 0; i < 4; ++i) testing::train_alone(*s[0]);
  ASSERT_TRUE(o.in_flight());
  EXPECT_EQ(*o.in_flight(), 0u);
  EXPECT_FALSE(o.lands(5));
  EXPECT_TRUE(o.lands(6));
  const auto before = o.state_tensors();
  o.drop_flight();
  EXPECT_EQ(o.due_fragments(4), (std::vector<size_t>{0}));
  EXPECT_EQ(o.anchor(), 0);
  EXPECT_EQ(o.fragment_anchor(0), 0);
  // The state names the fragments' anchors.
  bool named = false;
  for (const auto& st : before) named = named || st.name == "outer/fragment_anchors";
  EXPECT_TRUE(named);
}

TEST(StreamingDiLoCo, BadSettingsAreRefusedInOneLine) {
  auto refused = [](std::vector<std::string> sets, const std::string& want) {
    auto c = config::load("", sets);
    if (!c) return c.message().find(want) != std::string::npos && c.message().find('\n') == std::string::npos ? std::string() : c.message();
    auto s = training_state::create(c.value());
    if (s) return std::string("accepted");
    return s.message().find(want) != std::string::npos && s.message().find('\n') == std::string::npos ? std::string() : s.message();
  };
  EXPECT_EQ(refused({"train.sync_fragments=2"}, "Streaming DiLoCo"), "");
  EXPECT_EQ(refused({"train.sync=diloco", "train.sync_every=4", "train.sync_fragments=5"}, "cannot exceed train.sync_every"), "");
  EXPECT_EQ(refused({"train.sync=diloco", "train.sync_every=8", "train.sync_fragments=4", "train.sync_overlap=2"}, "must stay below"), "");
  EXPECT_EQ(refused({"train.sync=diloco", "train.sync_every=8", "train.sync_overlap=1", "train.sync_mix=1.5"}, "train.sync_mix"), "");
  EXPECT_EQ(refused({"model.dim=16", "model.layers=1", "model.heads=2", "train.sync=diloco", "train.sync_every=1000", "train.sync_fragments=500"},
                    "parameter tensors"),
            "");
}

}  // namespace
}  // namespace dtactor

namespace dtactor {
namespace {

using testing::make_states;
using testing::run_on_hosts;
using testing::tiny_vit_config;

// train.diloco_worker = host, 2 hosts x 2 ranks (threads on "hosts" named
// by keys), H = 3: each host's ranks sum their gradients every inner step
// through the host's segment, so they stay bit for bit equal while the two
// hosts go apart; each host trains as one process would on the union of
// its ranks' slices (checked against that, by hand); at the boundary the
// hierarchical exchange (the same segment, taking turns) sums the four
// ranks' pseudo-gradients, a host's counted once per rank, and every rank
// ends on global = start - lr (1 + mu) avg.
TEST(DiLoCoHostWorkers, HostRanksStaySynchronousAndHostsMeetAtTheBoundary) {
  const int world = 4, every = 3;
  const double lr = 0.7, mu = 0.9;
  const auto cfg = tiny_vit_config({"train.sync=diloco", "train.sync_every=3", "train.diloco_worker=host", "cluster.bucket_kb=4"});
  auto states = make_states(cfg, world + 2);
  std::vector<torch::Tensor> start;
  for (auto& t : states[0]->optimizer().flat_params()) start.push_back(t.clone());
  int64_t floats = step_control::words;
  for (auto& p : states[0]->the_task().module()->parameters()) floats += p.numel();
  // By hand: one process per host on the union of its ranks' slices.
  std::vector<std::vector<torch::Tensor>> want_host(2), want_grads(2);
  for (int h = 0; h < 2; ++h) {
    auto& ref = *states[static_cast<size_t>(world + h)];
    {
      // Step 0's gradient: the mean loss of the host's samples.
      auto a = ref.order().rank_slice(0, 2 * h, world), b = ref.order().rank_slice(0, 2 * h + 1, world);
      a.insert(a.end(), b.begin(), b.end());
      ref.forward_backward(a, 0, 2 * h, nullptr, static_cast<double>(a.size()));
      for (auto& g : ref.gradients()) want_grads[static_cast<size_t>(h)].push_back(g.clone());
      ref.zero_grad();
    }
    for (int step = 0; step < every; ++step) {
      auto a = ref.order().rank_slice(step, 2 * h, world), b = ref.order().rank_slice(step, 2 * h + 1, world);
      a.insert(a.end(), b.begin(), b.end());
      ref.forward_backward(a, step, 2 * h, nullptr, static_cast<double>(a.size()));
      ref.apply_update();
    }
    for (auto& t : ref.optimizer().flat_params()) want_host[static_cast<size_t>(h)].push_back(t.clone());
  }
  std::vector<std::vector<torch::Tensor>> at_boundary(world);
  auto errors = run_on_hosts({"h0", "h0", "h1", "h1"}, floats, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg, const exchange_plan& p) {
    auto& s = *states[static_cast<size_t>(rank)];
    if (!p.hierarchical || p.host_members.size() != 2) return std::string("not 2 hosts of 2");
    grad_sync_options ho;
    ho.bucket_bytes = 4 * 1024;
    ho.exchange.transport = exchange_transport::host;
    ho.shm = p.shm;
    grad_sync host(s.the_task().module()->parameters(), c10::intrusive_ptr<c10d::ProcessGroup>(), ho);
    if (host.world() != 2 || !host.uses_shm()) return std::string("the host reducer is not the host's segment");
    grad_sync_options oo;
    oo.bucket_bytes = 4 * 1024;
    oo.exchange.transport = exchange_transport::hierarchical;
    oo.shm = p.shm;
    oo.hosts = p.hosts;
    oo.carry_control = true;
    grad_sync outer(s.the_task().module()->parameters(), pg, oo);
    if (!outer.hierarchical()) return std::string("the outer exchange is not hierarchical");
    {
      // Step 0's gradient summed over the host (not applied).
      s.zero_grad();
      size_t n = 0;
      for (int r : p.host_members) n += s.order().rank_slice(0, r, world).size();
      s.forward_backward(s.order().rank_slice(0, rank, world), 0, rank, &host, static_cast<double>(n));
      if (auto t = host.finish(); !t) return t.message();
      const auto got = s.gradients();
      const auto& want = want_grads[static_cast<size_t>(rank / 2)];
      for (size_t i = 0; i < got.size(); ++i)
        if (!torch::allclose(got[i], want[i], 1e-4, 1e-7))
          return "step 0's host gradient of parameter " + std::to_string(i) + " is off by " + std::to_string((got[i] - want[i]).abs().max().item<double>());
      s.zero_grad();
    }
    for (int i = 0; i < every; ++i) {
      auto r = s.train_step(step_context::diloco_host(rank, world, host, p.host_members));
      if (!r) return r.message();
    }
    for (auto& t : s.optimizer().flat_params()) at_boundary[static_cast<size_t>(rank)].push_back(t.clone());
    if (!s.outer().due(s.step())) return std::string("no boundary at step 3");
    auto o = s.outer().step(s.step(), outer);
    if (!o) return o.message();
    return std::string();
  });
  for (int r = 0; r < world; ++r) ASSERT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
  for (size_t g = 0; g < start.size(); ++g) {
    EXPECT_TRUE(torch::equal(at_boundary[0][g], at_boundary[1][g])) << "host 0's ranks went apart";
    EXPECT_TRUE(torch::equal(at_boundary[2][g], at_boundary[3][g])) << "host 1's ranks went apart";
    EXPECT_FALSE(torch::equal(at_boundary[0][g], at_boundary[2][g])) << "the hosts trained the same";
    for (int h = 0; h < 2; ++h)
      // (AdamW turns the rounding of near-zero gradients into visible steps:
      // the gradient itself is compared tightly above.)
      EXPECT_TRUE(torch::allclose(at_boundary[static_cast<size_t>(2 * h)][g], want_host[static_cast<size_t>(h)][g], 1e-3, 1e-3))
          << "host " << h << " group " << g << ": " << (at_boundary[static_cast<size_t>(2 * h)][g] - want_host[static_cast<size_t>(h)][g]).abs().max().item<double>();
    const auto avg = ((start[g] - at_boundary[0][g]) * 2 + (start[g] - at_boundary[2][g]) * 2) / 4.0;
    const auto want = start[g] - lr * (1 + mu) * avg;
    for (int r = 0; r < world; ++r) {
      const auto got = states[static_cast<size_t>(r)]->optimizer().flat_params()[g];
      EXPECT_TRUE(torch::allclose(got, want, 1e-5, 1e-6)) << "rank " << r << " group " << g << ": " << (got - want).abs().max().item<double>();
    }
  }
  EXPECT_EQ(states[0]->params_digest(), states[3]->params_digest());
}

TEST(DiLoCoHostWorkers, HostWorkersWithoutDiLoCoAreRefusedInOneLine) {
  auto c = config::load("", {"train.diloco_worker=host"});
  ASSERT_TRUE(c.ok()) << c.message();
  auto s = training_state::create(c.value());
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("train.sync = diloco"), std::string::npos) << s.message();
  EXPECT_FALSE(config::load("", {"train.diloco_worker=island"}).ok());
}

}  // namespace
}  // namespace dtactor
