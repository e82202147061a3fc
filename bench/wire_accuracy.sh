#!/usr/bin/env bash
# cluster.wire_dtype's effect on accuracy: the ViT example (examples/
# vit_fashion_mnist.toml, 4,000 steps of 128) on 2 separate hosts (network
# namespaces, scripts/netns/hosts.sh; 1 rank each, 1 thread), fp32 then
# bf16 gradients on the wire; prints the final evaluation of each (the
# job_finished metrics: accuracy for ViT, val_loss and perplexity for GPT)
# as JSON, with bench/bench_meta.py's header (the command, the machine, the
# date). Needs root. Usage: bench/wire_accuracy.sh [CONFIG] [STEPS]
# (the GPT example: bench/wire_accuracy.sh examples/gpt_gcide.toml 3000)
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:-examples/vit_fashion_mnist.toml}
steps=${2:-4000}
hosts=scripts/netns/hosts.sh
tag=dtwa
"$hosts" down $tag 2>/dev/null || true
"$hosts" up $tag 3
trap '"$hosts" down $tag' EXIT
out="{"
for wire in fp32 bf16; do
  rd=$(mktemp -d)
  "$hosts" run $tag 0 ./build/dtactor --role coordinator --listen tcp://198.18.0.1:29400 --config "$config" --run-dir "$rd" --no-resume \
    --set cluster.min_nodes=2 --set train.max_steps="$steps" --set cluster.wire_dtype=$wire >"$rd/coordinator.out" 2>&1 &
  c=$!
  for h in 1 2; do
    "$hosts" run $tag $h ./build/dtactor --role node --coordinator tcp://198.18.0.1:29400 --node-id n$h --threads-per-rank 1 >"$rd/node$h.out" 2>&1 &
  done
  start=$(date +%s)
  wait $c
  wait
  metrics=$(grep '"event":"job_finished"' "$rd/journal.jsonl" | /usr/bin/python3.11 -c '
import json, sys
e = json.loads(sys.stdin.readline())
print(json.dumps({k: v for k, v in e.items() if k in ("accuracy", "val_loss", "perplexity", "token_accuracy", "bleu")})[1:-1])')
  out="$out\"$wire\": {$metrics, \"wall_s\": $(($(date +%s) - start))}, "
  rm -rf "$rd"
done
echo "${out%, }, \"config\": \"$config\", \"steps\": $steps}" | /usr/bin/python3.11 bench/bench_meta.py stamp - --kind wire_accuracy \
  --command "bench/wire_accuracy.sh $config $steps" --title "The bf16 wire's effect on $config: 2 namespace hosts x 1 rank, $steps steps"
