#!/bin/bash
# OpenBLAS idle-worker spin (OPENBLAS_THREAD_TIMEOUT) vs `dtactor train` with
# default settings, interleaved rounds so every value sees the same host
# load. One JSON line per run: samples/s (median between step events after
# the first quarter) and the run's kernel time (spinning workers yield).
# 28 is OpenBLAS's own default; dtactor sets 4 unless the user set it.
# Usage: bench/blas_thread_timeout.sh [ROUNDS] [VALUES...]   (default: 3 4 16 20 28)
B=${B:-$(dirname "$0")/../build/dtactor}
rounds=${1:-3}; shift || true
values=${*:-4 16 20 28}
for r in $(seq "$rounds"); do for t in $values; do
  D=$(mktemp -d)
  OPENBLAS_THREAD_TIMEOUT=$t /usr/bin/time -f "%S" -o "$D/time" "$B" train --run-dir "$D/run" --set train.max_steps=300 --set eval.every_steps=0 \
    --set eval.max_samples=500 --set checkpoint.every_steps=0 --set train.log_every_steps=10 >/dev/null 2>&1
  /usr/bin/python3.11 - "$D" "$t" "$r" <<'PY'
import json, statistics, sys
d, t, r = sys.argv[1:]
st = [json.loads(l) for l in open(d + "/run/journal.jsonl")]
st = [e for e in st if e.get("event") == "step"]
st = st[len(st) // 4:]
rates = [(b["step"] - a["step"]) * 128 / (b["t"] - a["t"]) for a, b in zip(st, st[1:])]
print(json.dumps({"bench": "blas_thread_timeout", "openblas_thread_timeout": int(t), "round": int(r),
                  "samples_per_s": round(statistics.median(rates)), "sys_s": float(open(d + "/time").read().split()[-1])}))
PY
  rm -rf "$D"
done; done
