#!/usr/bin/python3
"""Quality at equal steps: train.precision = fp32 against bf16 (bf16
parameters and gradients, fp32 master weights), the same job otherwise
(`dtactor local --nodes 2`, the project's defaults unless --set), for the
default ViT and for a config given with --config (the GPT example),
evaluated at the end. Prints one JSON line per run and writes the whole JSON.

Usage: bench/precision_quality.py [--nodes 2] [--vit-steps 4000] [--config examples/gpt_gcide.toml]
  [--config-steps 1000] [--set KEY=VALUE ...] [--dtactor build/dtactor] [--out bench/precision_quality_results.json]"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_meta  # noqa: E402
import diloco_quality  # noqa: E402


def run(binary, nodes, steps, sets, config):
    """diloco_quality's run (`dtactor local`, evaluated at the end), its last evaluation as `final`."""
    r = diloco_quality.run(binary, nodes, steps, sets, config)
    if not r["evals"]:
        raise SystemExit("no evaluation in the journal")
    return {"wall_s": r["wall_s"], "final": r["evals"][-1]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--vit-steps", type=int, default=4000)
    ap.add_argument("--config", default=os.path.join(HERE, "..", "examples", "gpt_gcide.toml"))
    ap.add_argument("--config-steps", type=int, default=1000)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--dtactor", default=os.path.join(HERE, "..", "build", "dtactor"))
    ap.add_argument("--out", default=os.path.join(HERE, "precision_quality_results.json"))
    a = ap.parse_args()
    jobs = [("vit", None, a.vit_steps), ("gpt", a.config, a.config_steps)]
    runs = {}
    for name, config, steps in jobs:
        for precision in ("fp32", "bf16"):
            key = "%s %s" % (name, precision)
            runs[key] = run(a.dtactor, a.nodes, steps, ["train.precision=" + precision, *a.set], config)
            runs[key]["steps"] = steps
            print(json.dumps({key: runs[key]}), flush=True)
    F = bench_meta.figure
    figures = [
        F("default ViT, %d steps: accuracy with train.precision = bf16" % a.vit_steps, ["runs", "vit bf16", "final", "accuracy"], "accuracy",
          "fp32", ["runs", "vit fp32", "final", "accuracy"]),
        F("GPT example, %d steps: validation loss with train.precision = bf16" % a.config_steps, ["runs", "gpt bf16", "final", "val_loss"], "loss",
          "fp32", ["runs", "gpt fp32", "final", "val_loss"]),
    ]
    notes = ("One run of each, %d nodes of one rank on this machine, the project's defaults but train.precision (and the GPT example's "
             "config). bf16: bf16 parameters, activations and gradients, gradients summed in fp32, fp32 master weights and AdamW moments. "
             "The bar: within 0.5 accuracy points or 2%% of the validation loss at equal steps. Quality only: the runs' wall "
             "times (under runs) are one run each, not paired, on a machine that may be loaded." % a.nodes)
    out = bench_meta.stamped({"nodes": a.nodes, "sets": a.set, "config": os.path.relpath(a.config, os.path.join(HERE, "..")), "runs": runs},
                             "bf16 mixed precision against fp32 at equal steps: the default ViT and the GPT example, %d nodes" % a.nodes,
                             "Sharded state (ZeRO)", figures, notes=notes)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out["figures"]))


if __name__ == "__main__":
    main()
