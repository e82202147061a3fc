#!/usr/bin/env bash
# `dtactor tune-batch` for real: probes are real processes, memory is what
# the kernel reports. Checked against its own measurements (no figure is
# hard-coded): with a budget halfway between the peaks of micro-batch 1 and
# 512, the result fits, the next size tried above it did not, the bisection
# ended within 1/32 of the result, and the journal and log book say so.
# Usage: tune_batch_test.sh PATH/TO/dtactor
set -u
bin=$1
source "$(dirname "$0")/script_checks.sh"
py=/usr/bin/python3

# Bad input: one line, exit 2, before any probe.
"$bin" tune-batch --max-memory lots --run-dir "$work/x" >/dev/null 2>"$work/err"
rc=$?
[ $rc -eq 2 ] && [ "$(wc -l <"$work/err")" -eq 1 ] && grep -q "max-memory: 'lots' is not a size" "$work/err" && ok "a bad --max-memory" ||
  { bad "a bad --max-memory (rc $rc)"; cat "$work/err"; }
"$bin" tune-batch --start 0 --run-dir "$work/x" >/dev/null 2>"$work/err"
rc=$?
[ $rc -eq 2 ] && [ "$(wc -l <"$work/err")" -eq 1 ] && grep -q -- "--start: Value 0 not in range 1 to" "$work/err" && ok "a --start below 1" ||
  { bad "a --start below 1 (rc $rc)"; cat "$work/err"; }
"$bin" tune-batch --max-memory 1M --run-dir "$work/tiny" --up-to 4 >/dev/null 2>"$work/err"
rc=$?
[ $rc -eq 1 ] && grep -q "even micro-batch 1 does not fit in" "$work/err" && ok "a budget nothing fits is one line, exit 1" ||
  { bad "a budget nothing fits (rc $rc)"; cat "$work/err"; }

peak_of() {  # peak_of RUN_DIR: the peak of its (single) trial
  $py -c 'import json,sys
for l in open(sys.argv[1]):
    e=json.loads(l)
    if e["event"]=="batch_size_trial": print(int(e["peak_rss_bytes"]))' "$1/journal.jsonl"
}
"$bin" tune-batch --start 1 --up-to 1 --steps 1 --max-memory 64G --run-dir "$work/low" >/dev/null 2>&1
"$bin" tune-batch --start 512 --up-to 512 --steps 1 --max-memory 64G --run-dir "$work/high" >/dev/null 2>&1
low=$(peak_of "$work/low")
high=$(peak_of "$work/high")
if [ -z "$low" ] || [ -z "$high" ] || [ "$high" -le "$low" ]; then
  bad "probes of 1 and 512 report peaks ('$low', '$high')"
  finish
fi
ok "a probe reports its peak (1: $low bytes, 512: $high bytes)"
budget=$(((low + high) / 2))

"$bin" tune-batch --start 16 --up-to 512 --steps 1 --max-memory "$budget" --run-dir "$work/run" >"$work/out" 2>"$work/err"
rc=$?
[ $rc -eq 0 ] && ok "search within $budget bytes" || { bad "search (rc $rc)"; cat "$work/out" "$work/err"; }
found=$(sed -n 's/^largest micro-batch that fits in .* per rank: \([0-9]*\).*/\1/p' "$work/out")
if $py - "$work/run/journal.jsonl" "$budget" "${found:-0}" <<'PY'; then ok "the result ($found) agrees with every trial"; else bad "the result ($found) and the trials"; cat "$work/out"; fi
import json, sys
events = [json.loads(l) for l in open(sys.argv[1])]
budget, found = int(sys.argv[2]), int(sys.argv[3])
trials = [e for e in events if e["event"] == "batch_size_trial"]
result = [e for e in events if e["event"] == "batch_size_found"]
assert len(result) == 1 and result[0]["micro_batch"] == found and found > 0, result
fits = [t for t in trials if t["fits"]]
nofit = [t for t in trials if not t["fits"]]
assert all(t["peak_rss_bytes"] <= budget and t["samples_per_s"] > 0 for t in fits), fits
assert all(t["reason"] for t in nofit), nofit
assert found in [t["micro_batch"] for t in fits]
assert max(t["micro_batch"] for t in fits) == found
above = [t["micro_batch"] for t in nofit if t["micro_batch"] > found]
assert above, "no size above the result was found not to fit"
assert min(above) - found <= max(1, found // 32), (found, min(above))
# Doubling from 16 first, then bisection.
sizes = [t["micro_batch"] for t in trials]
assert sizes[:2] == [16, 32], sizes
PY
"$bin" report "$work/run" >/dev/null 2>&1 && grep -q "the largest that fits is \*\*$found\*\*" "$work/run/report.md" &&
  ok "the log book has the search" || bad "the log book has the search"

# The same on sharded data (docs/data.md): the ViT on PNG tar shards; tune-batch
# probes them, `dtactor train` trains a few steps, `dtactor eval` reads the
# held-out shards of that run.
if /usr/bin/python3.11 "$(dirname "$0")/../examples/shards/make_tar_shards.py" --out "$work/shards" --limit 1000 --per-shard 250 2>/dev/null; then
  shards=(--set model.name=vit --set "data.train_shards=$work/shards/train-*.tar" --set data.shuffle_block_shards=2)
  "$bin" tune-batch "${shards[@]}" --start 8 --up-to 16 --steps 1 --max-memory 64G --run-dir "$work/tb-shards" >"$work/out" 2>&1 &&
    grep -q "^largest micro-batch that fits in .* per rank: 16" "$work/out" && ok "tune-batch on tar shards" ||
    { bad "tune-batch on tar shards"; cat "$work/out"; }
  "$bin" train "${shards[@]}" --set train.max_steps=5 --set eval.every_steps=0 --run-dir "$work/tr-shards" >"$work/out" 2>&1 &&
    "$bin" eval "$work/tr-shards" >"$work/eval" 2>&1 && grep -q "^step 5 accuracy=" "$work/eval" && ok "dtactor eval of a run on tar shards" ||
    { bad "dtactor eval of a run on tar shards"; cat "$work/out" "$work/eval"; }
else
  bad "examples/shards/make_tar_shards.py (python3-pil, python3-numpy, dataset-fashion-mnist)"
fi
finish
