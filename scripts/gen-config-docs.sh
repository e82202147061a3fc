#!/usr/bin/env bash
# Regenerates docs/config.md from the schema in base/config.cpp (through
# `dtactor config --reference`). tests/config_test.cpp fails when a key is
# missing from the page.  Usage: scripts/gen-config-docs.sh [path/to/dtactor]
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-build/dtactor}
{
  cat <<'HEAD'
# Config reference

Job configs are TOML files: the part of a key before the dot is the section
(`[train]`), the rest the key. Every key has a default, so a config file only
needs what differs. `--set key=value` overrides any key on the command line,
in every mode. `dtactor config --reference` prints this list from the code
itself (`base/config.cpp`, the one place where defaults live; this page is
generated from it by `scripts/gen-config-docs.sh`), and
`dtactor config --config FILE --set ...` prints the effective config.

Unknown keys, wrong types and out-of-range values are errors that name the
key (and the file and line). Durations (keys ending in `_ms` or `_us`) are
at most a week.

| key | default | meaning |
|---|---|---|
HEAD
  "$bin" config --reference | tail -n +2 | paste - - | sed -E 's/^  ([^ ]+) = (.*)\t +(.*)$/| `\1` | `\2` | \3 |/'
} >docs/config.md
echo "wrote docs/config.md"
