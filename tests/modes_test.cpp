// The config's modes as enums (job/modes.hpp): each enum's names are
// exactly its key's choices in the schema, and every name reads back as
// its value.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>

#include "dtactor/config.hpp"
#include "job/modes.hpp"

using namespace dtactor;

namespace {

std::set<std::string> schema_choices(std::string_view key) {
  const auto& schema = config_schema();
  auto it = std::find_if(schema.begin(), schema.end(), [&](const config_key& k) { return k.name == key; });
  if (it == schema.end()) return {};
  return {it->choices.begin(), it->choices.end()};
}

template <class E>
void check_mode() {
  const std::string key(mode_names<E>::key);
  std::set<std::string> names;
  for (const auto& [name, value] : mode_names<E>::table) {
    names.insert(std::string(name));
    EXPECT_EQ(to_string(value), name);
    config cfg;
    ASSERT_TRUE(cfg.set(key, std::string(name))) << key << " = " << name;
    auto read = mode_of<E>(cfg);
    ASSERT_TRUE(read) << read.message();
    EXPECT_EQ(read.value(), value) << key << " = " << name;
  }
  EXPECT_EQ(names, schema_choices(key)) << key << ": the enum's names and the schema's choices differ";
  EXPECT_FALSE(mode_from_string<E>("no such mode").has_value());
}

}  // namespace

TEST(Modes, EachEnumNamesExactlyItsKeysChoices) {
  check_mode<sync_mode>();
  check_mode<precision_mode>();
  check_mode<diloco_worker_kind>();
  check_mode<diloco_checkpoint_workers>();
  check_mode<direct_checkpoint>();
  check_mode<loss_kind>();
  check_mode<comm_backend>();
  check_mode<wire_dtype>();
  check_mode<builtin_model>();  // no task registered here: the schema's choices are the built-in ones
}

TEST(Modes, ATaskTheProgramRegisteredIsNoBuiltinModel) {
  config cfg;
  EXPECT_EQ(builtin_model_of(cfg), builtin_model::vit);  // the default
  ASSERT_TRUE(cfg.set("model.name", "torchscript"));
  EXPECT_EQ(builtin_model_of(cfg), builtin_model::torchscript);
  EXPECT_FALSE(mode_from_string<builtin_model>("my_task").has_value());
}

TEST(Modes, TheDefaultsAndAConfigsModesReadOnce) {
  auto d = job_modes_of(config());
  ASSERT_TRUE(d) << d.message();
  EXPECT_EQ(d->sync, sync_mode::every_step);
  EXPECT_EQ(d->diloco_worker, diloco_worker_kind::rank);
  EXPECT_EQ(d->checkpoint_workers, diloco_checkpoint_workers::all);
  EXPECT_EQ(d->direct, direct_checkpoint::automatic);
  EXPECT_EQ(d->loss, loss_kind::cross_entropy);
  EXPECT_EQ(d->backend, comm_backend::automatic);
  auto c = config::parse_toml(
      "[train]\nsync = \"diloco\"\ndiloco_worker = \"host\"\nloss = \"mse\"\n[checkpoint]\ndiloco_workers = \"first\"\ndirect = false\n[cluster]\nbackend = \"gloo\"\n", "job.toml");
  ASSERT_TRUE(c) << c.message();
  auto m = job_modes_of(c.value());
  ASSERT_TRUE(m) << m.message();
  EXPECT_EQ(m->sync, sync_mode::diloco);
  EXPECT_EQ(m->diloco_worker, diloco_worker_kind::host);
  EXPECT_EQ(m->checkpoint_workers, diloco_checkpoint_workers::first);
  EXPECT_EQ(m->direct, direct_checkpoint::off);
  EXPECT_EQ(m->loss, loss_kind::mse);
  EXPECT_EQ(m->backend, comm_backend::gloo);
}
