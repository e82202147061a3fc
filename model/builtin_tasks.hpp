#pragma once
// The built-in models' factories over the job's settings (job/settings.hpp),
// read once: make_task parses them and calls these; the config-taking
// make_*_task of dtactor/task.hpp parse them and call these too.
#include <memory>

#include "dtactor/task.hpp"
#include "job/settings.hpp"

namespace dtactor {

// make_task over settings already read from `cfg` (a registered task's
// factory takes cfg itself).
result<std::unique_ptr<task>> make_task(const config& cfg, const job_settings& s);
result<std::unique_ptr<task>> make_vit_task(const job_settings& s);
result<std::unique_ptr<task>> make_transformer_task(const job_settings& s);
result<std::unique_ptr<task>> make_gpt_task(const job_settings& s);
result<std::unique_ptr<task>> make_torchscript_task(const job_settings& s);

}  // namespace dtactor
