#!/usr/bin/env bash
# Runs every libFuzzer target of fuzz/ (docs/fuzzing.md) for SECONDS each
# (default 30) on a copy of its seed corpus (fuzz/corpus/<target>/: seeds
# and the regression inputs of earlier findings), after building them with
# clang in their own build tree if needed. Prints one JSON line per target
# (executions, corpus size, result) and exits non-zero on any crash, leak,
# out-of-memory or timeout; the input that caused it is kept under
# BUILD/fuzz-artifacts/<target>/ and its report printed.
#
# Usage: scripts/fuzz.sh [SECONDS] [--jobs N] [--targets a,b,...] [--json FILE]
#   --jobs N      targets run N at a time (default 1; CI uses the cores)
#   --targets     only these (names without the fuzz_ prefix)
#   --json FILE   also write a summary JSON (e.g. bench/fuzz_results.json)
# Environment: DTACTOR_FUZZ_BUILD_DIR (default build-fuzz), CXX (default
# clang++), FUZZ_BUILD_JOBS (default: the cores), FUZZ_RSS_LIMIT_MB (default 2048: also the largest single
# allocation allowed), FUZZ_UNIT_TIMEOUT (seconds one input may take, default 10).
set -euo pipefail
cd "$(dirname "$0")/.."
fuzz_args="$*"
seconds=30 jobs=1 only="" json=""
while [ $# -gt 0 ]; do
  case $1 in
    --jobs) jobs=$2; shift 2 ;;
    --targets) only=$2; shift 2 ;;
    --json) json=$2; shift 2 ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) seconds=$1; shift ;;
  esac
done
build=${DTACTOR_FUZZ_BUILD_DIR:-build-fuzz}
rss=${FUZZ_RSS_LIMIT_MB:-2048}
unit_timeout=${FUZZ_UNIT_TIMEOUT:-10}
cxx=${CXX:-clang++}
command -v "$cxx" >/dev/null || { echo "fuzz: $cxx not found: install clang and libclang-rt-14-dev (scripts/install-deps.sh)" >&2; exit 2; }

start=$(date +%s)
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S . -B "$build" -G Ninja -DDTACTOR_FUZZ=ON -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DBUILD_TESTING=OFF >/dev/null
elif ! grep -q '^DTACTOR_FUZZ:BOOL=ON' "$build/CMakeCache.txt"; then
  echo "fuzz: $build is not a fuzz build tree (configured without -DDTACTOR_FUZZ=ON); set DTACTOR_FUZZ_BUILD_DIR to another directory" >&2
  exit 2
fi
if ! cmake --build "$build" --target fuzz_all -j"${FUZZ_BUILD_JOBS:-$(nproc)}" >"$build/fuzz-build.log" 2>&1; then
  grep -E 'error|FAILED' -A5 "$build/fuzz-build.log" | head -n 60 >&2
  echo "fuzz: the build failed ($build/fuzz-build.log)" >&2
  exit 2
fi
build_s=$(( $(date +%s) - start ))

targets=()
for t in "$build"/fuzz/fuzz_*; do
  name=$(basename "$t"); name=${name#fuzz_}
  [ "$name" = make_seeds ] && continue
  if [ -n "$only" ] && [[ ",$only," != *",$name,"* ]]; then continue; fi
  targets+=("$name")
done
[ ${#targets[@]} -gt 0 ] || { echo "fuzz: no targets" >&2; exit 2; }

work=$(mktemp -d "${TMPDIR:-/tmp}/dtactor-fuzz.XXXXXX")
trap 'rm -rf "$work"' EXIT
artifacts="$build/fuzz-artifacts"

# One target: its JSON line on stdout (into $work/<t>.json), its log kept.
run_one() {
  local t=$1 dir="$work/$1" log="$work/$1.log" seeds=0 seed_bytes=0 rc=0
  mkdir -p "$dir" "$artifacts/$t"
  if [ -d "fuzz/corpus/$t" ]; then
    cp fuzz/corpus/"$t"/* "$dir"/ 2>/dev/null || true
    seeds=$(find "$dir" -type f | wc -l)
    seed_bytes=$(find "$dir" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
  fi
  timeout --kill-after=10 $(( seconds + 120 )) "$build/fuzz/fuzz_$t" "$dir" -max_total_time="$seconds" -timeout="$unit_timeout" \
    -rss_limit_mb="$rss" -malloc_limit_mb="$rss" -close_fd_mask=3 -print_final_stats=1 -artifact_prefix="$artifacts/$t/" >"$log" 2>&1 || rc=$?
  local execs cov files bytes result=ok artifact=""
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -1 | awk '{print $2}')
  files=$(find "$dir" -type f | wc -l)
  bytes=$(find "$dir" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
  if [ "$rc" -ne 0 ]; then
    if grep -q 'ERROR: libFuzzer: timeout' "$log"; then result=timeout
    elif grep -q 'ERROR: LeakSanitizer' "$log"; then result=leak
    elif grep -qE 'out-of-memory|allocation-size-too-big' "$log"; then result=oom
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then result=hang
    else result=crash
    fi
    artifact=$(sed -n "s/.*Test unit written to \(.*\)$/\1/p" "$log" | tail -1)
  fi
  printf '{"target": "%s", "seconds": %s, "execs": %s, "execs_per_s": %s, "coverage": %s, "seed_files": %s, "seed_bytes": %s, "corpus_files": %s, "corpus_bytes": %s, "result": "%s"%s}\n' \
    "$t" "$seconds" "${execs:-0}" "$(( ${execs:-0} / (seconds > 0 ? seconds : 1) ))" "${cov:-0}" "$seeds" "$seed_bytes" "$files" "$bytes" "$result" \
    "${artifact:+, \"artifact\": \"$artifact\"}" >"$work/$t.json"
}

running=0
for t in "${targets[@]}"; do
  run_one "$t" &
  running=$((running + 1))
  if [ "$running" -ge "$jobs" ]; then wait -n || true; running=$((running - 1)); fi
done
wait || true

failed=0
lines=()
for t in "${targets[@]}"; do
  line=$(cat "$work/$t.json")
  echo "$line"
  lines+=("$line")
  if ! grep -q '"result": "ok"' <<<"$line"; then
    failed=$((failed + 1))
    echo "---- fuzz_$t: the end of its log ($build/fuzz/fuzz_$t ARTIFACT reproduces it)" >&2
    grep -vE '^#[0-9]+ +(NEW|REDUCE|pulse|INITED|DONE)|^\s+NEW_FUNC' "$work/$t.log" | tail -n 60 >&2
  fi
done
total_s=$(( $(date +%s) - start ))
echo "fuzz: ${#targets[@]} targets, ${seconds} s each, ${failed} failed; build ${build_s} s, total ${total_s} s" >&2
if [ -n "$json" ]; then
  {
    printf '{"seconds_per_target": %s, "jobs": %s, "build_s": %s, "total_s": %s, "failed": %s, "machine": "%s", "targets": [\n' \
      "$seconds" "$jobs" "$build_s" "$total_s" "$failed" "$(nproc) cores, $(uname -m)"
    for i in "${!lines[@]}"; do printf '  %s%s\n' "${lines[$i]}" "$([ "$i" -lt $(( ${#lines[@]} - 1 )) ] && echo ,)"; done
    printf ']}\n'
  } >"$json"
  # bench/bench_meta.py's header: the command, the machine, the date.
  python3 bench/bench_meta.py stamp "$json" --in "$json" --kind fuzz \
    --command "scripts/fuzz.sh $fuzz_args" --title "Every fuzz target for $seconds s (libFuzzer, ASan, UBSan)"
fi
[ "$failed" -eq 0 ]
