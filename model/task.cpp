#include "dtactor/task.hpp"

#include "base/task_catalog.hpp"
#include "job/modes.hpp"
#include "model/builtin_tasks.hpp"

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

namespace {
// A task the program registered (register_task) under model.name.
result<std::unique_ptr<task>> registered_task(const config& cfg, const std::string& name) {
  auto it = factories().find(name);
  if (it == factories().end())
    return make_error("unknown model '" + name + "' (model.name must be vit, transformer, gpt or torchscript, or a task registered by the program)");
  auto t = it->second(cfg);
  if (t && !t.value()) return make_error("task '" + name + "': its factory returned no task");
  return t;
}
}  // namespace

result<std::unique_ptr<task>> make_task(const config& cfg) {
  auto model = model_settings_of(cfg);
  if (!model) return model.err();
  if (!model->builtin) return registered_task(cfg, model->name);
  // The built-in models read the settings once, here.
  auto s = job_settings_of(cfg);
  if (!s) return s.err();
  return make_task(cfg, s.value());
}

result<std::unique_ptr<task>> make_task(const config& cfg, const job_settings& s) {
  if (!s.model.builtin) return registered_task(cfg, s.model.name);
  switch (*s.model.builtin) {
    case builtin_model::torchscript: return make_torchscript_task(s);
    case builtin_model::vit: return make_vit_task(s);
    case builtin_model::transformer: return make_transformer_task(s);
    case builtin_model::gpt: return make_gpt_task(s);
  }
  return make_error("model.name = '" + s.model.name + "' is not a model this build knows");
}

}  // namespace dtactor
