#!/usr/bin/python3.11
"""DiLoCo workers that are whole hosts (train.diloco_worker = host) against
every rank a worker, and against synchronous training: 2 node hosts x 2
ranks (1 thread each) and a coordinator host, network namespaces on a test
switch (scripts/netns/hosts.sh), links capped by tbf (--cap). The ViT's
default model and global batch, --steps steps, evaluated every --eval
steps and at the end (test accuracy at equal samples), plus samples/s over
the steady part (samples / wall time between the journal's step events
after the first fifth, boundaries included) and the pseudo-gradient bytes
a host's leader sends per sample (outer_step events; hierarchical: one
rank per host crosses).

Usage (root): bench/diloco_host_workers.py [--cap 10mbit] [--steps 1000]
  [--every 50] [--eval 250] [--modes every_step,diloco:rank,diloco:host]
  [--set KEY=VALUE ...] [--dtactor build/dtactor] [--out FILE]"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_meta  # noqa: E402
from bench_hosts import HOSTS, each_cap  # noqa: E402

TAG = "dthw"
BATCH = 128


def run(binary, steps, every, eval_every, mode, extra, log_dir, name):
    sync, _, worker = mode.partition(":")
    with tempfile.TemporaryDirectory() as rd:
        sets = ["train.max_steps=%d" % steps, "eval.every_steps=%d" % eval_every, "checkpoint.every_steps=0", "train.log_every_steps=1",
                "cluster.min_nodes=2", "cluster.max_nodes=2", "cluster.settle_ms=600000", "train.sync=" + sync, *extra]
        if sync == "diloco":
            sets += ["train.sync_every=%d" % every, "train.diloco_worker=" + (worker or "rank")]
        args = [x for s in sets for x in ("--set", s)]
        logs = [open(os.path.join(log_dir, name + n), "w") for n in ("coordinator.log", "node1.log", "node2.log")]
        coord = subprocess.Popen([HOSTS, "run", TAG, "0", binary, "--role", "coordinator", "--listen", "tcp://198.18.0.1:29400", "--run-dir", rd,
                                  "--no-resume", *args], stdout=logs[0], stderr=subprocess.STDOUT)
        nodes = [subprocess.Popen([HOSTS, "run", TAG, str(h), binary, "--role", "node", "--coordinator", "tcp://198.18.0.1:29400", "--node-id",
                                   "n%d" % h, "--nproc-per-node", "2", "--threads-per-rank", "1"], stdout=logs[h], stderr=subprocess.STDOUT)
                 for h in (1, 2)]
        rc = coord.wait(timeout=7200)
        for n in nodes:
            n.wait(timeout=120)
        if rc != 0:
            raise SystemExit("dtactor run %s failed (exit %d); logs in %s" % (name, rc, log_dir))
        journal = [json.loads(l) for l in open(os.path.join(rd, "journal.jsonl"))]
    steps_ev = [e for e in journal if e["event"] == "step" and e["world_size"] == 4]
    steady = [e for e in steps_ev if e["step"] >= steps // 5]
    out = {"samples_per_s": round((steady[-1]["step"] - steady[0]["step"]) * BATCH / (steady[-1]["t"] - steady[0]["t"]), 1),
           "evals": [{"step": e["step"], "accuracy": e.get("accuracy")} for e in journal if e["event"] == "eval"]}
    outer = [e for e in journal if e["event"] == "outer_step"]
    if outer:
        out["outer_steps"] = len(outer)
        out["pseudo_gradient_bytes_per_sample"] = round(sum(e["payload_bytes"] for e in outer) / (outer[-1]["step"] * BATCH), 2)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cap", default="10mbit")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--eval", type=int, default=250)
    ap.add_argument("--modes", default="every_step,diloco:rank,diloco:host")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--dtactor", default=os.path.join(os.path.dirname(HERE), "build", "dtactor"))
    ap.add_argument("--out", default=os.path.join(HERE, "diloco_host_workers_results.json"))
    a = ap.parse_args()
    log_dir = tempfile.mkdtemp(prefix="diloco-host-workers-")
    results = {"setup": "2 node hosts x 2 ranks (1 thread each) + a coordinator host, tbf on every link; ViT default model, global batch 128",
               "cap": a.cap, "steps": a.steps, "sync_every": a.every, "logs": log_dir, "runs": {}}
    for cap in each_cap(TAG, [a.cap]):
        for mode in a.modes.split(","):
            r = run(a.dtactor, a.steps, a.every, a.eval, mode, a.set, log_dir, "%s-%s-" % (cap, mode.replace(":", "-")))
            results["runs"][mode] = r
            print(json.dumps({mode: r}), flush=True)
    F = bench_meta.figure
    runs = results["runs"]
    figures = []
    for mode in runs:
        if mode == "every_step" or not runs[mode].get("evals"):
            continue
        who = {"diloco:host": "each host a worker", "diloco:rank": "each rank a worker"}.get(mode, mode)
        anchor = "every_step" if runs.get("every_step", {}).get("evals") else None
        figures.append(F("test accuracy at step %s, %s" % (runs[mode]["evals"][-1].get("step"), who), ["runs", mode, "evals", -1, "accuracy"],
                         "accuracy", anchor, ["runs", "every_step", "evals", -1, "accuracy"] if anchor else None))
        figures.append(F("samples/s, %s" % who, ["runs", mode, "samples_per_s"], "samples/s", anchor,
                         ["runs", "every_step", "samples_per_s"] if anchor else None))
    bench_meta.write(a.out, results, "Hosts as DiLoCo workers: 2 namespace hosts x 2 ranks at %s, %d steps, H = %d%s"
                     % (a.cap, a.steps, a.every, " (%s)" % ", ".join(a.set) if a.set else ""), "DiLoCo and thin links", figures)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
