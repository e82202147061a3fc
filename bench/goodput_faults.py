#!/usr/bin/python3
"""Goodput under faults: the default job (the ViT on Fashion-MNIST,
`dtactor local --nodes 2`, default settings) trained for about ten minutes
with a node killed (SIGKILL to the node and its ranks) every 60 s of
training and a replacement started once the survivors train again
(`dtactor local --chaos --chaos-every 60`), against the same job with no
fault, the same number of steps, in one run (the arms alternate when
--rounds > 1).

From each run's journal:
  goodput        the last `goodput` line: productive time over wall time and
                 where the rest went (monitoring/goodput.hpp defines them)
  kills          nodes the chaos monkey killed (its summary line)
  lost_steps     completed steps that no generation resumed from (the sum of
                 recovery_done lost_steps)
  accuracy       the final evaluation's accuracy
  samples_per_s  the whole run's samples over its wall time (first journal
                 line to job_finished)
and against the fault-free run: the goodput ratio's ratio, the throughput's
ratio, the accuracy's difference in points.

  flock /tmp/dtactor-build.lock /usr/bin/python3 bench/goodput_faults.py [--steps 20000] [--every 60] [--rounds 1] [--out FILE]
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_meta  # noqa: E402
from bench_jobs import journal, named  # noqa: E402

ROOT = os.path.dirname(HERE)
DTACTOR = os.path.join(ROOT, "build", "dtactor")
BATCH = 128  # the default config's train.global_batch_size


def run_job(binary, steps, every_s, faults, run_dir):
    cmd = [binary, "local", "--nodes", "2", "--run-dir", run_dir, "--metrics-port", "0", "--set", "train.max_steps=%d" % steps]
    if faults:
        cmd += ["--chaos", "--chaos-every", str(every_s)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3 * 3600)
    ev = journal(run_dir)
    fin = named(ev, "job_finished")
    if p.returncode != 0 or not fin:
        tail = "\n".join((p.stderr or "").splitlines()[-15:])
        raise RuntimeError("%s exited %d (job_finished: %s):\n%s" % (" ".join(cmd), p.returncode, bool(fin), tail))
    good = named(ev, "goodput")
    evals = named(ev, "eval")
    recov = named(ev, "recovery_done")
    wall = fin[-1]["t"] - ev[0]["t"]
    chaos = [l for l in (p.stderr or "").splitlines() if "node(s) killed" in l]
    return {
        "exit_code": p.returncode,
        "wall_s": round(wall, 2),
        "steps": fin[-1].get("step"),
        "samples_per_s": round(fin[-1].get("step", steps) * BATCH / wall, 1),
        "goodput": {k: v for k, v in good[-1].items() if k not in ("event", "t")} if good else None,
        "kills": int(re.search(r"(\d+) node\(s\) killed", chaos[-1]).group(1)) if chaos else 0,
        "nodes_lost": len(named(ev, "node_lost")),
        "joins": len(named(ev, "node_joined")),
        "generations": len(named(ev, "generation_started")),
        "lost_steps": sum(r.get("lost_steps", 0) for r in recov),
        "recovery_duration_s": [round(r.get("duration_s", 0), 3) for r in recov],
        "accuracy": evals[-1].get("accuracy") if evals else None,
        "chaos_summary": chaos[-1].strip() if chaos else None,
    }


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", default=DTACTOR)
    ap.add_argument("--steps", type=int, default=20000, help="steps of each run (20,000: about ten minutes fault-free here)")
    ap.add_argument("--every", type=float, default=60, help="seconds of training between a recovery and the next kill")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(HERE, "goodput_faults_results.json"))
    a = ap.parse_args()
    runs = {"faults": [], "none": []}
    with tempfile.TemporaryDirectory(prefix="dtactor-goodput-") as tmp:
        for r in range(a.rounds):
            for arm in (("faults", "none") if r % 2 == 0 else ("none", "faults")):
                res = run_job(a.binary, a.steps, a.every, arm == "faults", os.path.join(tmp, "%s%d" % (arm, r)))
                runs[arm].append(res)
                print(arm, r, res, flush=True)
    f, n = runs["faults"], runs["none"]
    result = {
        "steps": a.steps,
        "every_s": a.every,
        "rounds": a.rounds,
        "runs": runs,
        "faults": {"goodput_ratio": med(x["goodput"]["ratio"] for x in f), "samples_per_s": med(x["samples_per_s"] for x in f),
                   "kills": med(x["kills"] for x in f), "lost_steps": max(x["lost_steps"] for x in f), "accuracy": med(x["accuracy"] for x in f),
                   "wall_s": med(x["wall_s"] for x in f)},
        "none": {"goodput_ratio": med(x["goodput"]["ratio"] for x in n), "samples_per_s": med(x["samples_per_s"] for x in n),
                 "accuracy": med(x["accuracy"] for x in n), "wall_s": med(x["wall_s"] for x in n)},
    }
    result["goodput_relative"] = result["faults"]["goodput_ratio"] / result["none"]["goodput_ratio"]
    result["throughput_relative"] = result["faults"]["samples_per_s"] / result["none"]["samples_per_s"]
    result["accuracy_points_diff"] = 100 * (result["faults"]["accuracy"] - result["none"]["accuracy"])
    F = bench_meta.figure
    figures = [
        F("goodput (productive over wall time) with a node killed and replaced every %g s" % a.every, ["faults", "goodput_ratio"], "ratio",
          "fault-free", ["none", "goodput_ratio"]),
        F("goodput with faults relative to the fault-free run's", ["goodput_relative"], "x"),
        F("samples/s over the whole run with faults relative to the fault-free run's", ["throughput_relative"], "x"),
        F("nodes killed (each replaced)", ["faults", "kills"], "kills"),
        F("steps lost (completed steps no generation resumed from)", ["faults", "lost_steps"], "steps"),
        F("final accuracy with faults", ["faults", "accuracy"], "accuracy", "fault-free", ["none", "accuracy"]),
    ]
    bench_meta.write(a.out, result, "Goodput under faults: the default job for about ten minutes, a node killed and replaced every %g s, against no fault" % a.every,
                           "Recovery from faults", figures,
                           notes="dtactor local --nodes 2 --chaos --chaos-every %g (default settings otherwise), %d steps, and the same without --chaos" % (a.every, a.steps))
    print("goodput with faults / without: %.3f; samples/s: %.3f; steps lost: %d" % (result["goodput_relative"], result["throughput_relative"], result["faults"]["lost_steps"]))


if __name__ == "__main__":
    main()
