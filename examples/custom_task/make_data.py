#!/usr/bin/env python3
"""Writes train.csv and eval.csv: three interleaved noisy spirals in the
plane (x, y, class), the data set of examples/custom_task. Standard library
only. Usage: make_data.py [OUT_DIR]"""
import math
import os
import random
import sys


def spirals(n, rng):
    rows = []
    for i in range(n):
        c = i % 3
        t = rng.random()
        r = 0.1 + 0.9 * t
        a = 3.5 * t + 2 * math.pi * c / 3 + rng.gauss(0, 0.12)
        rows.append((r * math.cos(a), r * math.sin(a), c))
    return rows


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out, exist_ok=True)
    rng = random.Random(7)
    for name, n in (("train.csv", 6000), ("eval.csv", 1500)):
        with open(os.path.join(out, name), "w") as f:
            f.write("x,y,label\n")
            for x, y, c in spirals(n, rng):
                f.write(f"{x:.6f},{y:.6f},{c}\n")
    print(f"wrote {out}/train.csv and {out}/eval.csv")


if __name__ == "__main__":
    main()
