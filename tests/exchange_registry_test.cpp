// The exchange registry (comm/exchange_registry.hpp): the spec parsed from
// the config, the transport a generation's hosts allow, and a codec that
// only this file knows, registered through the registry and run by ranks
// as threads: a new codec is one class and one registration.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "comm/exchange_registry.hpp"
#include "comm/grad_sync.hpp"
#include "rank_threads.hpp"
#include "test_util.hpp"

namespace dtactor {
namespace {

// IEEE half on the wire (PyTorch DDP's fp16_compress_hook): two bytes a
// value, every rank's values rounded once, summed in fp32. It counts the
// values it encoded, so a test sees the reducer used it.
class fp16_test_codec final : public bucket_codec {
 public:
  static std::atomic<int64_t> encoded;
  int64_t bytes(int64_t n) const override { return (2 * n + 3) / 4 * 4; }
  void encode(const torch::Tensor& values, const torch::Tensor& out) override {
    out.narrow(0, 0, 2 * values.numel()).view(torch::kHalf).copy_(values);
    encoded += values.numel();
  }
  void decode(const torch::Tensor& in, const torch::Tensor& sum, bool add) override {
    auto v = in.narrow(0, 0, 2 * sum.numel()).view(torch::kHalf);
    if (add) sum.add_(v);
    else sum.copy_(v);
  }
};
std::atomic<int64_t> fp16_test_codec::encoded{0};

// Past the built-ins: ids this file registers.
constexpr auto fp16_gather = static_cast<wire_codec>(200);
constexpr auto fp16_scatter = static_cast<wire_codec>(201);

// The registration: the gather exchange at any world, and the same class
// again as a reduce-scatter from 2 ranks on.
const bool registered = register_codec(fp16_gather, {"fp16-test", [] { return std::make_unique<fp16_test_codec>(); }, 0}).ok() &&
                        register_codec(fp16_scatter, {"fp16-scatter-test", [] { return std::make_unique<fp16_test_codec>(); }, 2}).ok();

using testing::make_states;
using testing::run_on_hosts;
using testing::run_ranks;
using testing::tiny_vit_config;

void expect_no_errors(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_TRUE(errors[r].empty()) << "rank " << r << ": " << errors[r];
}

TEST(ExchangeRegistry, SpecIsParsedFromTheConfig) {
  auto cluster = cluster_settings_of(tiny_vit_config());
  ASSERT_TRUE(cluster) << cluster.message();
  auto spec = exchange_spec_of(cluster.value());
  EXPECT_EQ(spec.codec, wire_codec::fp32);
  EXPECT_EQ(spec.transport, exchange_transport::shared_memory);
  cluster = cluster_settings_of(tiny_vit_config({"cluster.wire_dtype=int4", "cluster.shm_allreduce=false"}));
  ASSERT_TRUE(cluster) << cluster.message();
  spec = exchange_spec_of(cluster.value());
  EXPECT_EQ(spec.codec, wire_codec::int4);
  EXPECT_EQ(spec.transport, exchange_transport::process_group);
  // Each of the config's wire dtypes is the built-in codec of its name
  // (auto is resolved from train.precision before any codec is chosen).
  for (const auto& [name, dtype] : mode_names<wire_dtype>::table)
    if (dtype != wire_dtype::automatic) {
      EXPECT_EQ(name_of(codec_of(dtype)), name);
    }
  cluster = cluster_settings_of(tiny_vit_config({"train.precision=bf16", "cluster.shm_allreduce=false"}));
  ASSERT_TRUE(cluster) << cluster.message();
  EXPECT_EQ(exchange_spec_of(cluster.value()).codec, wire_codec::bf16);
  EXPECT_EQ(codec_named("bf16").value(), wire_codec::bf16);
  EXPECT_EQ(name_of(wire_codec::int8), "int8");
  EXPECT_FALSE(codec_named("fp8"));
  EXPECT_EQ(name_of(static_cast<wire_codec>(250)), "codec 250");
}

TEST(ExchangeRegistry, ACodecRegistersOnceUnderOneIdAndName) {
  ASSERT_TRUE(registered);
  EXPECT_EQ(codec_named("fp16-test").value(), fp16_gather);
  const auto names = codec_names();
  for (const char* n : {"fp32", "bf16", "int8", "int4", "fp16-test"})
    EXPECT_NE(std::find(names.begin(), names.end(), n), names.end()) << n;
  EXPECT_FALSE(register_codec(fp16_gather, {"another", nullptr, 0})) << "an id taken twice";
  EXPECT_FALSE(register_codec(static_cast<wire_codec>(202), {"bf16", nullptr, 0})) << "a name taken twice";
  EXPECT_EQ(find_codec(static_cast<wire_codec>(202)), nullptr);
}

TEST(ExchangeRegistry, TheHostsDecideTheTransportOfASpecAskingForSharedMemory) {
  exchange_plan one_host;
  c10d::HashStore store;
  std::string why;
  auto joined = shm_group::join(store, 0, 1, 64, &why);
  ASSERT_TRUE(joined && joined.value()) << (joined ? why : joined.message());
  one_host.shm = joined.value();
  exchange_plan hosts;
  hosts.hierarchical = true;
  const exchange_plan apart;
  const exchange_spec shm{exchange_transport::shared_memory, wire_codec::bf16};
  EXPECT_EQ(transport_for(shm, one_host), exchange_transport::shared_memory);
  EXPECT_EQ(transport_for(shm, hosts), exchange_transport::hierarchical);
  EXPECT_EQ(transport_for(shm, apart), exchange_transport::process_group);
  EXPECT_EQ(transport_for({exchange_transport::process_group, wire_codec::fp32}, one_host), exchange_transport::process_group);
}

// Each rank's gradients of one step of the tiny ViT, computed alone.
std::vector<std::vector<torch::Tensor>> own_gradients(int world) {
  auto ref = make_states(tiny_vit_config({"cluster.bucket_kb=4"}), 1);
  std::vector<std::vector<torch::Tensor>> own(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    ref[0]->zero_grad();
    ref[0]->forward_backward(ref[0]->order().rank_slice(0, r, world), 0, r);
    for (auto& g : ref[0]->gradients()) own[static_cast<size_t>(r)].push_back(g.clone());
  }
  return own;
}

// A two-rank job over Gloo with the test's codec: every rank ends with the
// fp32 sum of the ranks' fp16-rounded gradients, bit for bit (gather), or
// that sum rounded to fp16 once more (scatter), and the control words
// exactly; training steps keep the ranks equal.
TEST(ExchangeRegistry, ATestCodecRunsInATwoRankJob) {
  ASSERT_TRUE(registered);
  const int world = 2;
  const auto own = own_gradients(world);
  for (const auto codec : {fp16_gather, fp16_scatter}) {
    SCOPED_TRACE(name_of(codec));
    auto states = make_states(tiny_vit_config({"cluster.bucket_kb=4"}), world);
    std::vector<std::vector<torch::Tensor>> got(world);
    const int64_t encoded_before = fp16_test_codec::encoded;
    expect_no_errors(run_ranks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
      auto& s = *states[static_cast<size_t>(rank)];
      grad_sync_options o;
      o.bucket_bytes = 4 * 1024;
      o.carry_control = true;
      o.exchange.codec = codec;
      grad_sync sync(s.the_task().module()->parameters(), pg, o);
      step_control c;
      c.newer_plan = 1000.25f + static_cast<float>(rank);  // 2001.5 is no fp16 number: the words went as fp32
      sync.set_control(c);
      s.forward_backward(s.order().rank_slice(0, rank, world), 0, rank, &sync);
      auto t = sync.finish();
      if (!t) return t.message();
      if (sync.control().newer_plan != 2001.5f) return "control word summed to " + std::to_string(sync.control().newer_plan);
      for (auto& g : s.gradients()) got[static_cast<size_t>(rank)].push_back(g.clone());
      return "";
    }));
    EXPECT_GT(fp16_test_codec::encoded - encoded_before, 0) << "the codec was not used";
    ASSERT_EQ(got[0].size(), own[0].size());
    for (size_t i = 0; i < own[0].size(); ++i) {
      auto want = own[0][i].to(torch::kHalf).to(torch::kFloat) + own[1][i].to(torch::kHalf).to(torch::kFloat);
      if (codec == fp16_scatter) want = want.to(torch::kHalf).to(torch::kFloat);
      EXPECT_TRUE(torch::equal(got[0][i], want)) << "gradient " << i;
      EXPECT_TRUE(torch::equal(got[1][i], got[0][i])) << "rank 1 differs, gradient " << i;
    }
  }
  auto states = make_states(tiny_vit_config(), world);
  std::vector<std::string> digests(world);
  expect_no_errors(run_ranks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
    auto& s = *states[static_cast<size_t>(rank)];
    grad_sync_options o;
    o.bucket_bytes = 16 * 1024;
    o.exchange.codec = fp16_gather;
    grad_sync sync(s.the_task().module()->parameters(), pg, o);
    for (int i = 0; i < 3; ++i)
      if (auto r = s.train_step(step_context::every_step(rank, world, sync)); !r) return r.message();
    digests[static_cast<size_t>(rank)] = s.params_digest();
    return "";
  }));
  EXPECT_EQ(digests[0], digests[1]);
}

// The same codec wraps the hierarchical transport's leg across hosts: two
// hosts of two ranks, each host's sum rounded to fp16 once on the wire.
TEST(ExchangeRegistry, ATestCodecWrapsTheHierarchicalTransport) {
  ASSERT_TRUE(registered);
  const std::vector<std::string> keys{"a", "a", "b", "b"};
  const int world = 4;
  const auto own = own_gradients(world);
  auto states = make_states(tiny_vit_config({"cluster.bucket_kb=4"}), world);
  int64_t floats = 0;
  for (auto& p : states[0]->the_task().module()->parameters()) floats += p.numel();
  std::vector<std::vector<torch::Tensor>> got(world);
  expect_no_errors(run_on_hosts(keys, floats, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg, const exchange_plan& p) -> std::string {
    auto& s = *states[static_cast<size_t>(rank)];
    grad_sync_options o;
    o.bucket_bytes = 4 * 1024;
    o.exchange = {transport_for({exchange_transport::shared_memory, fp16_gather}, p), fp16_gather};
    o.shm = p.shm;
    o.hosts = p.hosts;
    grad_sync sync(s.the_task().module()->parameters(), pg, o);
    if (!sync.hierarchical()) return "not hierarchical";
    s.forward_backward(s.order().rank_slice(0, rank, world), 0, rank, &sync);
    auto t = sync.finish();
    if (!t) return t.message();
    for (auto& g : s.gradients()) got[static_cast<size_t>(rank)].push_back(g.clone());
    return "";
  }));
  ASSERT_EQ(got[0].size(), own[0].size());
  for (size_t i = 0; i < own[0].size(); ++i) {
    auto host_a = (own[0][i] + own[1][i]).to(torch::kHalf).to(torch::kFloat);
    auto host_b = (own[2][i] + own[3][i]).to(torch::kHalf).to(torch::kFloat);
    EXPECT_TRUE(torch::equal(got[0][i], host_a + host_b)) << "gradient " << i;
    for (int r = 1; r < world; ++r) EXPECT_TRUE(torch::equal(got[static_cast<size_t>(r)][i], got[0][i])) << "rank " << r << " gradient " << i;
  }
}

}  // namespace
}  // namespace dtactor
