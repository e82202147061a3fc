#!/usr/bin/python3.11
"""Reads what `dtactor export` wrote, in PyTorch, as a user would.
  check_export.py module FILE FIXTURES   -> prints the held-out accuracy of the scripted module
  check_export.py state_dict FILE FIXTURES -> loads it into a fresh MLP (the fixture's class) and prints its accuracy"""
import sys

import numpy as np
import torch

kind, path, fix = sys.argv[1], sys.argv[2], sys.argv[3]
x = torch.from_numpy(np.load(fix + "/x_eval.npy"))
y = torch.from_numpy(np.load(fix + "/y_eval.npy"))
if kind == "module":
    m = torch.jit.load(path)
else:
    sd = torch.load(path)
    m = torch.jit.load(fix + "/mlp.pt")  # the untrained module: same names and shapes as its state_dict()
    want = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in sd.items()}
    if want != got:
        sys.exit(f"state_dict names/shapes differ: {sorted(want.items())} vs {sorted(got.items())}")
    m.load_state_dict(sd)
m.eval()
with torch.no_grad():
    acc = (m(x).argmax(1) == y).float().mean().item()
print(f"{acc:.6f}")
