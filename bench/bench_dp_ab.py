#!/usr/bin/python3
"""A paired A/B of two bench_dp binaries (the build before a change and the
build after it) at world 2: rounds of one run of each, their order
alternating round by round, for each exchange (shared memory, and Gloo with
--shm 0), so that what else runs on the machine weighs on both alike.
Writes each run's samples/s (bench_dp's median of its repeats, and its best
repeat: the least disturbed on a shared machine), CPU and exposed exchange
time a step, the medians and the ratios (new / old), with
bench/bench_meta.py's header.

    bench/bench_dp_ab.py --old /tmp/bench_dp_before --new build/bench/bench_dp \\
        --rounds 10 --out bench/exchange_registry_ab_results.json \\
        --notes "old: main at 1d1cf18; new: the exchange registry"
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_meta  # noqa: E402


def run_once(binary, shm, steps, repeats):
    out = subprocess.run([binary, "--worlds", "2", "--steps", str(steps), "--repeats", str(repeats), "--shm", str(shm)],
                         check=True, capture_output=True, text=True, timeout=900).stdout
    w = json.loads(out)["world_2"]
    # The best repeat: the one least disturbed by whatever else ran.
    return {"samples_per_s": w["samples_per_s"], "best_samples_per_s": max(w["samples_per_s_runs"]),
            "cpu_ms_per_step": 1000 * w["cpu_s_per_step"], "exposed_ms_per_step": 1000 * w["exposed_allreduce_s_per_step"],
            "params_digest": w["params_digest"], "shared_memory": w["shared_memory"]}


def summary(runs_old, runs_new):
    old = [r["samples_per_s"] for r in runs_old]
    new = [r["samples_per_s"] for r in runs_new]
    # Per-round ratios: each pair ran back to back, under the same load.
    ratios = [n / o for n, o in zip(new, old)]
    best_old = [r["best_samples_per_s"] for r in runs_old]
    best_new = [r["best_samples_per_s"] for r in runs_new]
    return {"old_samples_per_s": old, "new_samples_per_s": new,
            "old_median": statistics.median(old), "new_median": statistics.median(new),
            "ratio_of_medians": statistics.median(new) / statistics.median(old),
            "paired_ratio_median": statistics.median(ratios),
            "best_old_median": statistics.median(best_old), "best_new_median": statistics.median(best_new),
            "best_paired_ratio_median": statistics.median(n / o for n, o in zip(best_new, best_old)),
            "cpu_ms_per_step_old_median": statistics.median(r["cpu_ms_per_step"] for r in runs_old),
            "cpu_ms_per_step_new_median": statistics.median(r["cpu_ms_per_step"] for r in runs_new),
            "exposed_ms_per_step_old_median": statistics.median(r["exposed_ms_per_step"] for r in runs_old),
            "exposed_ms_per_step_new_median": statistics.median(r["exposed_ms_per_step"] for r in runs_new),
            "same_parameters": all(a["params_digest"] == b["params_digest"] for a, b in zip(runs_old, runs_new)),
            "shared_memory_used": [runs_new[0]["shared_memory"], runs_old[0]["shared_memory"]]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="bench_dp built before the change")
    ap.add_argument("--new", required=True, help="bench_dp built after it")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="bench_dp at world 2, paired A/B of two builds")
    ap.add_argument("--notes", default=None)
    a = ap.parse_args()
    result = {"what": "bench_dp --worlds 2 --steps %d --repeats %d (ViT example, global batch 128, 1 thread a rank), %d rounds "
                      "of one run of each build, order alternating; samples_per_s is bench_dp's median per run" % (a.steps, a.repeats, a.rounds)}
    for name, shm in (("shared_memory", 1), ("gloo", 0)):
        runs = {"old": [], "new": []}
        for i in range(a.rounds):
            for which in (("old", "new") if i % 2 == 0 else ("new", "old")):
                runs[which].append(run_once(a.old if which == "old" else a.new, shm, a.steps, a.repeats))
            print("%s round %d: old %.0f new %.0f" % (name, i, runs["old"][-1]["samples_per_s"], runs["new"][-1]["samples_per_s"]),
                  file=sys.stderr, flush=True)
        result[name] = summary(runs["old"], runs["new"])
    bench_meta.write(a.out, result, title=a.title, group="Throughput", figures=figures_of(), notes=a.notes)


def figures_of():
    # Medians of single runs swing with the machine's load (bimodal on a
    # shared machine): the paired ratios and the best repeats are the figures.
    figures = []
    for name, what in (("shared_memory", "shared memory"), ("gloo", "Gloo (--shm 0)")):
        figures.append(bench_meta.figure("new / old over %s (median of the paired ratios)" % what, [name, "paired_ratio_median"], "x"))
        figures.append(bench_meta.figure("samples/s over %s, each run's best repeat (median), the new build" % what, [name, "best_new_median"],
                                         "samples/s", anchor="the build before", anchor_at=[name, "best_old_median"]))
        figures.append(bench_meta.figure("CPU a step over %s (median), the new build" % what, [name, "cpu_ms_per_step_new_median"], "ms",
                                         anchor="the build before", anchor_at=[name, "cpu_ms_per_step_old_median"]))
    return figures


if __name__ == "__main__":
    main()
