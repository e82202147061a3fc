#!/usr/bin/env bash
# Seeds from a real run (docs/fuzzing.md): a coordinator and two nodes of one
# rank each on loopback, without a job key (frames in clear), a tiny ViT for
# 30 steps with an evaluation and checkpoints, every process under strace.
# The ZeroMQ messages each process received (fuzz/zmtp_capture.py) become
# seeds of wire_envelope (two of each kind) and rendezvous_request (a
# rank's requests to the coordinator's store, as records); the run's
# journal, config and a manifest with its checksum become seeds of
# journal_report, config_toml and checkpoint_manifest.
# Usage: fuzz/capture_real_run.sh BIN_DIR CORPUS_DIR (BIN_DIR holds dtactor
# and dtactor-train of a normal build; needs strace).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(cd "$1" && pwd)
corpus=$2
tmp=$(mktemp -d /tmp/dtactor-fuzz-run.XXXXXX)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$tmp"' EXIT
port=$((20000 + RANDOM % 20000))
sets=(--set model.dim=16 --set model.layers=1 --set model.heads=2 --set model.mlp_ratio=2 --set train.global_batch_size=32
      --set train.max_steps=30 --set train.warmup_steps=2 --set train.threads=1 --set train.log_every_steps=5
      --set eval.every_steps=15 --set eval.max_samples=200 --set checkpoint.every_steps=10 --set cluster.min_nodes=2)
st() { strace -ff -tt -xx -s 1048576 -e trace=recvfrom -o "$tmp/$1" "${@:2}"; }
st coord "$bin/dtactor" --role coordinator --listen "tcp://127.0.0.1:$port" --run-dir "$tmp/run" --no-resume "${sets[@]}" \
  >"$tmp/coord.out" 2>"$tmp/coord.err" &
coord=$!
for n in node-a node-b; do
  st "$n" "$bin/dtactor" --role node --coordinator "tcp://127.0.0.1:$port" --node-id "$n" --nproc-per-node 1 --threads-per-rank 1 \
    >"$tmp/$n.out" 2>"$tmp/$n.err" &
done
if ! timeout 300 tail --pid="$coord" -f /dev/null; then echo "capture_real_run: the run did not end in 300 s" >&2; tail "$tmp"/*.err >&2; exit 1; fi
wait || true
grep -q "finished at step 30" "$tmp/coord.out" || { echo "capture_real_run: the run did not finish" >&2; tail "$tmp"/*.err >&2; exit 1; }
/usr/bin/python3.11 - "$tmp" "$corpus" <<'PY'
import glob, os, struct, sys
sys.path.insert(0, "fuzz")
from zmtp_capture import streams
tmp, corpus = sys.argv[1], sys.argv[2]
BODIES = {10: "register_node", 11: "register_ack", 12: "heartbeat", 13: "heartbeat_ack", 14: "generation_plan", 15: "rank_status",
          16: "step_report", 17: "eval_report", 23: "checkpoint_written", 19: "leave", 20: "shutdown", 21: "rank_hello", 22: "job_error"}

def varint(b, i):
    v = s = 0
    while True:
        c = b[i]; i += 1; v |= (c & 0x7F) << s; s += 7
        if c < 0x80: return v, i

def body_of(msg):
    i = 0
    try:
        while i < len(msg):
            key, i = varint(msg, i)
            field, wt = key >> 3, key & 7
            if field in BODIES: return BODIES[field]
            if wt == 0: _, i = varint(msg, i)
            elif wt == 1: i += 8
            elif wt == 2: n, i = varint(msg, i); i += n
            elif wt == 5: i += 4
            else: return None
    except IndexError:
        return None
    return None

def write(target, name, data):
    d = os.path.join(corpus, target); os.makedirs(d, exist_ok=True)
    open(os.path.join(d, "seed-real-" + name), "wb").write(data)

def record(tag, p): return bytes([tag]) + struct.pack("<H", len(p)) + p

kinds, store = {}, []
for path, fd, peer, msgs in streams(sorted(glob.glob(tmp + "/coord.*") + glob.glob(tmp + "/node-*.*"))):
    for t, frames in msgs:
        if len(frames) == 1 and (kind := body_of(frames[0])):
            kinds[kind] = kinds.get(kind, 0) + 1
            if kinds[kind] <= 2: write("wire_envelope", f"{kind}-{kinds[kind]}", frames[0])
        elif len(frames) >= 2 and len(frames[0]) == 8 and "coord." in path:
            store.append((path, fd, t, frames))
# One rank's store conversation: the longest, as records (a routing id first).
by_stream = {}
for path, fd, t, frames in store: by_stream.setdefault((path, fd), []).append((t, frames))
if by_stream:
    conv, seed, last = max(by_stream.values(), key=len), b"", None
    for t, frames in conv:
        if last is not None and t - last >= 0.001:
            seed += record(2, struct.pack("<H", min(int((t - last) * 1000), 60000)))
        last = t
        frames = [b"rank-peer"] + frames
        for k, f in enumerate(frames): seed += record(0 if k == len(frames) - 1 else 1, f)
    write("rendezvous_request", "gloo-group", seed)
print("capture_real_run: frames by kind", dict(sorted(kinds.items())), "; store requests", len(store))
PY
cp "$tmp/run/journal.jsonl" "$corpus/journal_report/seed-real-run-journal"
cp "$tmp/run/config.toml" "$corpus/config_toml/seed-real-run-config"
manifest=$(ls "$tmp"/run/checkpoints/ckpt-*.manifest | tail -1)
# A manifest without its parts (they are the model's bytes): its checks up
# to the missing parts.
/usr/bin/python3.11 -c 'import struct,sys; d=open(sys.argv[1],"rb").read(); sys.stdout.buffer.write(b"\0"+struct.pack("<H",len(d))+d)' "$manifest" \
  >"$corpus/checkpoint_manifest/seed-real-run-manifest"
