// What the chaos tests (tests/chaos_test.cpp, chaos_sharded_test.cpp,
// chaos_models_test.cpp) take from the cluster harness, by name.
#pragma once

#include <string>

#include "chaos_checks.hpp"
#include "cluster_harness.hpp"
#include "test_util.hpp"

namespace dtactor::chaos {

using testing::cluster;
using testing::crash_and_replace_run;
using testing::descendants;
using testing::events;
using testing::events_named;
using testing::expect_finished_without_loss;
using testing::job_sets;
using testing::node_step;
using testing::read_journal;
using testing::set_flags;
using testing::temp_dir;
using json = nlohmann::json;

inline const std::string kBin = DTACTOR_BINARY;

}  // namespace dtactor::chaos
