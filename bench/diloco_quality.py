#!/usr/bin/python3.11
"""Quality at equal samples: train.sync = every_step against diloco at
several H (train.sync_every), the same job otherwise (`dtactor local`,
default settings unless --set), evaluated at the end. Prints one JSON line
per run and writes the whole JSON.

Usage: bench/diloco_quality.py [--nodes 2] [--steps 1000] [--every 10,50,100]
  [--streaming 50:5:1:0.5,...] (Streaming DiLoCo runs, H:fragments:overlap:mix)
  [--no-every-step] [--config examples/gpt_gcide.toml] [--set KEY=VALUE ...] [--dtactor build/dtactor] [--out bench/diloco_quality_results.json]"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_meta  # noqa: E402


def run(binary, nodes, steps, sets, config):
    with tempfile.TemporaryDirectory() as rd:
        args = [binary, "local", "--nodes", str(nodes), "--run-dir", rd, "--no-resume"]
        if config:
            args += ["--config", config]
        for s in ["train.max_steps=%d" % steps, "checkpoint.every_steps=0", "train.log_every_steps=100", *sets]:
            args += ["--set", s]
        t0 = time.time()
        p = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wall = time.time() - t0
        if p.returncode != 0:
            raise SystemExit("run failed: " + p.stdout[-3000:])
        journal = [json.loads(l) for l in open(os.path.join(rd, "journal.jsonl"))]
    evals = [e for e in journal if e["event"] == "eval"]
    return {"wall_s": round(wall, 1),
            "evals": [{k: v for k, v in e.items() if k not in ("t", "event", "duration_s", "examples")} for e in evals]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--every", default="10,50,100")
    ap.add_argument("--streaming", default="")
    ap.add_argument("--no-every-step", action="store_true")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--config", default="", help="a job config (e.g. examples/gpt_gcide.toml); --steps and --set still apply")
    ap.add_argument("--dtactor", default=os.path.join(os.path.dirname(HERE), "build", "dtactor"))
    ap.add_argument("--out", default=os.path.join(HERE, "diloco_quality_results.json"))
    a = ap.parse_args()
    results = {"config": a.config, "nodes": a.nodes, "steps": a.steps, "sets": a.set, "runs": {}}
    modes = [] if a.no_every_step else [("every_step", ["train.sync=every_step"])]
    modes += [("diloco H=%s" % h, ["train.sync=diloco", "train.sync_every=" + h]) for h in a.every.split(",") if h]
    for spec in filter(None, a.streaming.split(",")):
        h, f, tau, mix = spec.split(":")
        modes.append(("streaming H=%s F=%s overlap=%s mix=%s" % (h, f, tau, mix),
                      ["train.sync=diloco", "train.sync_every=" + h, "train.sync_fragments=" + f, "train.sync_overlap=" + tau, "train.sync_mix=" + mix]))
    for name, sets in modes:
        r = run(a.dtactor, a.nodes, a.steps, a.set + sets, a.config)
        results["runs"][name] = r
        print(json.dumps({name: r}), flush=True)
    # The page's figures: each run's last evaluation (accuracy, else the
    # validation loss) against every_step's where it ran.
    F = bench_meta.figure
    runs = results["runs"]
    figures = []
    for name, r in runs.items():
        if name == "every_step" or not r.get("evals"):
            continue
        last = r["evals"][-1]
        metric, unit = ("accuracy", "accuracy") if "accuracy" in last else ("val_loss", "loss")
        what = "%s at step %s, %s" % ("test accuracy" if metric == "accuracy" else "validation loss", last.get("step"), name)
        anchor = "every_step" if runs.get("every_step", {}).get("evals") and metric in runs["every_step"]["evals"][-1] else None
        figures.append(F(what, ["runs", name, "evals", -1, metric], unit, anchor,
                         ["runs", "every_step", "evals", -1, metric] if anchor else None))
    bench_meta.write(a.out, results, "DiLoCo's quality at equal samples: %s, %d workers, %d steps%s"
                     % (a.config or "the ViT (default job)", a.nodes, a.steps, " (%s)" % ", ".join(a.set) if a.set else ""),
                     "DiLoCo and thin links", figures)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
