#include "model/task.hpp"

namespace dtactor {

result<std::unique_ptr<task>> make_task(const config& cfg) {
  const auto& name = cfg.get_string("model.name");
  if (name == "torchscript") return make_torchscript_task(cfg);
  if (cfg.get_int("model.dim") % cfg.get_int("model.heads") != 0)
    return make_error("model.heads (" + std::to_string(cfg.get_int("model.heads")) + ") must divide model.dim (" +
                      std::to_string(cfg.get_int("model.dim")) + ")");
  if (name == "vit") return make_vit_task(cfg);
  if (name == "transformer") return make_transformer_task(cfg);
  if (name == "gpt") return make_gpt_task(cfg);
  return make_error("unknown model '" + name + "' (model.name must be vit, transformer, gpt or torchscript)");
}

}  // namespace dtactor
