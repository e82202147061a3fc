#!/usr/bin/python3
"""A paired A/B of two dtactor builds on the default job as a newcomer runs
it: `dtactor local --nodes 2` (the default ViT on Fashion-MNIST, default
settings) for --steps steps, rounds of one run of each build, their order
alternating round by round, so that what else runs on the machine weighs on
both alike. A run's figure is its samples/s from the journal over the steps
after the first 100 (warm-up and the join out of it); the summary is the
median of each build's runs and the median of the per-round ratios
(new / old), with bench/bench_meta.py's header.

    bench/local_ab.py --old /tmp/base/build/dtactor --new build/dtactor \\
        --rounds 5 --steps 600 --out bench/local_ab_results.json --notes "old: ...; new: ..."
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_meta  # noqa: E402


def run_once(binary, steps):
    with tempfile.TemporaryDirectory() as d:
        run_dir = os.path.join(d, "run")
        cmd = [binary, "local", "--nodes", "2", "--run-dir", run_dir, "--metrics-port", "0", "--set", "train.max_steps=%d" % steps]
        # Each build's libraries from its own directory (a copied build runs
        # with its own libdtactor, not the one its RUNPATH names).
        env = dict(os.environ, LD_LIBRARY_PATH=os.path.dirname(os.path.abspath(binary)))
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800, env=env)
        steps_seen = [json.loads(l) for l in open(os.path.join(run_dir, "journal.jsonl")) if '"event":"step"' in l]
        a = [s for s in steps_seen if s["step"] >= 100]
        batch = next(int(l.split("=")[1]) for l in open(os.path.join(run_dir, "config.toml")) if l.strip().startswith("global_batch_size"))
        span = a[-1]["t"] - a[0]["t"]
        fin = [json.loads(l) for l in open(os.path.join(run_dir, "journal.jsonl")) if '"event":"job_finished"' in l]
        return {"samples_per_s": (a[-1]["step"] - a[0]["step"]) * batch / span,
                "accuracy": fin[-1].get("accuracy") if fin else None, "world_size": a[-1]["world_size"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "local_ab_results.json"))
    ap.add_argument("--notes", default="")
    a = ap.parse_args()
    old, new = [], []
    for r in range(a.rounds):
        order = [("old", a.old), ("new", a.new)] if r % 2 == 0 else [("new", a.new), ("old", a.old)]
        for name, binary in order:
            res = run_once(binary, a.steps)
            (old if name == "old" else new).append(res)
            print(r, name, json.dumps(res), flush=True)
    ratios = [n["samples_per_s"] / o["samples_per_s"] for n, o in zip(new, old)]
    result = {"steps": a.steps, "rounds": a.rounds,
              "old": {"runs": old, "median_samples_per_s": statistics.median(x["samples_per_s"] for x in old)},
              "new": {"runs": new, "median_samples_per_s": statistics.median(x["samples_per_s"] for x in new)},
              "ratio_new_over_old": {"per_round": ratios, "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}}
    F = bench_meta.figure
    figures = [F("the default job, dtactor local --nodes 2: samples/s now against the build before (median of per-round ratios)",
                 ["ratio_new_over_old", "median"], "x"),
               F("now: samples/s (median)", ["new", "median_samples_per_s"], "samples/s"),
               F("the build before: samples/s (median)", ["old", "median_samples_per_s"], "samples/s")]
    bench_meta.write(a.out, result, title="The default job against the build before a change (paired A/B)", group="Throughput",
                     figures=figures, notes=a.notes)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
