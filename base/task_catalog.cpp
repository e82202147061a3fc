#include "base/task_catalog.hpp"

#include <memory>

namespace dtactor {

namespace {

std::vector<std::unique_ptr<catalog_entry>>& entries() {
  static std::vector<std::unique_ptr<catalog_entry>> e;
  return e;
}

bool valid_name(const std::string& n) {
  if (n.empty() || n.size() > 64) return false;
  for (char c : n)
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_')) return false;
  return true;
}

}  // namespace

const catalog_entry* catalog_find(const std::string& name) {
  for (const auto& e : entries())
    if (e->name == name) return e.get();
  return nullptr;
}

status add_to_catalog(const catalog_entry& entry, const std::vector<config_key>& keys) {
  const std::string who = "register_task('" + entry.name + "')";
  if (!valid_name(entry.name)) return make_error(who + ": a task name is 1 to 64 lower-case letters, digits or '_'");
  for (const char* builtin : {"vit", "transformer", "gpt", "torchscript"})
    if (entry.name == builtin) return make_error(who + ": '" + entry.name + "' is a built-in model");
  if (catalog_find(entry.name)) return make_error(who + ": a task of that name is already registered");
  if (entry.main_metric.empty()) return make_error(who + ": main_metric is empty (the metric that ranks checkpoints, e.g. val_loss or accuracy)");
  for (const auto& fk : entry.file_keys) {
    const config_key* k = nullptr;
    for (const auto& nk : keys)
      if (nk.name == fk) k = &nk;
    for (const auto& sk : config_schema())
      if (sk.name == fk) k = &sk;
    if (!k) return make_error(who + ": file key '" + fk + "' is not a config key (declare it in keys)");
    if (k->kind != value_kind::string) return make_error(who + ": file key '" + fk + "' must be a string key (a path)");
  }
  if (auto st = extend_config_schema(entry.name, entry.description, keys); !st) return make_error(who + ": " + st.message());
  entries().push_back(std::make_unique<catalog_entry>(entry));
  return {};
}

}  // namespace dtactor
