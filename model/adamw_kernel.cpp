#include "model/adamw_kernel.hpp"

#include <cmath>

namespace dtactor {

// Cloned for AVX-512, AVX2 and the x86-64 baseline; the loader picks one.
__attribute__((target_clones("avx512f", "avx2", "default"))) void adamw_update(float* __restrict p, float* __restrict exp_avg,
                                                                                 float* __restrict exp_avg_sq, const float* __restrict g,
                                                                                 int64_t n, const adamw_scalars& s) {
  const float decay = s.decay_factor, b1 = s.beta1, omb1 = s.one_minus_beta1, b2 = s.beta2, omb2 = s.one_minus_beta2;
  const float c2 = s.sqrt_bias_correction2, eps = s.eps, nss = s.neg_step_size;
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float pi = p[i] * decay;                          // p.mul_(1 - lr * wd)
    const float m = exp_avg[i] * b1 + omb1 * gi;            // exp_avg.mul_(b1).add_(g, 1 - b1)
    const float v = exp_avg_sq[i] * b2 + omb2 * gi * gi;    // exp_avg_sq.mul_(b2).addcmul_(g, g, 1 - b2)
    const float denom = std::sqrt(v) / c2 + eps;            // (exp_avg_sq.sqrt() / sqrt(bc2)).add_(eps)
    p[i] = pi + nss * m / denom;                            // p.addcdiv_(exp_avg, denom, -step_size)
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
  }
}

}  // namespace dtactor
