#include "dtactor/config.hpp"

#include <gtest/gtest.h>

#include <fstream>
#include <set>
#include <sstream>

namespace dtactor {
namespace {

TEST(Config, DefaultsCoverEveryKey) {
  config c;
  EXPECT_EQ(c.values().size(), config_schema().size());
  EXPECT_EQ(c.get_string("model.name"), "vit");
  EXPECT_EQ(c.get_int("train.global_batch_size"), 128);
}

TEST(Config, RequiredKeysExist) {
  std::set<std::string> names;
  for (const auto& k : config_schema()) names.insert(k.name);
  for (const char* k : {"model.name", "train.max_steps", "train.global_batch_size", "train.seed", "train.lr", "eval.every_steps",
                        "checkpoint.every_steps", "checkpoint.keep_last"})
    EXPECT_TRUE(names.count(k)) << k;
}

TEST(Config, ParsesTomlSectionsAndOverrides) {
  auto c = config::parse_toml("[model]\nname = \"gpt\"\n[train]\nmax_steps = 7\nlr = 1\n", "test.toml");
  ASSERT_TRUE(c) << c.message();
  EXPECT_EQ(c->get_string("model.name"), "gpt");
  EXPECT_EQ(c->get_int("train.max_steps"), 7);
  EXPECT_DOUBLE_EQ(c->get_double("train.lr"), 1.0);  // integer accepted for a float key
  ASSERT_TRUE(c->set("train.max_steps", "200"));
  EXPECT_EQ(c->get_int("train.max_steps"), 200);
}

// checkpoint.direct is auto, true or false: a TOML boolean is taken for
// true and false (the key was a boolean before auto), anything else is
// refused with the choices.
TEST(Config, CheckpointDirectTakesAutoOrABoolean) {
  EXPECT_EQ(config{}.get_string("checkpoint.direct"), "auto");
  for (const auto& [text, want] : std::vector<std::pair<std::string, std::string>>{
           {"direct = true", "true"}, {"direct = false", "false"}, {"direct = \"auto\"", "auto"}, {"direct = \"true\"", "true"}}) {
    auto c = config::parse_toml("[checkpoint]\n" + text + "\n", "job.toml");
    ASSERT_TRUE(c) << text << ": " << c.message();
    EXPECT_EQ(c->get_string("checkpoint.direct"), want) << text;
  }
  auto bad = config::parse_toml("[checkpoint]\ndirect = \"sometimes\"\n", "job.toml");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.message().find("must be one of auto, true, false, got 'sometimes'"), std::string::npos) << bad.message();
  auto number = config::parse_toml("[checkpoint]\ndirect = 1\n", "job.toml");
  ASSERT_FALSE(number);
  EXPECT_EQ(number.message(), "job.toml:2: config key 'checkpoint.direct' must be one of auto, true, false");
  config d;
  EXPECT_TRUE(d.set("checkpoint.direct", "true"));
  EXPECT_FALSE(d.set("checkpoint.direct", "yes"));
  auto tb = config::parse_toml("[train]\nbf16 = \"true\"\n", "job.toml");
  EXPECT_FALSE(tb) << "a boolean key still wants a boolean";
}

TEST(Config, UnknownKeyIsAnErrorWithSuggestion) {
  auto c = config::parse_toml("[train]\nmax_step = 7\n", "job.toml");
  ASSERT_FALSE(c);
  EXPECT_NE(c.message().find("unknown config key 'train.max_step'"), std::string::npos) << c.message();
  EXPECT_NE(c.message().find("job.toml:2"), std::string::npos) << c.message();
  config d;
  auto st = d.set("trian.max_steps", "3");
  ASSERT_FALSE(st);
  EXPECT_NE(st.message().find("did you mean 'train.max_steps'"), std::string::npos) << st.message();
}

// Typos inside the key's last part are caught too, and every unknown key
// points at the reference.
TEST(Config, UnknownKeySuggestsTheClosestKey) {
  const std::vector<std::pair<std::string, std::string>> typos = {{"train.max_step", "train.max_steps"},
                                                                  {"eval.every_step", "eval.every_steps"},
                                                                  {"checkpoint.keep", "checkpoint.keep_last"},
                                                                  {"trian.max_steps", "train.max_steps"},
                                                                  {"cluster.min_node", "cluster.min_nodes"},
                                                                  {"train.global_batch", "train.global_batch_size"}};
  for (const auto& [typo, meant] : typos) {
    config d;
    auto st = d.set(typo, "3");
    ASSERT_FALSE(st) << typo;
    EXPECT_NE(st.message().find("did you mean '" + meant + "'"), std::string::npos) << st.message();
    EXPECT_NE(st.message().find("dtactor config --reference"), std::string::npos) << st.message();
  }
  config d;
  auto st = d.set("zzz.qqq", "1");
  ASSERT_FALSE(st);
  EXPECT_EQ(st.message().find("did you mean"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("dtactor config --reference"), std::string::npos) << st.message();
}

TEST(Config, MalformedTomlNamesTheLine) {
  auto c = config::parse_toml("[train]\nmax_steps = = 3\n", "bad.toml");
  ASSERT_FALSE(c);
  EXPECT_NE(c.message().find("bad.toml:2"), std::string::npos) << c.message();
  EXPECT_NE(c.message().find("malformed TOML"), std::string::npos) << c.message();
}

TEST(Config, WrongTypesAndRangesAreErrors) {
  EXPECT_FALSE(config::parse_toml("[train]\nmax_steps = \"ten\"\n", "t"));
  EXPECT_FALSE(config::parse_toml("[train]\nmax_steps = 1.5\n", "t"));
  EXPECT_FALSE(config::parse_toml("[train]\nglobal_batch_size = 0\n", "t"));
  EXPECT_FALSE(config::parse_toml("[model]\nname = \"resnet\"\n", "t"));
  config c;
  EXPECT_FALSE(c.set("train.max_steps", "12x"));
  EXPECT_FALSE(c.set("train.lr", "fast"));
  EXPECT_FALSE(c.set("train.bf16", "maybe"));
  EXPECT_FALSE(c.set("train.global_batch_size", "-4"));
  auto st = c.set("model.name", "resnet");
  ASSERT_FALSE(st);
  EXPECT_NE(st.message().find("vit, transformer, gpt"), std::string::npos) << st.message();
}

TEST(Config, MissingFileAndBadOverride) {
  auto c = config::load("/nonexistent/job.toml", {});
  ASSERT_FALSE(c);
  EXPECT_NE(c.message().find("/nonexistent/job.toml"), std::string::npos);
  EXPECT_FALSE(config::load("", {"train.max_steps"}));
  EXPECT_TRUE(config::load("", {"train.max_steps=3"}));
}

TEST(Config, TomlOutputRoundTrips) {
  config c;
  ASSERT_TRUE(c.set("train.lr", "0.00123"));
  ASSERT_TRUE(c.set("data.gcide", "/tmp/a \"quoted\" path"));
  auto again = config::parse_toml(c.to_toml(), "roundtrip");
  ASSERT_TRUE(again) << again.message();
  EXPECT_EQ(again->values(), c.values());
  EXPECT_EQ(again->digest(), c.digest());
}

TEST(Config, DigestsFollowTheirPrefix) {
  config a, b;
  ASSERT_TRUE(b.set("train.max_steps", "9"));
  EXPECT_EQ(a.digest({"model."}), b.digest({"model."}));
  EXPECT_NE(a.digest(), b.digest());
  ASSERT_TRUE(b.set("model.dim", "32"));
  EXPECT_NE(a.digest({"model."}), b.digest({"model."}));
}

// docs/config.md is the human reference; it must name every key.
TEST(Config, DocsListEveryKey) {
  std::ifstream in(std::string(DTACTOR_SOURCE_DIR) + "/docs/config.md");
  ASSERT_TRUE(in) << "docs/config.md missing";
  std::stringstream ss;
  ss << in.rdbuf();
  for (const auto& k : config_schema()) EXPECT_NE(ss.str().find("`" + k.name + "`"), std::string::npos) << k.name << " not documented";
}

}  // namespace
}  // namespace dtactor
