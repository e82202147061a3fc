#!/usr/bin/env python3
"""Writes train.csv and eval.csv: three interleaved noisy spirals in the
plane (x, y, class), the data set of examples/custom_task. Standard library
only.

Usage: make_data.py [OUT_DIR] [--shards N]

With --shards N the training rows (the same rows, in the same order) go
into N shards instead, train-000.csv .. train-<N-1>.csv, each with the
header line; eval.csv is written as before. Train from them with
data.train_csv = "OUT_DIR/train-*.csv" (index them once with
`dtactor data index 'OUT_DIR/train-*.csv'`)."""
import argparse
import math
import os
import random


def spirals(n, rng):
    rows = []
    for i in range(n):
        c = i % 3
        t = rng.random()
        r = 0.1 + 0.9 * t
        a = 3.5 * t + 2 * math.pi * c / 3 + rng.gauss(0, 0.12)
        rows.append((r * math.cos(a), r * math.sin(a), c))
    return rows


def write(path, rows):
    with open(path, "w") as f:
        f.write("x,y,label\n")
        for x, y, c in rows:
            f.write(f"{x:.6f},{y:.6f},{c}\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default=".", help="output directory (default: .)")
    ap.add_argument("--shards", type=int, default=0, metavar="N", help="write the training rows as N shards train-NNN.csv")
    args = ap.parse_args()
    if args.shards < 0 or args.shards > 1000:
        ap.error("--shards must be between 1 and 1000")
    os.makedirs(args.out, exist_ok=True)
    rng = random.Random(7)
    train, held_out = spirals(6000, rng), spirals(1500, rng)
    if args.shards:
        # Shard k holds rows [k*n/N, (k+1)*n/N): sizes differ by one at most.
        n = len(train)
        for k in range(args.shards):
            write(os.path.join(args.out, f"train-{k:03d}.csv"), train[k * n // args.shards:(k + 1) * n // args.shards])
        what = f"{args.shards} shards {args.out}/train-000.csv .. train-{args.shards - 1:03d}.csv"
    else:
        write(os.path.join(args.out, "train.csv"), train)
        what = f"{args.out}/train.csv"
    write(os.path.join(args.out, "eval.csv"), held_out)
    print(f"wrote {what} and {args.out}/eval.csv")


if __name__ == "__main__":
    main()
