#!/usr/bin/env python3
"""Bytes of training state per parameter per rank with train.zero 0, 1, 2 and 3,
measured: runs `dtactor local` (a coordinator and N node processes on this
machine, each with P rank processes) for a few steps and reads what each rank
reported holding from the journal's `resources` events (param_bytes,
grad_bytes, optimizer_state_bytes, checkpoint_buffer_bytes) and its resident
memory (peak, and between checkpoints). Prints one JSON object:
per configuration the bytes per parameter of each kind (the largest rank),
next to the formula (fp32 parameters 4, with train.precision=bf16 6: the
fp32 masters and the bf16 copy, and from zero 1 on 4*R/W + 2, the masters
sharded; gradients 4 (bf16: and 2 of bf16 ones; at zero 1 the float32
ones 4*R/W) in the optimizer plus 4 in the reducer's buckets at world > 1
for zero 0 and 1, 4*R/W for zero 2;
AdamW moments 8, or 8*R/W when sharded, R holders of each of W shards;
zero 3: parameters 4*R/W, plus 4*(1 - R/W) for each parameter of no unit, which every rank
keeps (bf16: only its copy, 2; its masters are sharded): the rank's READY line gives their count;
bf16 keeps no copy of a unit's parameters between uses).

Usage: bench/zero_state_bytes.py [--binary build/dtactor] [--steps 20] [--set key=value ...]
       [--configs "nodes,ranks_per_node,zero,replicas;..."]   (replicas 0 = the default)
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_meta  # noqa: E402


def run(binary, nodes, nproc, zero, replicas, steps, extra):
    with tempfile.TemporaryDirectory() as d:
        sets = [f"train.zero={zero}", f"train.max_steps={steps}", "checkpoint.every_steps=0", "eval.every_steps=0",
                "train.log_every_steps=1", f"cluster.min_nodes={nodes}",
                # one generation at the full world: planned once every rank is ready
                f"cluster.max_nodes={nodes}", "cluster.settle_ms=600000"] + extra
        if replicas:
            sets.append(f"train.zero_replicas={replicas}")
        cmd = [binary, "local", "--nodes", str(nodes), "--nproc-per-node", str(nproc), "--run-dir", d, "--no-resume"]
        for s in sets:
            cmd += ["--set", s]
        p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=1800)
        if p.returncode != 0:
            sys.exit(f"{' '.join(cmd)}: exit {p.returncode}\n{p.stderr[-3000:]}")
        ranks = {}
        rss_between = []  # the largest rank's resident memory, each resources event before the final checkpoint
        done_training = False
        with open(os.path.join(d, "journal.jsonl")) as f:
            for line in f:
                e = json.loads(line)
                if e.get("event") == "checkpoint_saved":
                    done_training = True
                if e.get("event") != "resources":
                    continue
                for r in e["ranks"]:
                    if "param_bytes" in r:
                        ranks[r["rank"]] = r
                if not done_training and e["ranks"]:
                    rss_between.append(max(r["rss_bytes"] for r in e["ranks"]))
        if not ranks:
            sys.exit(f"{' '.join(cmd)}: no resources event with state bytes")
        world = nodes * nproc
        m = re.search(r"units; (\d+) parameters in none", p.stderr)
        root = int(m.group(1)) if m else 0
        # fp32 parameters: 4 bytes each; train.precision = bf16: the fp32
        # masters and the bf16 copy the module computes with, 6.
        bf16 = "train.precision=bf16" in extra
        params = max(r["param_bytes"] for r in ranks.values()) / (6 if bf16 else 4)
        masters_sharded = zero >= 3 or (bf16 and zero >= 1 and world > 1)
        if masters_sharded:  # a rank reports what is resident: its shards (and at zero 3 the root)
            pm = re.search(r"this rank holds \d+ of (\d+) elements", p.stderr)
            if not pm:
                sys.exit(f"{' '.join(cmd)}: no READY line with the elements of the model")
            params = int(pm.group(1))
        r_eff = replicas or (2 if nodes > 1 else 1)
        r_eff = min(r_eff, world)
        per = lambda k: max(r[k] for r in ranks.values()) / params
        out = {
            "nodes": nodes, "ranks_per_node": nproc, "world": world, "zero": zero, "replicas": r_eff if zero else None,
            "parameters": int(params),
            "param_bytes_per_param": per("param_bytes"),
            "grad_bytes_per_param": per("grad_bytes"),
            "optimizer_bytes_per_param": per("optimizer_state_bytes"),
            "formula_optimizer_bytes_per_param": 8.0 * (r_eff / world if zero else 1.0),
            "peak_rss_bytes_max_rank": max(r["peak_rss_bytes"] for r in ranks.values()),
            # between checkpoints (resources events before the final one): the median
            "rss_bytes_between_checkpoints_max_rank": sorted(rss_between)[len(rss_between) // 2] if rss_between else None,
            # the host buffer a rank's checkpoint part is staged in (checkpoint.keep_buffer), formula 12/W
            "checkpoint_buffer_bytes_per_param": per("checkpoint_buffer_bytes") if all("checkpoint_buffer_bytes" in r for r in ranks.values()) else 0.0,
            "formula_checkpoint_buffer_bytes_per_param": 12.0 / world,
        }
        out["total_bytes_per_param"] = out["param_bytes_per_param"] + out["grad_bytes_per_param"] + out["optimizer_bytes_per_param"]
        buckets = 4.0 if world > 1 else 0.0  # the reducer's, float32 either way
        if zero >= 2:
            grads = 4.0 * r_eff / world
        elif bf16 and zero == 1:
            # the whole bf16 gradients, and float32 ones for the held windows only
            grads = 2.0 + 4.0 * r_eff / world + buckets
        else:
            # bf16: the bf16 gradients beside the float32 ones
            grads = 4.0 + buckets + (2.0 if bf16 else 0.0)
        out["formula_grad_bytes_per_param"] = grads
        share = r_eff / world
        out["root_parameters"] = root
        out["precision"] = "bf16" if bf16 else "fp32"
        per_param = 6.0 if bf16 else 4.0  # the masters, and bf16's copy
        if zero >= 3 and bf16:  # the held masters (no unit's sharded too), and the copies of no unit's
            out["formula_param_bytes_per_param"] = 4.0 * share + 2.0 * root / params
        elif zero >= 3:  # the held masters and those of no unit
            out["formula_param_bytes_per_param"] = 4.0 * share + 4.0 * (root / params) * (1 - share)
        elif masters_sharded:  # bf16 at zero 1 and 2: the held masters, and the whole bf16 copy
            out["formula_param_bytes_per_param"] = 4.0 * share + 2.0
        else:
            out["formula_param_bytes_per_param"] = per_param
        out["formula_total_bytes_per_param"] = out["formula_param_bytes_per_param"] + grads + out["formula_optimizer_bytes_per_param"]
        out["total_vs_formula"] = out["total_bytes_per_param"] / out["formula_total_bytes_per_param"]
        out["optimizer_vs_formula"] = out["optimizer_bytes_per_param"] / out["formula_optimizer_bytes_per_param"]
        return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=os.path.join(os.path.dirname(__file__), "..", "build", "dtactor"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--configs", default="")
    a = ap.parse_args()
    configs = [(1, 1, 0, 0), (1, 1, 1, 0), (1, 1, 2, 0),
               (2, 1, 0, 0), (2, 1, 1, 0), (2, 1, 2, 0),
               (2, 2, 0, 0), (2, 2, 1, 0), (2, 2, 2, 0), (2, 2, 1, 1), (2, 2, 2, 1),
               (4, 1, 1, 0), (4, 1, 2, 0)]
    if a.configs:
        configs = [tuple(int(x) for x in c.split(",")) for c in a.configs.split(";")]
    rows = []
    for (n, p, z, r) in configs:
        rows.append(run(a.binary, n, p, z, r, a.steps, a.set))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    # The page's figures: at each world, the state a rank holds a parameter
    # at each sharded level against zero=0 in the same layout, and what was
    # measured over the formula.
    F = bench_meta.figure
    figures = []
    for i, r in enumerate(rows):
        base = [j for j, b in enumerate(rows) if b["zero"] == 0 and (b["nodes"], b["ranks_per_node"]) == (r["nodes"], r["ranks_per_node"])]
        if r["zero"] == 0 and len(rows) > 1 and base:
            continue
        what = "world %d (%d nodes x %d), zero=%d%s: state bytes a parameter on a rank" % (
            r["world"], r["nodes"], r["ranks_per_node"], r["zero"], ", R = %s" % r["replicas"] if r.get("replicas") else "")
        figures.append(F(what, ["rows", i, "total_bytes_per_param"], "B/param", "zero=0" if base else None,
                         ["rows", base[0], "total_bytes_per_param"] if base else None))
        figures.append(F(what.replace("state bytes a parameter on a rank", "measured over the formula"), ["rows", i, "total_vs_formula"], "x"))
    notes = ("Formulas, fp32, W ranks, R holders a shard: zero=0 20 B a parameter (16 at world 1); zero=2 4 + 12R/W; "
             "zero=3 16R/W + 4(1 - R/W) for each parameter of no unit. With train.precision=bf16 (fp32 masters, sharded from zero=1 on, and a bf16 copy): "
             "zero=0 6 of parameters (fp32 masters and the bf16 copy) and 2 more of gradients; zero=1 2 + 4R/W of parameters and 2 + 4R/W of gradients (whole bf16 ones, the float32 ones of the held windows) beside the buckets' 4; zero=2 2 + 16R/W; zero=3 16R/W + 2 for each parameter of no unit (its masters sharded too, its bf16 copy on every rank; a unit's bf16 copies exist only while it is gathered). The ZeRO paper (Rajbhandari et al., SC'20) counts mixed precision "
             "without replicas: 16, ZeRO-2 2 + 14/W, ZeRO-3 16/W; FSDP's full shard in fp32 holds 16/W plus the units being gathered.")
    print(json.dumps(bench_meta.stamped({"settings": a.set, "rows": rows},
                                        "State a rank holds by train.zero level, from each rank's report%s"
                                        % (" (%s)" % ", ".join(a.set) if a.set else ""), "Sharded state (ZeRO)", figures, notes=notes), indent=1))


if __name__ == "__main__":
    main()
