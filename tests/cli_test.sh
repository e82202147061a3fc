#!/usr/bin/env bash
# The command line end to end: help texts, and every kind of bad input gets
# one clear line on stderr, a non-zero exit, no crash and no stack trace.
# Usage: cli_test.sh PATH/TO/dtactor SOURCE_DIR
set -u
bin=$1
src=$2
source "$(dirname "$0")/script_checks.sh"

# expect_error NAME PATTERN ARGS... : non-zero exit, exactly one stderr line
# matching PATTERN, and nothing that looks like a crash.
expect_error() {
  local name=$1 pattern=$2
  shift 2
  "$bin" "$@" >"$work/out" 2>"$work/err" </dev/null
  local rc=$?
  local lines
  lines=$(wc -l <"$work/err")
  if [ $rc -eq 0 ] || [ $rc -ge 128 ]; then
    bad "$name: exit code $rc"; cat "$work/err"; return
  fi
  if [ "$lines" -ne 1 ]; then
    bad "$name: expected one line on stderr, got $lines"; cat "$work/err"; return
  fi
  if grep -q -E 'terminate called|Exception raised from|Segmentation|Aborted|frame #' "$work/err"; then
    bad "$name: crash output"; cat "$work/err"; return
  fi
  if ! grep -q -E -- "$pattern" "$work/err"; then
    bad "$name: stderr does not match /$pattern/"; cat "$work/err"; return
  fi
  ok "$name"
}

expect_ok() {
  local name=$1 pattern=$2
  shift 2
  if "$bin" "$@" >"$work/out" 2>"$work/err" </dev/null && grep -q -E -- "$pattern" "$work/out"; then
    ok "$name"
  else
    bad "$name"; cat "$work/out" "$work/err"
  fi
}

tiny=(--set model.dim=16 --set model.layers=1 --set model.heads=2 --set train.global_batch_size=32 --set train.threads=1
      --set eval.max_samples=200 --set train.max_steps=3)

expect_ok "help" "train" --help
expect_ok "train help" "--config" train --help
expect_ok "config reference lists keys" "train.global_batch_size" config --reference
expect_ok "config print applies --set" "max_steps = 77" config --config "$src/examples/vit_fashion_mnist.toml" --set train.max_steps=77
for f in "$src"/examples/*.toml; do
  expect_ok "example $(basename "$f") parses" "name = " config --config "$f"
done

expect_error "unknown option" "not expected|following argument" train --bogus
expect_error "unknown mode" "not expected|following argument|subcommand" frobnicate
expect_error "missing config file" "cannot read config file" train --config "$work/none.toml"
printf '[train]\nmax_steps = = 3\n' >"$work/malformed.toml"
expect_error "malformed config" "malformed TOML" train --config "$work/malformed.toml" --run-dir "$work/r0"
printf '[train]\nmax_stepz = 3\n' >"$work/unknown.toml"
expect_error "unknown config key" "unknown config key 'train.max_stepz'" train --config "$work/unknown.toml" --run-dir "$work/r0"
expect_error "unknown --set key" "unknown config key" train --set train.nope=1 --run-dir "$work/r0"
expect_error "--set without =" "key=value" train --set train.max_steps --run-dir "$work/r0"
expect_error "unknown model" "must be one of vit, transformer, gpt" train --set model.name=resnet --run-dir "$work/r0"
expect_error "zero batch" "global_batch_size' must be at least 1" train --set train.global_batch_size=0 --run-dir "$work/r0"
expect_error "batch larger than data" "larger than the training set" train "${tiny[@]}" --set train.global_batch_size=100000 --run-dir "$work/r1"
expect_error "micro batch > global" "micro_batch_size" train "${tiny[@]}" --set train.micro_batch_size=64 --run-dir "$work/r1"
expect_error "missing data file" "dataset-fashion-mnist" train "${tiny[@]}" --set data.fashion_mnist_dir="$work/nodata" --run-dir "$work/r2"
touch "$work/blocker"
expect_error "unwritable checkpoint dir" "not writable" train "${tiny[@]}" --set checkpoint.dir="$work/blocker/ck" --run-dir "$work/r3"
expect_error "unwritable run dir" "not writable" train "${tiny[@]}" --run-dir "$work/blocker/run"
expect_error "node without coordinator" "needs --coordinator" --role node
expect_error "bad coordinator address" "not a tcp://HOST:PORT" --role node --coordinator 127.0.0.1:29400
expect_error "node id with a terminal escape" "--node-id: node id .evil.x1b" --role node --coordinator tcp://127.0.0.1:1 --node-id "$(printf 'evil\033[2J')"
TMPDIR=$work/no-such-tmp expect_error "node with a TMPDIR that does not exist" "no temporary directory for the ranks. ipc socket" --role node --coordinator tcp://127.0.0.1:1 --connect-timeout 1
expect_error "bad listen address" "not a tcp://HOST:PORT" --role coordinator --listen tcp://127.0.0.1:notaport --run-dir "$work/rc"
expect_error "a lease with a free listen port" "--lease needs a fixed --listen port" --role coordinator --listen tcp://127.0.0.1:0 --lease "$work/lease" --run-dir "$work/rc"
expect_error "a node given port 0" "port must be 1..65535" --role node --coordinator tcp://127.0.0.1:0
expect_error "unknown role" "role" --role janitor
expect_error "--standby-node on a coordinator" "--standby-node is a node's flag .*--role coordinator --standby" --role coordinator --standby-node --run-dir "$work/rc"
expect_error "--standby-node with a value" "standby-node" --role node --coordinator tcp://127.0.0.1:1 --standby-node=maybe
expect_ok "node help names --standby-node" "--standby-node" --role node --help
MASTER_ADDR=127.0.0.1 MASTER_PORT=29999 expect_error "static mode without WORLD_SIZE" "needs WORLD_SIZE" --role node
MASTER_ADDR=127.0.0.1 WORLD_SIZE=3 expect_error "static mode, WORLD_SIZE not a multiple" "not a multiple" --role node --nproc-per-node 2
expect_error "local with no nodes" "--nodes must be" local --nodes 0 --run-dir "$work/rl"
expect_error "local with too many standby nodes" "--standby-nodes must be 0..64" local --standby-nodes 65 --run-dir "$work/rl"
expect_error "chaos with one node" "--chaos needs --nodes 2 or more" local --nodes 1 --chaos --run-dir "$work/rl"
expect_error "chaos every 0 s" "--chaos-every" local --chaos --chaos-every 0 --run-dir "$work/rl"
# Refused before anything is made: no run directory, no job key.
[ ! -e "$work/rl" ] || bad "local with bad counts made its run directory"
expect_error "coordinator with bad config" "unknown config key" --role coordinator --listen tcp://127.0.0.1:1 --set train.nope=1 --run-dir "$work/rc"
expect_error "suspect timeout shorter than a heartbeat" "cluster.suspect_timeout_ms .50. must be larger" --role coordinator --listen tcp://127.0.0.1:1 --set cluster.suspect_timeout_ms=50 --run-dir "$work/rc"
expect_error "bad fault injection mode" "not in .crash,hang,leave,rank-crash" --role node --coordinator tcp://127.0.0.1:1 --fail-mode bogus
expect_error "eval of nothing" "no such checkpoint, checkpoint directory or run directory" eval "$work/none.manifest"
# expect_code NAME CODE ARGS...: the exit code itself (2 bad command line or config, 1 otherwise)
expect_code() {
  local name=$1 code=$2
  shift 2
  "$bin" "$@" >/dev/null 2>&1 </dev/null
  local rc=$?
  if [ $rc -eq "$code" ]; then ok "$name: exit $code"; else bad "$name: exit $rc, expected $code"; fi
}
# `local` checks everything the coordinator would before it starts any process: one line.
expect_error "local with a config typo" "unknown config key 'train.max_step' \(did you mean 'train.max_steps'" local --set train.max_step=3 --run-dir "$work/rl"
expect_code "local with a config typo" 2 local --set train.max_step=3 --run-dir "$work/rl"
expect_error "local with an unwritable run dir" "run directory: directory .* is not writable" local --run-dir "$work/blocker/run"
expect_code "local with an unwritable run dir" 1 local --run-dir "$work/blocker/run"
expect_code "train with an unwritable run dir" 1 train "${tiny[@]}" --run-dir "$work/blocker/run"
expect_code "train with an impossible micro batch" 2 train "${tiny[@]}" --set train.micro_batch_size=64 --run-dir "$work/r1"
expect_error "typo in a key's last part" "did you mean 'eval.every_steps'.*dtactor config --reference" train --set eval.every_step=3
expect_error "a key's prefix" "did you mean 'checkpoint.keep_last'" train --set checkpoint.keep=3
expect_error "floor above the start gate" "cluster.floor_nodes .3. cannot exceed cluster.min_nodes .2." --role coordinator --listen tcp://127.0.0.1:1 \
  --set cluster.min_nodes=2 --set cluster.floor_nodes=3 --run-dir "$work/rc"
expect_error "coordinator name that does not resolve" "'no-such-host.invalid' does not resolve" --role node --coordinator tcp://no-such-host.invalid:29400
expect_error "... also with --advertise-addr" "'no-such-host.invalid' does not resolve" --role node --coordinator tcp://no-such-host.invalid:29400 --advertise-addr 127.0.0.1
expect_error "metrics on a bad address" "not an IPv4 address" --role node --coordinator tcp://127.0.0.1:1 --metrics-port 29999 --metrics-addr nowhere

# A real short run, then misuse of its checkpoint.
if "$bin" train "${tiny[@]}" --run-dir "$work/good" >"$work/out" 2>"$work/err" </dev/null && grep -q "finished at step 3" "$work/out"; then
  ok "short training run"
else
  bad "short training run"; cat "$work/out" "$work/err"
fi
expect_error "checkpoint of another model" "written by model 'vit'" train --set model.name=gpt --set data.max_text_bytes=200000 --set train.max_steps=3 \
  --set train.threads=1 --run-dir "$work/good"
expect_error "checkpoint of another architecture" "different model" train "${tiny[@]}" --set model.dim=32 --run-dir "$work/good"
echo "garbage" >"$work/garbage.manifest"
expect_error "garbage checkpoint" "not a dtactor checkpoint|garbage|magic|truncated" eval "$work/garbage.manifest"
expect_ok "eval of a run dir" "step 3 .*accuracy=" eval "$work/good" --set eval.max_samples=200
# Signed checkpoints (docs/security.md): with --key, eval and export refuse
# a manifest without this key's MAC, in one line naming it.
"$bin" keygen --out "$work/job.key" >/dev/null 2>&1 && "$bin" keygen --out "$work/other.key" >/dev/null 2>&1
if "$bin" train "${tiny[@]}" --key "$work/job.key" --run-dir "$work/signed" >"$work/out" 2>"$work/err" </dev/null &&
   grep -q "finished at step 3" "$work/out"; then
  ok "keyed training run"
else
  bad "keyed training run"; cat "$work/out" "$work/err"
fi
expect_ok "eval of a signed checkpoint with its key" "step 3 .*accuracy=" eval "$work/signed" --key "$work/job.key" --set eval.max_samples=200
expect_ok "eval of a signed checkpoint without a key" "step 3 .*accuracy=" eval "$work/signed" --set eval.max_samples=200
expect_error "eval with another job's key" "ckpt-0*3.manifest.*not signed with this job's key|ckpt-0*3.manifest.*MAC" eval "$work/signed" --key "$work/other.key"
expect_error "eval of an unsigned checkpoint with a key" "ckpt-0*3.manifest.*(no MAC|not signed)" eval "$work/good" --key "$work/job.key"
expect_error "export with another job's key" "ckpt-0*3.manifest.*not signed with this job's key|ckpt-0*3.manifest.*MAC" export "$work/signed" --key "$work/other.key" --out "$work/x.pt"
chmod 0644 "$work/other.key"
expect_error "a key file others can read" "other.key.*0644|mode" eval "$work/signed" --key "$work/other.key"
# The log book of that run, and bad input to `report`.
expect_ok "report of a train run" "wrote .*report.md, .*loss.svg and .*timeline.svg" report "$work/good"
if grep -q "| outcome | \*\*finished\*\* |" "$work/good/report.md" && grep -q "<polyline" "$work/good/loss.svg" &&
   grep -q "peak resident memory" "$work/good/report.md"; then
  ok "report content"
else
  bad "report content"; cat "$work/good/report.md"
fi
if ls "$work"/good/tensorboard/events.out.tfevents.* >/dev/null 2>&1; then ok "train writes TensorBoard events"; else bad "no TensorBoard events"; fi
expect_error "report of a missing dir" "is not a directory" report "$work/none"
mkdir -p "$work/nojournal"
expect_error "report without journal" "no journal" report "$work/nojournal"
mkdir -p "$work/corrupt" && cp "$work/good/journal.jsonl" "$work/corrupt/" && echo '{"event": "step", "st' >>"$work/corrupt/journal.jsonl"
expect_error "report of a corrupt journal" "journal.jsonl line [0-9]+ is not a journal event" report "$work/corrupt"
expect_error "report to an unwritable place" "cannot|No such file" report "$work/good" --out "$work/no/such/dir/r.md"
expect_error "report without a run dir" "required|run_dir" report

# `dtactor data index` (docs/data.md): one line per index file written and
# a summary; bad input is one line.
mkdir -p "$work/shards" && for i in 0 1 2; do head -c $((1000 + i)) /dev/urandom >"$work/shards/train-00$i.bin"; done
expect_ok "data index" "data index: 3 shard\(s\), 3003 bytes, 1 index file" data index "$work/shards/train-*.bin"
if grep -q "indexed 3 shard(s), 3003 bytes: $work/shards/dtactor-shards.json" "$work/out" &&
   grep -q '"name":"train-002.bin"' "$work/shards/dtactor-shards.json"; then
  ok "data index writes dtactor-shards.json beside the shards"
else
  bad "data index writes dtactor-shards.json beside the shards"; cat "$work/out" "$work/shards/dtactor-shards.json"
fi
expect_error "data index of a glob that matches nothing" "data '.*/shards/test-\*\.bin': nothing matches" data index "$work/shards/test-*.bin"
expect_error "data index of a range with a missing member" "train-003.bin' of its range does not exist" data index "$work/shards/train-{000..003}.bin"
AWS_ACCESS_KEY_ID=AKIDEXAMPLE AWS_SECRET_ACCESS_KEY=secret expect_error "data index over an unreachable S3 endpoint" "data 's3://.*': S3 .*gave up after" \
  data index "s3://bucket/corpus/train-*.bin" --s3-endpoint http://127.0.0.1:1
expect_error "data without a subcommand" "subcommand" data

# No half-written files anywhere after all of the above.
if find "$work" -name '*.tmp*' | grep -q .; then bad "temp files left behind"; find "$work" -name '*.tmp*'; else ok "no temp files left"; fi

# The split build: `dtactor` (coordinator, nodes, local, config, report) maps
# no LibTorch; the commands that train run in dtactor-train beside it.
if ldd "$bin" >"$work/ldd" 2>&1 && ! grep -q -E 'libtorch|libc10' "$work/ldd"; then
  ok "dtactor links no LibTorch"
else
  bad "dtactor links no LibTorch"; grep -E 'libtorch|libc10|not a dynamic' "$work/ldd"
fi
if ldd "$(dirname "$bin")/dtactor-train" 2>&1 | grep -q libtorch; then ok "dtactor-train links LibTorch"; else bad "dtactor-train links LibTorch"; fi
DTACTOR_TRAIN_BINARY=$work/no-such-binary expect_error "a missing dtactor-train is one line" "dtactor-train|no-such-binary" \
  train --set train.max_steps=1 --run-dir "$work/missing-train"

finish
