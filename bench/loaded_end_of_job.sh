#!/bin/bash
# A loss, a join and the end of a job on a machine loaded past its cores:
# coordinator + 3 nodes at train.zero=2, 1 thread a rank, a ViT of dim 192 x 8
# layers, BUSY (2) busy loops beside it; node c killed at step 100, node d
# started at 150, 300 steps. Writes bench/loaded_end_of_job_results.json
# (bench/loaded_end_of_job.py). Usage: bench/loaded_end_of_job.sh [RUN_DIR]
HERE=$(cd "$(dirname "$0")" && pwd)
B=${B:-$HERE/../build/dtactor}
EXTRA=${EXTRA:---set model.dim=192 --set model.layers=8 --set model.heads=4}
P=$((29600 + RANDOM % 100))
D=${1:-$(mktemp -d)}; rm -rf $D; mkdir -p $D
BUSY=${BUSY:-2}
for i in $(seq $BUSY); do (while :; do :; done) & echo $! >> $D/busy.pids; done
$B --role coordinator --listen tcp://127.0.0.1:$P --run-dir $D/run --set cluster.min_nodes=3 --set train.zero=2 --set train.max_steps=${STEPS:-300} --set checkpoint.every_steps=50 ${EXTRA} > $D/c.log 2>&1 &
C=$!
for n in a b c; do $B --role node --coordinator tcp://127.0.0.1:$P --node-id $n --threads-per-rank 1 > $D/$n.log 2>&1 & echo $! > $D/$n.pid; done
J=$D/run/journal.jsonl
step() { tail -c 20000 $J 2>/dev/null | grep -o '"step":[0-9]*' | tail -1 | cut -d: -f2; }
until [ "$(step)" -ge ${KILL_AT:-100} ] 2>/dev/null; do sleep 0.2; kill -0 $C 2>/dev/null || break; done
kill -9 $(cat $D/c.pid); echo "killed c at $(step)"
until [ "$(step)" -ge ${JOIN_AT:-150} ] 2>/dev/null; do sleep 0.2; kill -0 $C 2>/dev/null || break; done
$B --role node --coordinator tcp://127.0.0.1:$P --node-id d --threads-per-rank 1 > $D/d.log 2>&1 & echo "started d at $(step)"
wait $C; echo "coordinator exit $?"
kill $(cat $D/busy.pids) 2>/dev/null
sleep 2; pkill -f "coordinator tcp://127.0.0.1:$P" 2>/dev/null
/usr/bin/python3 $HERE/loaded_end_of_job.py $D/run $D/c.log
