#!/bin/bash
# Usage: bench/torchscript_vs_builtin.sh [REPEATS] [STEPS]
# Samples/s of the built-in ViT against the same ViT written in PyTorch and
# trained through the TorchScript path (model.name = torchscript, Fashion-MNIST
# as .npy), `dtactor train` with the default settings otherwise, the two
# interleaved in each repeat; samples/s from the journal between step 100 and
# the last. Prints one JSON object, with bench/bench_meta.py's header (the
# command, the machine, the date; bench/torchscript_vs_builtin_results.json).
set -euo pipefail
R=${1:-3}; N=${2:-400}
B=$(cd "$(dirname "$0")/.." && pwd)/build/dtactor
D=$(mktemp -d)
/usr/bin/python3.11 "$(dirname "$0")/../examples/torchscript/prepare.py" "$D/data" > /dev/null
/usr/bin/python3.11 "$(dirname "$0")/torchscript_vit.py" "$D/vit.pt"
common=(--set train.max_steps=$N --set eval.every_steps=0 --set checkpoint.every_steps=0 --set train.log_every_steps=50)
ts=(--set model.name=torchscript --set model.file=$D/vit.pt --set data.train_inputs=$D/data/train_images.npy
    --set data.train_targets=$D/data/train_labels.npy --set data.eval_inputs=$D/data/test_images.npy
    --set data.eval_targets=$D/data/test_labels.npy --set eval.max_samples=1000)
for i in $(seq 1 "$R"); do
  "$B" train "${common[@]}" --set eval.max_samples=1000 --run-dir "$D/builtin$i" > /dev/null 2>&1
  "$B" train "${common[@]}" "${ts[@]}" --run-dir "$D/ts$i" > /dev/null 2>&1
done
/usr/bin/python3.11 - "$D" "$R" <<'PY' | /usr/bin/python3.11 "$(dirname "$0")/bench_meta.py" stamp - --kind torchscript_vs_builtin \
  --command "bench/torchscript_vs_builtin.sh $R $N" --title "The ViT written in PyTorch and scripted against the built-in ViT: dtactor train, default settings, $R pairs of $N steps"
import json, statistics, sys
d, r = sys.argv[1], int(sys.argv[2])
def sps(run):
    st = [json.loads(l) for l in open(f"{d}/{run}/journal.jsonl") if '"event":"step"' in l]
    a = [s for s in st if s["step"] >= 100]
    return (a[-1]["step"] - a[0]["step"]) * 128 / (a[-1]["t"] - a[0]["t"])
b = [sps(f"builtin{i}") for i in range(1, r + 1)]
t = [sps(f"ts{i}") for i in range(1, r + 1)]
print(json.dumps({"bench": "torchscript_vs_builtin", "builtin_samples_per_s": [round(x) for x in b], "torchscript_samples_per_s": [round(x) for x in t],
                  "ratio_of_medians": round(statistics.median(t) / statistics.median(b), 3),
                  "paired_ratios": [round(y / x, 3) for x, y in zip(b, t)]}))
PY
rm -rf "$D"
