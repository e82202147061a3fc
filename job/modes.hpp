#pragma once
// The config's modes as enums, read once where a component takes its
// config (job_modes_of), so that no site compares a mode's text. The names
// are the config's spelling; base/config.cpp lists the same as each key's
// choices (tests/modes_test.cpp checks that the two agree). The exchange
// and the codec registry are comm/'s (exchange_spec.hpp maps a wire_dtype to
// its wire_codec).
#include <array>
#include <optional>
#include <string_view>
#include <utility>

#include "dtactor/config.hpp"
#include "dtactor/result.hpp"

namespace dtactor {

enum class sync_mode { every_step, diloco };          // train.sync
// train.precision: what the parameters a forward computes with, and their
// gradients, are. bf16 keeps fp32 master weights in the optimizer.
enum class precision_mode { fp32, bf16 };
enum class diloco_worker_kind { rank, host };         // train.diloco_worker: what one DiLoCo worker is
enum class diloco_checkpoint_workers { all, first };  // checkpoint.diloco_workers: whose inner state a checkpoint holds
enum class direct_checkpoint { automatic, on, off };  // checkpoint.direct: auto | true | false
enum class loss_kind { cross_entropy, mse };          // train.loss (a torchscript task's)
enum class comm_backend { automatic, gloo, nccl };    // cluster.backend: auto | gloo | nccl
// cluster.wire_dtype: how float32 values cross hosts. int8 and int4
// quantize (DiLoCo's pseudo-gradients only). automatic is the config's
// "auto", which cluster_settings_of resolves (bf16 with train.precision =
// bf16, else fp32): settings never hold it.
enum class wire_dtype { automatic, fp32, bf16, int8, int4 };
inline bool quantized(wire_dtype d) { return d == wire_dtype::int8 || d == wire_dtype::int4; }
// model.name's built-in models. A task the program registered
// (register_task, dtactor/task.hpp) is none of them: read model.name with
// builtin_model_of, not mode_of.
enum class builtin_model { vit, transformer, gpt, torchscript };

// One table per enum: its config key and the name of each value.
template <class E>
struct mode_names;
template <>
struct mode_names<sync_mode> {
  static constexpr std::string_view key = "train.sync";
  static constexpr std::array<std::pair<std::string_view, sync_mode>, 2> table{{{"every_step", sync_mode::every_step}, {"diloco", sync_mode::diloco}}};
};
template <>
struct mode_names<precision_mode> {
  static constexpr std::string_view key = "train.precision";
  static constexpr std::array<std::pair<std::string_view, precision_mode>, 2> table{{{"fp32", precision_mode::fp32}, {"bf16", precision_mode::bf16}}};
};
template <>
struct mode_names<diloco_worker_kind> {
  static constexpr std::string_view key = "train.diloco_worker";
  static constexpr std::array<std::pair<std::string_view, diloco_worker_kind>, 2> table{
      {{"rank", diloco_worker_kind::rank}, {"host", diloco_worker_kind::host}}};
};
template <>
struct mode_names<diloco_checkpoint_workers> {
  static constexpr std::string_view key = "checkpoint.diloco_workers";
  static constexpr std::array<std::pair<std::string_view, diloco_checkpoint_workers>, 2> table{
      {{"all", diloco_checkpoint_workers::all}, {"first", diloco_checkpoint_workers::first}}};
};
template <>
struct mode_names<direct_checkpoint> {
  static constexpr std::string_view key = "checkpoint.direct";
  static constexpr std::array<std::pair<std::string_view, direct_checkpoint>, 3> table{
      {{"auto", direct_checkpoint::automatic}, {"true", direct_checkpoint::on}, {"false", direct_checkpoint::off}}};
};
template <>
struct mode_names<loss_kind> {
  static constexpr std::string_view key = "train.loss";
  static constexpr std::array<std::pair<std::string_view, loss_kind>, 2> table{{{"cross_entropy", loss_kind::cross_entropy}, {"mse", loss_kind::mse}}};
};

template <>
struct mode_names<comm_backend> {
  static constexpr std::string_view key = "cluster.backend";
  static constexpr std::array<std::pair<std::string_view, comm_backend>, 3> table{
      {{"auto", comm_backend::automatic}, {"gloo", comm_backend::gloo}, {"nccl", comm_backend::nccl}}};
};
template <>
struct mode_names<wire_dtype> {
  static constexpr std::string_view key = "cluster.wire_dtype";
  static constexpr std::array<std::pair<std::string_view, wire_dtype>, 5> table{{{"auto", wire_dtype::automatic},
                                                                                  {"fp32", wire_dtype::fp32},
                                                                                  {"bf16", wire_dtype::bf16},
                                                                                  {"int8", wire_dtype::int8},
                                                                                  {"int4", wire_dtype::int4}}};
};
template <>
struct mode_names<builtin_model> {
  static constexpr std::string_view key = "model.name";
  static constexpr std::array<std::pair<std::string_view, builtin_model>, 4> table{{{"vit", builtin_model::vit},
                                                                                     {"transformer", builtin_model::transformer},
                                                                                     {"gpt", builtin_model::gpt},
                                                                                     {"torchscript", builtin_model::torchscript}}};
};

// The value named `name`, or none.
template <class E>
std::optional<E> mode_from_string(std::string_view name) {
  for (const auto& [n, v] : mode_names<E>::table)
    if (n == name) return v;
  return std::nullopt;
}

template <class E, class = decltype(mode_names<E>::table)>
std::string_view to_string(E value) {
  for (const auto& [n, v] : mode_names<E>::table)
    if (v == value) return n;
  return {};
}

// The mode the config sets for E's key. Error: its value is none of E's
// names (a config the schema let through that this table does not know).
template <class E>
result<E> mode_of(const config& cfg) {
  const std::string key(mode_names<E>::key);
  const std::string value = cfg.get_string(key);
  if (auto v = mode_from_string<E>(value)) return *v;
  return make_error(key + " = '" + value + "' is not a mode this build knows");
}

// The built-in model model.name names; none: a task the program registered
// (or a name the schema would have refused).
inline std::optional<builtin_model> builtin_model_of(const config& cfg) { return mode_from_string<builtin_model>(cfg.get_string("model.name")); }

// Every mode of a job's config, read once.
struct job_modes {
  sync_mode sync = sync_mode::every_step;
  diloco_worker_kind diloco_worker = diloco_worker_kind::rank;
  diloco_checkpoint_workers checkpoint_workers = diloco_checkpoint_workers::all;
  direct_checkpoint direct = direct_checkpoint::automatic;
  loss_kind loss = loss_kind::cross_entropy;
  comm_backend backend = comm_backend::automatic;
};
result<job_modes> job_modes_of(const config& cfg);

}  // namespace dtactor
