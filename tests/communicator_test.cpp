#include "comm/communicator.hpp"

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>

#include <thread>

namespace dtactor {
namespace {

// Two ranks as threads over an in-memory store (Gloo's own test pattern).
TEST(Communicator, GlooAllreduceSumsAcrossRanks) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<torch::Tensor> results(2);
  std::vector<std::string> errors(2);
  auto run = [&](int rank) {
    communicator_options o;
    o.generation = 7;
    o.timeout = std::chrono::milliseconds(10000);
    auto pg = make_process_group(store, rank, 2, o);
    if (!pg) {
      errors[rank] = pg.message();
      return;
    }
    std::vector<torch::Tensor> t{torch::full({4}, static_cast<float>(rank + 1))};
    pg.value()->allreduce(t)->wait();
    results[rank] = t[0];
  };
  std::thread a(run, 0), b(run, 1);
  a.join();
  b.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(errors[r].empty()) << errors[r];
    EXPECT_TRUE(torch::equal(results[r], torch::full({4}, 3.f)));
  }
}

TEST(Communicator, BackendChoice) {
  communicator_options o;
  EXPECT_EQ(resolve_backend(o), comm_backend::gloo);
  o.cuda_tensors = true;
  EXPECT_EQ(resolve_backend(o), nccl_available() ? comm_backend::nccl : comm_backend::gloo);
  o.backend = comm_backend::gloo;
  EXPECT_EQ(resolve_backend(o), comm_backend::gloo) << "a backend named is taken as it is";
  o.backend = comm_backend::nccl;
  if (!nccl_available()) {
    auto store = c10::make_intrusive<c10d::HashStore>();
    auto pg = make_process_group(store, 0, 1, o);
    ASSERT_FALSE(pg);
    EXPECT_NE(pg.message().find("CUDA build"), std::string::npos) << pg.message();
  }
}

}  // namespace
}  // namespace dtactor
