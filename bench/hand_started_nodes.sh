#!/bin/bash
# Usage: [NODEFLAGS="--threads-per-rank 2"] bench/hand_started_nodes.sh
# Two nodes started by hand on this machine (no thread flags), ViT default config, 400 steps; prints samples/s from the journal (steps 100..400).
B=${B:-$(dirname "$0")/../build/dtactor}
P=$((29800 + RANDOM % 100))
D=$(mktemp -d)
$B --role coordinator --listen tcp://127.0.0.1:$P --run-dir $D/run --set cluster.min_nodes=2 --set train.max_steps=400 --set eval.every_steps=0 --set eval.max_samples=500 --set checkpoint.every_steps=0 > $D/c.log 2>&1 &
C=$!
$B --role node --coordinator tcp://127.0.0.1:$P ${NODEFLAGS} > $D/n1.log 2>&1 &
$B --role node --coordinator tcp://127.0.0.1:$P ${NODEFLAGS} > $D/n2.log 2>&1 &
wait $C
/usr/bin/python3.11 - "$D/run/journal.jsonl" "${NODEFLAGS:-}" <<'PY'
import json,sys
st=[json.loads(l) for l in open(sys.argv[1]) if '"event":"step"' in l]
a=[s for s in st if s['step']>=100]
t=a[-1]['t']-a[0]['t']; n=(a[-1]['step']-a[0]['step'])*128
print(json.dumps({"bench": "hand_started_nodes", "node_flags": sys.argv[2], "samples_per_s": round(n/t), "world_size": a[-1]["world_size"]}))
PY
wait
rm -rf $D
