#!/usr/bin/python3.11
"""Several ranks per host: what the network costs, and what the hierarchical
exchange saves. The same job (ViT default config: model and global batch
128, 1 compute thread per rank) in each layout, with every host link capped
by tbf at each rate (scripts/netns/hosts.sh; the coordinator on a host of
its own):

  1x2       one host, 2 ranks (gradients over shared memory only)
  1x4       one host, 4 ranks (shared memory only)
  2x2       2 hosts x 2 ranks, hierarchical (the default): each host sums
            through shared memory, one rank per host allreduces over Gloo
  2x2-flat  2 hosts x 2 ranks with cluster.shm_allreduce=false: all 4 ranks
            allreduce over Gloo (what the exchange was before)

This machine has 2 cores: 4 ranks of 1 thread share them, so 1x4 is the
compute-bound reference for 2x2 (the same world, the same additions), and
2x2 / 1x4 is the cost of the network at that cap. Prints JSON per cap and
writes bench/hosts_ranks_results.json.

Usage (root): bench/bench_hosts_ranks.py [--caps 10gbit,1gbit,100mbit]
  [--layouts 1x2,1x4,2x2,2x2-flat] [--steps 300] [--repeats 1] [--wire fp32]
samples/s: the journaled figure, median over the steps after the first
fifth, then the median over repeats."""
import argparse
import os
import statistics
import tempfile

import bench_meta
from bench_hosts import each_cap, report_cap, run_dtactor, write_results

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TAG = "dtbr"
LAYOUTS = {"1x2": ([2], []), "1x4": ([4], []), "2x2": ([2, 2], []), "2x2-flat": ([2, 2], ["cluster.shm_allreduce=false"])}


def run(binary, steps, layout, wire, log_dir):
    per_host, extra = LAYOUTS[layout]
    return run_dtactor(binary, steps, wire, log_dir, extra, per_host, TAG, layout + "-")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--caps", default="10gbit,1gbit,100mbit")
    ap.add_argument("--layouts", default="1x2,1x4,2x2,2x2-flat")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--wire", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--dtactor", default=os.path.join(ROOT, "build", "dtactor"))
    ap.add_argument("--out", default=os.path.join(HERE, "hosts_ranks_results.json"))
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench_hosts_ranks.py: needs root (network namespaces)")
    layouts = a.layouts.split(",")
    for l in layouts:
        if l not in LAYOUTS:
            raise SystemExit("bench_hosts_ranks.py: unknown layout '%s' (use %s)" % (l, ",".join(LAYOUTS)))
    log_dir = tempfile.mkdtemp(prefix="bench-hosts-ranks-")
    results = {"config": "ViT default (examples/vit_fashion_mnist.toml model), global batch 128, 1 thread per rank, 2 cores",
               "steps": a.steps, "repeats": a.repeats, "wire": a.wire, "caps": {}}
    for cap in each_cap(TAG, a.caps.split(",")):
        runs = {}
        for _ in range(a.repeats):
            for l in layouts:
                runs.setdefault(l, []).append(run(a.dtactor, a.steps, l, a.wire, log_dir))
        summary = {l: {k: statistics.median(r[k] for r in rs) for k in rs[0]} | {"runs": rs} for l, rs in runs.items()}
        for a_, b_ in (("2x2", "1x4"), ("2x2", "2x2-flat"), ("2x2", "1x2")):
            if a_ in summary and b_ in summary:
                summary["%s_vs_%s" % (a_, b_)] = summary[a_]["samples_per_s"] / summary[b_]["samples_per_s"]
        report_cap(results, cap, summary)
    F = bench_meta.figure
    figures = [F("%s: samples/s, 2 hosts x 2 ranks" % cap, ["caps", cap, "2x2", "samples_per_s"], "samples/s", "1 host x 4 ranks",
                 ["caps", cap, "1x4", "samples_per_s"]) for cap in results["caps"]]
    figures += [F("%s: samples/s, 2 hosts x 2 ranks" % cap, ["caps", cap, "2x2", "samples_per_s"], "samples/s",
                  "a flat ring over the 4 ranks", ["caps", cap, "2x2-flat", "samples_per_s"]) for cap in list(results["caps"])[:1]]
    write_results(results, a.out, "Several ranks a host: 2 namespace hosts x 2 ranks (hierarchical) against 1 host x 4, capped links, "
                  "%d repeats" % a.repeats, figures)


if __name__ == "__main__":
    main()
