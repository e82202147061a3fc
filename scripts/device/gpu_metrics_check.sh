#!/bin/bash
# Checks a node's NVML GPU series on a machine with an NVIDIA GPU and
# PyTorch with CUDA (to load the GPU): starts a coordinator and a node, reads
# the node's /metrics idle and while PyTorch holds 20 GiB and runs bf16
# matrix products, and compares with nvidia-smi.
#   scripts/device/gpu_metrics_check.sh DIR_WITH_DTACTOR [OUT_DIR]
# DIR_WITH_DTACTOR holds the `dtactor` binary and, in lib/, any shared
# libraries it needs that the machine lacks (used for dtactor alone).
# Exits non-zero when the series are missing or disagree with nvidia-smi.
set -u
D=$(cd "${1:?usage: gpu_metrics_check.sh DIR_WITH_DTACTOR [OUT_DIR]}" && pwd)
OUT=${2:-${OUT:-./gpu-metrics-check}}
mkdir -p "$OUT"
L=$D/lib
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,memory.used,utilization.gpu --format=csv | tee "$OUT/nvidia-smi.txt"
LD_LIBRARY_PATH=$L "$D/dtactor" --role coordinator --listen tcp://127.0.0.1:29999 --run-dir "$OUT/run" --set cluster.min_nodes=1 > "$OUT/coord.log" 2>&1 &
C=$!
LD_LIBRARY_PATH=$L "$D/dtactor" --role node --coordinator tcp://127.0.0.1:29999 --metrics-port 9400 > "$OUT/node.log" 2>&1 &
N=$!
trap 'kill $C $N 2>/dev/null' EXIT
for _ in $(seq 1 100); do curl -sf localhost:9400/metrics > /dev/null && break; sleep 0.1; done
sleep 3  # one NVML sample (every ~2 s)
curl -s localhost:9400/metrics | grep '^dtactor_gpu' | tee "$OUT/metrics_idle.txt"
"$PY" - > "$OUT/torch.log" 2>&1 <<'PY' &
import torch, time
x = torch.empty(20 * 2**30, dtype=torch.uint8, device="cuda")  # 20 GiB held
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
print("allocated", flush=True)
t = time.time()
while time.time() - t < 25:
    b = a @ a
torch.cuda.synchronize()
print("done", flush=True)
PY
P=$!
for _ in $(seq 1 300); do grep -q allocated "$OUT/torch.log" 2>/dev/null && break; sleep 0.1; done
sleep 12  # several samples while the products run
curl -s localhost:9400/metrics | grep '^dtactor_gpu' | tee "$OUT/metrics_busy.txt"
smi_used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
wait $P
used=$(awk '/^dtactor_gpu_memory_used_bytes\{gpu="0"\}/ {printf "%d", $2 / 1048576}' "$OUT/metrics_busy.txt")
util=$(awk '/^dtactor_gpu_utilization_ratio\{gpu="0"\}/ {print $2}' "$OUT/metrics_busy.txt")
echo "{\"node_used_mib\": ${used:-null}, \"nvidia_smi_used_mib\": ${smi_used:-null}, \"node_utilization_ratio\": ${util:-null}}" | tee "$OUT/summary.json"
[ -n "$used" ] && [ -n "$smi_used" ] && [ "$used" -ge $((smi_used - 64)) ] && [ "$used" -le $((smi_used + 64)) ] && awk -v u="${util:-0}" 'BEGIN { exit !(u >= 0.9) }' || { echo "gpu_metrics_check: FAILED"; exit 1; }
echo "gpu_metrics_check: ok"
