#pragma once
// How a generation of the rank's training thread ends. No LibTorch here.
#include <optional>

namespace dtactor {

// rank_worker.hpp declares it opaque.
enum class generation_outcome : int { next_plan, failed, finished, stopped, idle, quit };
// Nothing: the generation goes on; else the outcome that ends it.
using generation_end = std::optional<generation_outcome>;

}  // namespace dtactor
