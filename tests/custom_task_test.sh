#!/usr/bin/env bash
# The C++ API from the outside, as a user gets it: `cmake --install` dtactor
# into a temporary prefix, build examples/custom_task against the installed
# package (find_package(dtactor)), and use the program it makes: a 2-node
# `local` run of its own task, eval and export of that run, bad input; the
# same task from CSV shards (dtactor/shards.hpp): a glob in a directory,
# indexed by `dtactor data index` and not, a bad spec, corrupt shards.
# With `s3` (ctest custom_task_s3): the shards in S3 instead, against a real
# radosgw (scripts/rgw/start-rgw.sh), skipped (77) without Ceph's packages.
# Usage: custom_task_test.sh BUILD_DIR SOURCE_DIR [s3]
set -u
build=$1
src=$2
mode=${3:-}
source "$(dirname "$0")/script_checks.sh"
if [ "$mode" = s3 ]; then
  for b in radosgw ceph-mon ceph-osd; do
    [ -x "/usr/bin/$b" ] || { echo "skipped: Ceph's radosgw, ceph-mon and ceph-osd are not installed (scripts/install-deps.sh installs them)"; exit 77; }
  done
fi

# expect_fail NAME PATTERN CMD...: exit 1 and exactly one stderr line matching PATTERN (grep -E).
expect_fail() {
  local name=$1 pattern=$2
  shift 2
  "$@" >out.txt 2>err.txt </dev/null
  local rc=$?
  if [ $rc -eq 1 ] && [ "$(wc -l <err.txt)" -eq 1 ] && grep -Eq -- "$pattern" err.txt; then
    ok "$name"
  else
    bad "$name (rc $rc)"; cat err.txt; tail -5 out.txt
  fi
}
# expect_fail_in_training NAME PATTERN CMD...: exit 1, the last stderr line (after
# the progress lines) matching PATTERN, and no other error line.
expect_fail_in_training() {
  local name=$1 pattern=$2
  shift 2
  "$@" >out.txt 2>err.txt </dev/null
  local rc=$?
  if [ $rc -eq 1 ] && tail -1 err.txt | grep -Eq -- "^dtactor: $pattern" && [ "$(grep -c '^dtactor: ' err.txt)" -eq 1 ]; then
    ok "$name"
  else
    bad "$name (rc $rc)"; tail -5 err.txt
  fi
}
# accuracy_at RUN_DIR STEP: the accuracy its journal recorded at STEP.
accuracy_at() { grep "\"event\":\"eval\",\"step\":$2," "$1/journal.jsonl" | grep -o '"accuracy":[0-9.e-]*' | head -1 | cut -d: -f2; }
learns() { awk -v a="${1:-0}" 'BEGIN { exit !(a > 0.5) }'; }

prefix=$work/prefix
if cmake --install "$build" --prefix "$prefix" >"$work/install.log" 2>&1; then
  ok "cmake --install"
else
  bad "cmake --install"; cat "$work/install.log"; finish
fi
for f in include/dtactor/dtactor.hpp include/dtactor/task.hpp include/dtactor/shards.hpp lib/cmake/dtactor/dtactorConfig.cmake bin/dtactor; do
  [ -e "$prefix/$f" ] && ok "installed $f" || bad "installed $f is missing"
done
ls "$prefix"/lib*/libdtactor.so >/dev/null 2>&1 && ok "installed libdtactor.so" || bad "libdtactor.so is not installed"
# The installed binary finds the installed library (RPATH $ORIGIN/../lib).
if "$prefix/bin/dtactor" config >/dev/null 2>"$work/err"; then ok "installed dtactor runs"; else bad "installed dtactor runs"; cat "$work/err"; fi

launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
if cmake -S "$src/examples/custom_task" -B "$work/example" -DCMAKE_PREFIX_PATH="$prefix" "${launcher[@]}" >"$work/configure.log" 2>&1 &&
   cmake --build "$work/example" >"$work/build.log" 2>&1; then
  ok "examples/custom_task builds against the installed package"
else
  bad "examples/custom_task builds against the installed package"; cat "$work/configure.log" "$work/build.log" | tail -40; finish
fi
bin=$work/example/tabular_trainer

cd "$work"
/usr/bin/python3 "$src/examples/custom_task/make_data.py" data >/dev/null || { bad "make_data.py"; finish; }
cp "$src/examples/custom_task/tabular.toml" .
/usr/bin/python3 "$src/examples/custom_task/make_data.py" shards --shards 8 >/dev/null || { bad "make_data.py --shards 8"; finish; }
[ "$(cat shards/train-*.csv | wc -l)" -eq $((6000 + 8)) ] && ok "make_data.py --shards 8 writes the 6000 rows in 8 shards with a header each" ||
  bad "make_data.py --shards 8: $(cat shards/train-*.csv | wc -l) lines"
dtactor=$prefix/bin/dtactor

if [ "$mode" = s3 ]; then
  # A radosgw of our own on free ports; stopped on exit, before $work goes.
  # Below the kernel's ephemeral range (where no connection of another test
  # is given a port meanwhile), a block the monitor and its daemons bind in
  # (MON_PORT, +1, +10..+99; start-rgw.sh) and the gateway's port after it.
  mon_port=$(/usr/bin/python3 "$src/tests/free_port.py" --block 160) || { bad "free ports"; finish; }
  ports="$((mon_port + 150)) $mon_port"
  read -r rgw_port mon_port <<<"$ports"
  trap 'bash "$src/scripts/rgw/stop-rgw.sh" "$work/ceph" >/dev/null 2>&1; rm -rf "$work"' EXIT
  if RGW_PORT=$rgw_port MON_PORT=$mon_port bash "$src/scripts/rgw/start-rgw.sh" "$work/ceph" >rgw.log 2>&1; then
    ok "radosgw started"
  else
    bad "radosgw started"; tail -30 rgw.log; finish
  fi
  source "$work/ceph/env.sh"
  sigv4=(--aws-sigv4 "aws:amz:us-east-1:s3" --user "$AWS_ACCESS_KEY_ID:$AWS_SECRET_ACCESS_KEY")
  empty_sha=e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855
  put() { curl -sf "${sigv4[@]}" -H "x-amz-content-sha256: $(sha256sum "$1" | cut -d' ' -f1)" -T "$1" "$S3_ENDPOINT/tabular/$2" >/dev/null; }
  uploaded=0
  if curl -sf "${sigv4[@]}" -H "x-amz-content-sha256: $empty_sha" -X PUT "$S3_ENDPOINT/tabular" >/dev/null; then
    uploaded=1
    for f in shards/train-*.csv shards/eval.csv; do put "$f" "csv/$(basename "$f")" || uploaded=0; done
  fi
  [ $uploaded -eq 1 ] && ok "shards uploaded to s3://tabular/csv/" || { bad "shards uploaded to s3://tabular/csv/"; finish; }
  s3=(--set "data.train_csv=s3://tabular/csv/train-*.csv" --set "data.eval_csv=s3://tabular/csv/eval.csv" --set "data.s3_endpoint=$S3_ENDPOINT"
      --set "data.cache_dir=$work/cache" --set train.max_steps=60 --set eval.every_steps=30 --set checkpoint.every_steps=30)

  # Without an index, no node knows a remote shard's rows without fetching it.
  expect_fail "S3 shards without an index: one line saying to run dtactor data index" \
    "data\.train_csv: shard s3://tabular/csv/train-000\.csv has no record count: run \`dtactor data index 's3://tabular/csv/train-\*\.csv'\`" \
    "$bin" train --config tabular.toml "${s3[@]}" --run-dir s3nothing
  "$dtactor" data index "s3://tabular/csv/train-*.csv,s3://tabular/csv/eval.csv" --s3-endpoint "$S3_ENDPOINT" >index.log 2>&1 &&
    grep -q "data index: 9 shard(s)" index.log && ok "dtactor data index over S3" || { bad "dtactor data index over S3"; cat index.log; }

  # A 2-node local run from S3: each rank fetches the shards it reads into the node's cache.
  "$bin" local --nodes 2 --config tabular.toml --run-dir s3run "${s3[@]}" >s3run.log 2>&1
  rc=$?
  if [ $rc -eq 0 ] && grep -q "finished at step 60: accuracy=" s3run.log && grep -q "world_size=2" s3run.log; then
    ok "2-node local run from s3:// shards"
  else
    bad "2-node local run from s3:// shards (rc $rc)"; tail -20 s3run.log
  fi
  acc=$(accuracy_at s3run 60)
  learns "$acc" && ok "it learns from S3 (accuracy $acc after 60 steps)" || bad "accuracy from S3 after 60 steps: '${acc}'"
  grep -q '"data_bytes_s3":[1-9]' s3run/journal.jsonl && ok "the journal counts bytes fetched from S3" || bad "no data_bytes_s3 in the journal"
  ls cache/*train-00*.csv >/dev/null 2>&1 && ok "shards fetched into data.cache_dir" || { bad "shards fetched into data.cache_dir"; ls -la cache; }
  "$bin" eval s3run >eval.log 2>&1 && grep -q "step 60 accuracy=" eval.log && ok "eval of the S3 run" || { bad "eval of the S3 run"; cat eval.log; }
  finish
fi

# Its own keys are part of the config: listed, settable, typo-checked.
"$bin" config --reference >ref.txt 2>&1
grep -q "Registered here: tabular" ref.txt && grep -q "model.hidden = 64" ref.txt && ok "config --reference lists the task and its keys" ||
  bad "config --reference lists the task and its keys"
"$bin" config --config tabular.toml --set model.hiden=8 >/dev/null 2>err.txt
rc=$?
[ $rc -eq 2 ] && grep -q "did you mean 'model.hidden'" err.txt && ok "a typo in the task's key is one clear line" ||
  { bad "a typo in the task's key (rc $rc)"; cat err.txt; }

# The task with train.sync = diloco: two workers, a synchronisation every 10 steps.
"$bin" local --nodes 2 --config tabular.toml --run-dir dilocorun --set train.max_steps=40 --set train.sync=diloco \
  --set train.sync_every=10 >dilocorun.log 2>&1
rc=$?
if [ $rc -eq 0 ] && grep -q "finished at step 40: accuracy=" dilocorun.log && [ "$(grep -c '"event":"outer_step"' dilocorun/journal.jsonl)" -eq 4 ]; then
  ok "2-node local run of the registered task with train.sync = diloco (4 outer steps)"
else
  bad "2-node local run of the registered task with train.sync = diloco (rc $rc)"; tail -20 dilocorun.log
fi

# Streaming DiLoCo: two fragments, each exchange landing a step after it
# left (fragment 0 at 5, 15, 25, 35, fragment 1 at 10, 20, 30, both at 40).
"$bin" local --nodes 2 --config tabular.toml --run-dir streamrun --set train.max_steps=40 --set train.sync=diloco \
  --set train.sync_every=10 --set train.sync_fragments=2 >streamrun.log 2>&1
rc=$?
outer=$(grep -c '"event":"outer_step"' streamrun/journal.jsonl 2>/dev/null)
if [ $rc -eq 0 ] && grep -q "finished at step 40: accuracy=" streamrun.log && [ "${outer:-0}" -eq 8 ] &&
  grep -q "2 fragments, overlap 1" streamrun/node-*.log streamrun.log 2>/dev/null; then
  ok "2-node local run of the registered task with streaming DiLoCo (8 outer steps, 2 fragments)"
else
  bad "2-node local run of the registered task with streaming DiLoCo (rc $rc, $outer outer steps)"; tail -20 streamrun.log
fi

# A 2-node local run of the task.
"$bin" local --nodes 2 --config tabular.toml --run-dir run --set train.max_steps=60 --set eval.every_steps=30 \
  --set checkpoint.every_steps=30 >local.log 2>&1
rc=$?
if [ $rc -eq 0 ] && grep -q "finished at step 60: accuracy=" local.log && grep -q "world_size=2" local.log; then
  ok "2-node local run of the registered task"
else
  bad "2-node local run of the registered task (rc $rc)"; tail -20 local.log
fi
acc=$(grep '"event":"eval","step":60,' run/journal.jsonl | grep -o '"accuracy":[0-9.e-]*' | head -1 | cut -d: -f2)
awk -v a="${acc:-0}" 'BEGIN { exit !(a > 0.5) }' && ok "it learns (accuracy $acc after 60 steps)" || bad "accuracy after 60 steps: '${acc}'"
grep -q "train_csv = '$work/data/train.csv'" run/config.toml && ok "file keys are stored absolute" || bad "file keys are stored absolute"

# eval and export of that run.
"$bin" eval run >eval.log 2>&1 && grep -q "step 60 accuracy=" eval.log && ok "eval of the run" || { bad "eval of the run"; cat eval.log; }
"$bin" export run --out model.pt >export.log 2>&1 && grep -q "state_dict of step 60 (6 tensors)" export.log && ok "export of the run" ||
  { bad "export of the run"; cat export.log; }

# Bad input in the task's own files: one line, exit 1.
printf 'x,y,label\n0.1,0.2,0\n0.3,oops,1\n' >bad.csv
"$bin" train --config tabular.toml --set data.train_csv=bad.csv --run-dir badrun >/dev/null 2>err.txt
rc=$?
[ $rc -eq 1 ] && [ "$(wc -l <err.txt)" -eq 1 ] && grep -q "bad.csv' line 3: 'oops' is not a number" err.txt && ok "a bad CSV row is one clear line" ||
  { bad "a bad CSV row (rc $rc)"; cat err.txt; }

# CSV shards from a glob (relative: made absolute), indexed: each shard's
# rows from the index's line count, less the header line.
"$dtactor" data index "shards/train-*.csv" >index.log 2>&1 && grep -q "data index: 8 shard(s)" index.log &&
  grep -q '"name":"train-000.csv","records":751' shards/dtactor-shards.json && ok "dtactor data index counts the shards' lines" ||
  { bad "dtactor data index counts the shards' lines"; cat index.log shards/dtactor-shards.json; }
sharded=(--set "data.train_csv=shards/train-*.csv" --set data.eval_csv=shards/eval.csv --set train.max_steps=60 --set eval.every_steps=30
         --set checkpoint.every_steps=30)
"$bin" local --nodes 2 --config tabular.toml --run-dir shardrun "${sharded[@]}" >shardrun.log 2>&1
rc=$?
if [ $rc -eq 0 ] && grep -q "finished at step 60: accuracy=" shardrun.log && grep -q "world_size=2" shardrun.log; then
  ok "2-node local run from a glob of CSV shards"
else
  bad "2-node local run from a glob of CSV shards (rc $rc)"; tail -20 shardrun.log
fi
acc=$(accuracy_at shardrun 60)
learns "$acc" && ok "it learns from shards (accuracy $acc after 60 steps)" || bad "accuracy from shards after 60 steps: '${acc}'"
grep -q "train_csv = '$work/shards/train-\*.csv'" shardrun/config.toml && ok "a shard spec in a file key is stored absolute" ||
  { bad "a shard spec in a file key is stored absolute"; grep train_csv shardrun/config.toml; }
"$bin" eval shardrun >eval.log 2>&1 && grep -q "step 60 accuracy=" eval.log && ok "eval of the sharded run" || { bad "eval of the sharded run"; cat eval.log; }

# The engine reads shards a block at a time (data.shuffle_block_shards = 4),
# and the task parses only what it is asked for: 5 steps (320 rows) map the
# 4 shards of the first block (and shard 0, read at the start, and
# eval.csv), not all 8 (one permutation over every row would touch them all).
"$bin" train --config tabular.toml --run-dir fewrun "${sharded[@]}" --set train.max_steps=5 --set eval.every_steps=0 >fewrun.log 2>&1
read_local=$(grep -o '"data_bytes_local":[0-9]*' fewrun/journal.jsonl | tail -1 | cut -d: -f2)
all_bytes=$(cat shards/train-*.csv shards/eval.csv | wc -c)
block_bytes=$(($(wc -c <shards/eval.csv) + 5 * $(wc -c <shards/train-007.csv) + 100))
[ -n "$read_local" ] && [ "$read_local" -gt 0 ] && [ "$read_local" -le "$block_bytes" ] &&
  ok "5 steps read one block of shards ($read_local of $all_bytes bytes)" || { bad "5 steps read '${read_local}' of $all_bytes bytes"; tail -3 fewrun.log; }

# The same shards without an index: counted where they are read.
mkdir -p plain && cp shards/train-*.csv shards/eval.csv plain/
"$bin" train --config tabular.toml --run-dir plainrun --set "data.train_csv=plain/train-*.csv" --set data.eval_csv=plain/eval.csv \
  --set train.max_steps=60 --set eval.every_steps=60 --set checkpoint.every_steps=0 >plainrun.log 2>&1
rc=$?
acc=$(accuracy_at plainrun 60)
[ $rc -eq 0 ] && learns "$acc" && ok "train from shards without an index (accuracy $acc after 60 steps)" ||
  { bad "train from shards without an index (rc $rc, accuracy '$acc')"; tail -5 plainrun.log; }

# Bad specs and corrupt shards: one line, exit 1.
expect_fail "a glob that matches nothing is one line" "data\.train_csv: data '$work/shards/test-\*\.csv': nothing matches" \
  "$bin" train --config tabular.toml --set "data.train_csv=shards/test-*.csv" --run-dir badspec
expect_fail "a range with a missing shard is one line" "train-008\.csv' of its range does not exist" \
  "$bin" train --config tabular.toml --set "data.train_csv=shards/train-{000..008}.csv" --run-dir badrange
mkdir -p corrupt && cp plain/train-*.csv corrupt/
sed -i '100s/.*/0.25,oops,1/' corrupt/train-005.csv
expect_fail_in_training "a corrupt row met in training is one line naming the shard" "data\.train_csv: '$work/corrupt/train-005\.csv' line 100: 'oops' is not a number" \
  "$bin" train --config tabular.toml --set "data.train_csv=corrupt/train-*.csv" --set data.eval_csv=plain/eval.csv --run-dir corruptrun \
  --set train.max_steps=400 --set eval.every_steps=0 --set checkpoint.every_steps=0
grep -q '"event":"job_failed".*train-005.csv' corruptrun/journal.jsonl && ok "the journal says why the job failed" ||
  bad "no job_failed naming the shard in the journal"
"$bin" local --nodes 2 --config tabular.toml --run-dir corruptlocal --set "data.train_csv=corrupt/train-*.csv" --set data.eval_csv=plain/eval.csv \
  --set train.max_steps=400 --set eval.every_steps=0 --set checkpoint.every_steps=0 >corruptlocal.log 2>&1
rc=$?
reason=$(grep '"event":"job_failed"' corruptlocal/journal.jsonl | grep -o '"reason":"[^"]*"')
[ $rc -ne 0 ] && [ $rc -lt 128 ] && echo "$reason" | grep -q "train-005.csv' line 100: 'oops' is not a number" &&
  ok "a corrupt shard ends a 2-node job with its line, not retries (rc $rc)" || { bad "a corrupt shard in a 2-node job (rc $rc): $reason"; tail -5 corruptlocal.log; }
mkdir -p blank && cp plain/train-*.csv blank/ && sed -i '50a\\' blank/train-002.csv
expect_fail_in_training "a shard with fewer rows than counted (a blank line) is one line" \
  "data\.train_csv: shard $work/blank/train-002\.csv holds 750 rows where 751 were counted \(its lines, less a header line" \
  "$bin" train --config tabular.toml --set "data.train_csv=blank/train-*.csv" --set data.eval_csv=plain/eval.csv --run-dir blankrun \
  --set train.max_steps=400 --set eval.every_steps=0 --set checkpoint.every_steps=0
cp plain/train-*.csv corrupt/ && printf '0.1,0.2,1\n' >>corrupt/train-003.csv
"$dtactor" data index "corrupt/train-*.csv" >/dev/null 2>&1 && printf '0.1,0.2,1\n' >>corrupt/train-003.csv
expect_fail "a shard changed since it was indexed is one line" "train-003\.csv: [0-9]+ bytes, the index says [0-9]+" \
  "$bin" train --config tabular.toml --set "data.train_csv=corrupt/train-*.csv" --run-dir changedrun

# The plain dtactor binary does not know the task: one line, exit 2.
"$prefix/bin/dtactor" config --set model.name=tabular >/dev/null 2>err.txt
rc=$?
[ $rc -eq 2 ] && grep -q "model.name' must be one of vit, transformer, gpt, torchscript, got 'tabular'" err.txt &&
  ok "plain dtactor refuses the unregistered task" || { bad "plain dtactor refuses the unregistered task (rc $rc)"; cat err.txt; }
finish
