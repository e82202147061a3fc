#!/usr/bin/python3
"""Do the ZeRO levels train the same model with clipping on? The default
ViT (examples/vit_fashion_mnist.toml, grad_clip 1.0) at worlds 2 and 3
(`dtactor local --nodes W`, a rank each) for --steps steps at train.zero
0, 1 and 2, over Gloo (cluster.shm_allreduce = false) and over shared
memory. Each run's final parameters are exported (`dtactor export
--state-dict`) and compared with zero = 0's over the same transport: the
largest absolute difference of any parameter element, whether the
parameter digests are equal, and each run's test accuracy (the job's final
evaluation). Over shared memory the levels sum every gradient element in
the same order, and the clipping norm is the same ranges added in the same
order (docs/zero.md), so the digests are equal. Over Gloo the ring (zero
0, 1) and the all-to-all (zero 2) add the ranks in other orders: at world
2 that changes no bit (a sum of two is the same either way round), from
world 3 the parameters drift apart by rounding. One run a configuration: the runs are
deterministic (a configuration repeated gives the same digest), so there
is nothing to take a median of but the step time, which is printed for
reference only (the machine is shared). A run whose job re-planned (a node
lost for a while on a loaded machine: steps at another world size) is
discarded and repeated.

Usage: bench/zero_levels_equal.py [--steps 1000] [--levels 0,1,2]
       [--worlds 2,3] [--transports gloo,shm] [--bin build/dtactor] [--out FILE]
Writes bench/zero_levels_equal_results.json (or --out) and prints it.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_meta  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
ap = argparse.ArgumentParser()
ap.add_argument("--bin", default=os.path.join(ROOT, "build", "dtactor"))
ap.add_argument("--config", default=os.path.join(ROOT, "examples", "vit_fashion_mnist.toml"))
ap.add_argument("--steps", type=int, default=1000)
ap.add_argument("--levels", default="0,1,2")
ap.add_argument("--transports", default="gloo,shm")
ap.add_argument("--worlds", default="2,3")
ap.add_argument("--out", default=os.path.join(ROOT, "bench", "zero_levels_equal_results.json"))
a = ap.parse_args()
LEVELS = [int(x) for x in a.levels.split(",")]
TRANSPORTS = a.transports.split(",")
WORLDS = [int(x) for x in a.worlds.split(",")]
if 0 not in LEVELS:
    sys.exit("--levels must include 0 (the reference)")


def journal(d):
    with open(os.path.join(d, "journal.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def run(world, transport, level, d):
    sets = [f"train.zero={level}", f"train.max_steps={a.steps}", f"eval.every_steps={a.steps}", f"checkpoint.every_steps={a.steps}",
            "train.log_every_steps=1", f"cluster.min_nodes={world}", f"cluster.max_nodes={world}",
            f"cluster.shm_allreduce={'true' if transport == 'shm' else 'false'}"]
    cmd = [a.bin, "local", "--nodes", str(world), "--nproc-per-node", "1", "--config", a.config, "--run-dir", d, "--no-resume"]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.monotonic()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=3600)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)}: exit {p.returncode}\n{p.stdout[-3000:]}")
    events = journal(d)
    fin = [e for e in events if e.get("event") == "job_finished"]
    if not fin:
        sys.exit(f"{d}: no job_finished event")
    steps = [e["step_s"] for e in events if e.get("event") == "step" and e.get("step", 0) > 2]
    gens = {e.get("generation") for e in events if e.get("event") == "step"}
    out = os.path.join(d, "params.pt")
    e = subprocess.run([a.bin, "export", d, "--out", out, "--state-dict"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if e.returncode != 0:
        sys.exit(f"export of {d}: exit {e.returncode}\n{e.stdout[-2000:]}")
    return {"world": world, "transport": transport, "zero": level, "accuracy": fin[-1].get("accuracy"), "val_loss": fin[-1].get("val_loss"),
            "params_digest": fin[-1].get("params_digest"), "step": fin[-1].get("step"), "generations": len(gens),
            "median_step_s": statistics.median(steps) if steps else None, "wall_s": round(wall, 1)}, out


def comparable_run(world, transport, level, top, tries=3):
    """A run that trained in one generation. A job that re-planned (on a
    loaded machine a node may miss its heartbeat timeout and be lost for a
    while) trained some steps at another world size, so its parameters say
    nothing about the ZeRO level: such a run is repeated, and the row says
    how many were discarded."""
    for attempt in range(tries):
        d = os.path.join(top, f"w{world}-{transport}-zero{level}-{attempt}")
        os.makedirs(d)
        row, path = run(world, transport, level, d)
        if row["generations"] == 1:
            row["runs_discarded_for_a_replan"] = attempt
            return row, path
        print(f"world {world} {transport} zero={level}: the job re-planned ({row['generations']} generations); running it again",
              file=sys.stderr, flush=True)
    sys.exit(f"world {world} {transport} zero={level}: the job re-planned in each of {tries} runs; nothing comparable")


def params(path):
    import torch
    sd = torch.load(path)
    return {k: v for k, v in sd.items() if torch.is_tensor(v) and v.is_floating_point()}


def largest_difference(x, y):
    if x.keys() != y.keys():
        sys.exit("the exports hold different tensors")
    return max(float((x[k].double() - y[k].double()).abs().max()) for k in x)


def main():
    rows = []
    with tempfile.TemporaryDirectory() as top:
        for world in WORLDS:
            for transport in TRANSPORTS:
                ref = None
                for level in LEVELS:
                    row, path = comparable_run(world, transport, level, top)
                    p = params(path)
                    if level == 0:
                        ref, ref_digest = p, row["params_digest"]
                    row["largest_abs_difference_vs_zero0"] = largest_difference(p, ref)
                    row["digest_equals_zero0"] = row["params_digest"] == ref_digest
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    rows.append(row)

    def at(world, transport, level, key):
        i = next(i for i, r in enumerate(rows) if r["world"] == world and r["transport"] == transport and r["zero"] == level)
        return ["rows", i, key]

    figures = []
    for world in WORLDS:
        for transport in TRANSPORTS:
            for level in LEVELS:
                if level == 0:
                    continue
                name = f"world {world}, " + ("Gloo" if transport == "gloo" else "shared memory") + f", zero={level}"
                figures.append(bench_meta.figure(f"{name}: largest parameter difference from zero=0 after {a.steps} steps",
                                                 at(world, transport, level, "largest_abs_difference_vs_zero0"), "count"))
                figures.append(bench_meta.figure(f"{name}: test accuracy", at(world, transport, level, "accuracy"), "accuracy",
                                                 anchor="zero=0", anchor_at=at(world, transport, 0, "accuracy")))
    result = {"steps": a.steps, "worlds": WORLDS, "config": os.path.relpath(a.config, ROOT), "grad_clip": 1.0, "rows": rows}
    notes = ("2 shared cores, loaded by other builds and tests (load average above 2): step times are for reference only. "
             "One run a configuration: runs are deterministic. A difference of 0 with equal digests is bit for bit.")
    out = bench_meta.write(a.out, result,
                           title=f"ZeRO levels against zero=0 with clipping on: the default ViT at worlds {a.worlds}, {a.steps} steps, over Gloo and over shared memory",
                           group="Sharded state (ZeRO)", figures=figures, notes=notes)
    print(json.dumps(out, indent=1))


main()
