#!/usr/bin/python3.11
"""Checkpoint stall at the default settings against checkpoint.defer_while_writing
= false: bench/bench_state_path.py (the 202M GPT, coordinator + 2 nodes, a
checkpoint due every 2 steps to a directory store, a node killed -9 and
replaced) run once each way, one after the other on the same machine.
With deferral (the default) a checkpoint that falls due while a rank still
stores the previous one is taken at the first step boundary where none does;
without it, the step waits for that write.

Writes bench/checkpoint_defer_results.json: each run's figures, and the
stall's max and median against the median step time.

Usage: bench/checkpoint_defer.py [--steps 10] [--bin build/dtactor]
"""
import argparse, json, os, subprocess, sys

import bench_meta

here = os.path.dirname(os.path.abspath(__file__))
ap = argparse.ArgumentParser()
ap.add_argument("--bin", default=os.path.join(here, "..", "build", "dtactor"))
ap.add_argument("--steps", type=int, default=10)
a = ap.parse_args()


def run(extra):
    cmd = [sys.executable, os.path.join(here, "bench_state_path.py"), "--bin", a.bin, "--steps", str(a.steps)] + extra
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit("bench_state_path.py failed:\n" + p.stdout[-2000:] + p.stderr[-2000:])
    r = json.loads(p.stdout)
    return {k: v for k, v in r.items() if k not in ("meta", "figures")}


result = {"default": run([]), "defer_off": run(["--set", "checkpoint.defer_while_writing=false"])}
F = bench_meta.figure
out = bench_meta.write(
    os.path.join(here, "checkpoint_defer_results.json"), result,
    "Checkpoint stall of the 202M GPT (2.4 GB of state), a checkpoint due every 2 steps to a directory store: the default "
    "(a checkpoint due while a rank still stores the previous one is deferred) against checkpoint.defer_while_writing = false",
    "Checkpoints and the state path", [
        F("longest stall for a checkpoint, default settings", ["default", "stall_s_max"], "s", "defer_while_writing=false",
          ["defer_off", "stall_s_max"]),
        F("longest stall over the median step time, default settings", ["default", "stall_max_over_step"], "x", "defer_while_writing=false",
          ["defer_off", "stall_max_over_step"]),
        F("median stall for a checkpoint, default settings", ["default", "stall_s_median"], "s", "defer_while_writing=false",
          ["defer_off", "stall_s_median"]),
        F("checkpoints committed (a checkpoint due every 2 steps), default settings", ["default", "checkpoints"], "checkpoints", "defer_while_writing=false",
          ["defer_off", "checkpoints"]),
        F("median step time, default settings", ["default", "step_s_median"], "s", "defer_while_writing=false", ["defer_off", "step_s_median"]),
    ],
    cmd="bench/checkpoint_defer.py --steps %d" % a.steps,
    notes="one run each way, the default first, then defer_while_writing=false, on the same machine; each run is bench_state_path.py's "
          "(GPT model.dim=1024 model.layers=16, global batch 4, checkpoint.every_steps=2, node b killed -9 after the first checkpoint at "
          "step 4 or later and replaced by node c); the final step's checkpoint is never deferred")
print(json.dumps(out, indent=1))
