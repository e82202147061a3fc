#!/usr/bin/python3.11
"""Two ranks on one machine: dtactor local against PyTorch DDP under torchrun,
the same ViT (the default job's), global batch 128, one thread a rank.

Each repeat runs, one after the other (which goes first alternates):
  dtactor: build/bench/bench_runtime --modes local2 --repeats 1 --steps N
           (`dtactor local --nodes 2 --nproc-per-node 1 --set train.threads=1`;
           samples/s from the wall time between journaled steps)
  DDP:     python3 -m torch.distributed.run --nnodes=1 --nproc_per_node=2
           bench/ddp_vit.py --steps N (Gloo; samples/s from the median step
           time after the first fifth)
and reports the medians and the median of the per-repeat ratios.

Usage: bench/ddp_local.py [--repeats 3] [--steps 400] [--runtime build/bench/bench_runtime]
                          [--out bench/ddp_local_results.json]"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import bench_meta  # noqa: E402
from bench_net import free_port  # noqa: E402


def run_dtactor(a):
    out = subprocess.run([a.runtime, "--modes", "local2", "--repeats", "1", "--steps", str(a.steps)], cwd=ROOT, check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out)["modes"]["local2"]["samples_per_s_median"]


def run_ddp(a):
    cmd = ["/usr/bin/python3", "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2", "--master_port=%d" % free_port(),
           # torchrun 1.13 under Python 3.11 cannot parse its default "0" for
           # these (Std.NONE is not iterated by 3.11's enum): tee instead.
           "--redirects", "1", "--tee", "1", "--log_dir", tempfile.mkdtemp(prefix="ddp-local-"),
           os.path.join(HERE, "ddp_vit.py"), "--steps", str(a.steps)]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1")).stdout
    line = [l for l in out.splitlines() if "{" in l][-1]
    return json.loads(line[line.index("{"):])["samples_per_s"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--runtime", default=os.path.join(ROOT, "build", "bench", "bench_runtime"))
    ap.add_argument("--out", default=os.path.join(HERE, "ddp_local_results.json"))
    a = ap.parse_args()
    runs = []
    for r in range(a.repeats):
        first, second = (run_dtactor, run_ddp) if r % 2 == 0 else (run_ddp, run_dtactor)
        x = {first.__name__: first(a), second.__name__: second(a)}
        run = {"dtactor_samples_per_s": round(x["run_dtactor"], 1), "ddp_samples_per_s": round(x["run_ddp"], 1),
               "first": "dtactor" if first is run_dtactor else "ddp"}
        run["ratio"] = round(run["dtactor_samples_per_s"] / run["ddp_samples_per_s"], 3)
        print(json.dumps(run), flush=True)
        runs.append(run)
    result = {"setup": "one machine, 2 ranks x 1 thread, the default job's ViT, global batch 128, %d steps" % a.steps,
              "dtactor_samples_per_s_median": statistics.median(r["dtactor_samples_per_s"] for r in runs),
              "ddp_samples_per_s_median": statistics.median(r["ddp_samples_per_s"] for r in runs),
              "dtactor_over_ddp_paired_median": statistics.median(r["ratio"] for r in runs),
              "runs": runs}
    F = bench_meta.figure
    bench_meta.write(a.out, result, "Two ranks on one machine: dtactor local against PyTorch DDP under torchrun, the default ViT",
                     "Throughput", [
                         F("samples/s, 2 ranks on one machine (median of the repeats)", ["dtactor_samples_per_s_median"], "samples/s",
                           "PyTorch DDP under torchrun", ["ddp_samples_per_s_median"]),
                         F("dtactor over DDP, the median of the per-repeat ratios", ["dtactor_over_ddp_paired_median"], "x"),
                     ], notes="dtactor's samples/s: bench_runtime's, from the wall time between journaled steps (everything between steps counts); DDP's: the global batch over ddp_vit.py's median step time after the first fifth (the batch indexing excluded)")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
