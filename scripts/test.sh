#!/usr/bin/env bash
# Builds dtactor (if needed) and runs every test: unit, model, command line.
# Usage: scripts/test.sh [extra ctest args]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${DTACTOR_BUILD_DIR:-build}
# Under CI (CI=true) a compiler warning fails the build (DTACTOR_WERROR).
werror=OFF
[ "${CI:-}" = true ] && werror=ON
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDTACTOR_WERROR=$werror >/dev/null
cmake --build "$build" -j"$(nproc)"
cd "$build"
ctest --output-on-failure --timeout 1200 "$@"
