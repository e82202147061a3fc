#pragma once
// One pass of AdamW over float arrays, instead of seven tensor ops (two of
// them allocating a temporary) over the same buffers. No torch headers: this
// TU is built with its own flags (model/CMakeLists.txt). Per element, in
// float, the formula and order of torch::optim::AdamW 1.13 (mul_, add_,
// addcmul_, sqrt / c, add_, addcdiv_); ATen's vector kernels fuse some of
// those into FMAs, so results agree with it to rounding, not bit for bit.
// Without FMA contraction, and with sqrt and division correctly rounded, the
// result is the same bits on every x86-64 CPU whichever vector width the
// loader picks: ranks on different machine types stay identical.
#include <cstdint>

namespace dtactor {

struct adamw_scalars {
  float decay_factor;  // 1 - lr * weight_decay
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float sqrt_bias_correction2;  // sqrt(1 - beta2^t)
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^t)
};

// p, exp_avg, exp_avg_sq updated in place from the gradient g.
void adamw_update(float* p, float* exp_avg, float* exp_avg_sq, const float* g, int64_t n, const adamw_scalars& s);

}  // namespace dtactor
