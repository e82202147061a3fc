#pragma once
// Part of dtactor's public C++ API (dtactor/dtactor.hpp).
// Job configuration: a flat set of typed keys ("section.key") with defaults
// that live in exactly one place (config_schema() in config.cpp, plus the
// keys registered tasks declare). Files are TOML; `--set key=value`
// overrides any key. Unknown keys, wrong types and out-of-range values are
// errors with one clear line. A task reads its settings with get_int(),
// get_double(), get_bool() and get_string(); asking for a key that does not
// exist, or with the wrong type, is a programming error (std::out_of_range /
// std::bad_variant_access).
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <variant>
#include <vector>

#include "dtactor/result.hpp"

namespace dtactor {

enum class value_kind { integer, floating, boolean, string };

struct config_key {
  std::string name;
  value_kind kind;
  std::string default_value;  // as it would be written after `--set name=`
  std::string doc;
  double min = -1e300;        // numeric keys: inclusive lower bound
  std::vector<std::string> choices;  // string keys: allowed values (empty = any)
};

// Every key dtactor knows, in documentation order.
const std::vector<config_key>& config_schema();

using config_value = std::variant<int64_t, double, bool, std::string>;

// The largest config file read, and the largest effective config a
// coordinator sends (every plan and registration answer carries it over the
// control plane, whose messages are bounded: net/wire.hpp). A job config is
// a few KB; anything near this is a mistake (or /dev/zero).
constexpr std::size_t max_config_bytes = std::size_t{256} << 10;

class config {
 public:
  // The defaults alone.
  config();

  // Reads a TOML file (empty path: defaults only), then applies overrides of
  // the form "key=value" in order. The file must be a regular file (not a
  // directory, a device or a pipe) of at most max_config_bytes.
  static result<config> load(const std::string& path, const std::vector<std::string>& overrides);
  static result<config> parse_toml(const std::string& text, const std::string& origin);

  status set(const std::string& key, const std::string& text);

  int64_t get_int(const std::string& key) const;
  double get_double(const std::string& key) const;
  bool get_bool(const std::string& key) const;
  const std::string& get_string(const std::string& key) const;

  // The effective configuration as TOML (every key), stable order.
  std::string to_toml() const;
  // Hex digest over the keys starting with one of the prefixes (all keys when
  // empty); identifies e.g. the model architecture in checkpoints.
  std::string digest(const std::vector<std::string>& prefixes = {}) const;

  const std::map<std::string, config_value>& values() const { return values_; }

 private:
  status set_value(const std::string& key, config_value v, const std::string& origin);
  std::map<std::string, config_value> values_;
};

std::string to_string(const config_value& v);

}  // namespace dtactor
