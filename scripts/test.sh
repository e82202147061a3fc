#!/usr/bin/env bash
# Builds dtactor (if needed) and runs every test: unit, model, command line.
# Usage: scripts/test.sh [extra ctest args]
set -euo pipefail
cd "$(dirname "$0")/.."
# The test stack (GoogleTest, Ceph, Slurm, Prometheus, Chromium, ...) on top
# of the build's packages; a quick check where everything is installed.
bash scripts/install-deps.sh --test
build=${DTACTOR_BUILD_DIR:-build}
# Under CI (CI=true) a compiler warning fails the build (DTACTOR_WERROR).
werror=OFF
[ "${CI:-}" = true ] && werror=ON
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDTACTOR_WERROR=$werror >/dev/null
cmake --build "$build" -j"$(nproc)"
cd "$build"
# --no-tests=error: a build that found no GoogleTest has no tests, and that fails.
ctest --output-on-failure --no-tests=error --timeout 1200 "$@"
