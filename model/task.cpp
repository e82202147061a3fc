#include "dtactor/task.hpp"

#include "base/task_catalog.hpp"
#include "job/modes.hpp"

namespace dtactor {

namespace {

std::map<std::string, std::function<result<std::unique_ptr<task>>(const config&)>>& factories() {
  static std::map<std::string, std::function<result<std::unique_ptr<task>>(const config&)>> f;
  return f;
}

}  // namespace

status register_task(task_registration r) {
  if (!r.make) return make_error("register_task('" + r.name + "'): make (the factory) is empty");
  catalog_entry e{r.name, r.description, r.main_metric, r.file_keys};
  if (auto st = add_to_catalog(e, r.keys); !st) return st;
  factories()[r.name] = std::move(r.make);
  return {};
}

result<std::unique_ptr<task>> make_task(const config& cfg) {
  const auto& name = cfg.get_string("model.name");
  const std::optional<builtin_model> builtin = builtin_model_of(cfg);
  if (builtin == builtin_model::torchscript) return make_torchscript_task(cfg);
  if (auto it = factories().find(name); it != factories().end()) {
    auto t = it->second(cfg);
    if (t && !t.value()) return make_error("task '" + name + "': its factory returned no task");
    return t;
  }
  if (cfg.get_int("model.dim") % cfg.get_int("model.heads") != 0)
    return make_error("model.heads (" + std::to_string(cfg.get_int("model.heads")) + ") must divide model.dim (" +
                      std::to_string(cfg.get_int("model.dim")) + ")");
  if (builtin == builtin_model::vit) return make_vit_task(cfg);
  if (builtin == builtin_model::transformer) return make_transformer_task(cfg);
  if (builtin == builtin_model::gpt) return make_gpt_task(cfg);
  return make_error("unknown model '" + name + "' (model.name must be vit, transformer, gpt or torchscript, or a task registered by the program)");
}

}  // namespace dtactor
