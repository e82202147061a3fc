// cluster.wire_dtype = "bf16": each value rounded to bfloat16 (to nearest,
// ties to even), half the bytes of fp32; decoded sums are in fp32. Below 3
// ranks every rank's bucket is all-gathered and summed (one rounding per
// rank's gradient, none in the sum); from 3 ranks on a reduce-scatter,
// each rank's shard summed in fp32 and rounded once more, then an
// all-gather (half a ring allreduce's bytes at any size).
#include "comm/exchange_registry.hpp"

namespace dtactor {

namespace {

class bf16_codec_impl final : public bucket_codec {
 public:
  int64_t bytes(int64_t n) const override { return (2 * n + 3) / 4 * 4; }
  void encode(const torch::Tensor& values, const torch::Tensor& out) override {
    out.narrow(0, 0, 2 * values.numel()).view(torch::kBFloat16).copy_(values);  // the padding stays as it was
  }
  void decode(const torch::Tensor& in, const torch::Tensor& sum, bool add) override {
    // Mixed-dtype copy_/add_ widen bf16 to fp32 on the fly: no temporary.
    auto v = in.narrow(0, 0, 2 * sum.numel()).view(torch::kBFloat16);
    if (add) sum.add_(v);
    else sum.copy_(v);
  }
};

}  // namespace

codec_entry bf16_codec() { return {"bf16", [] { return std::make_unique<bf16_codec_impl>(); }, 3}; }

}  // namespace dtactor
