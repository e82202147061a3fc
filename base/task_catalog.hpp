#pragma once
// The torch-free half of the task registry (the other half, the factories,
// is in model/task.cpp): which model.name values exist besides the built-in
// ones, the metric that ranks their checkpoints, their config keys, and the
// keys that name files every node must hold identically. The coordinator,
// `dtactor config` and the checkpoint policy read it without LibTorch.
#include <string>
#include <vector>

#include "dtactor/config.hpp"
#include "dtactor/result.hpp"

namespace dtactor {

struct catalog_entry {
  std::string name;
  std::string description;
  std::string main_metric;
  std::vector<std::string> file_keys;
};

// Adds a task: checks the name (lower-case letters, digits and '_'; not a
// built-in model nor one added before), its keys (each new, under "model."
// or "data.", with a default of its kind) and file keys (string keys), then
// extends the config schema and model.name's choices. Not thread-safe: call
// before any config is built (dtactor::register_task, before run_main).
status add_to_catalog(const catalog_entry& entry, const std::vector<config_key>& keys);

// The registered task of that name, or nullptr (built-in models are not in
// the catalog).
const catalog_entry* catalog_find(const std::string& name);

// Defined in config.cpp (the schema lives there): appends keys and a
// model.name choice, after the checks above.
status extend_config_schema(const std::string& model_name, const std::string& description, const std::vector<config_key>& keys);

}  // namespace dtactor
